"""PlanWorld: KitchenWorld's house over long episodes with an event log, where the planner's next
subtask is the answer (a LoTA-Bench style plan; issue 20's second workload).

Memory segments: KitchenWorld's object and receptacle sentences, rules and examples, plus an
**event log**, one segment per action: "Step 14: I picked up the apple." The last ``log_len`` events
are kept (older ones are deleted from memory), so the memory both changes in place (objects,
receptacles) and grows and shrinks (events); an event never changes once written, so events turn
static while objects churn. Questions, each scored by candidate log-likelihood:

  * ``fetch``: "Plan: bring the apple to me." / "Robot: 1. find the apple" -> " in the fridge" among
    ``n_choices`` receptacles (the next subtask says where the object is; until 2026-11-30 the answer
    opened "Robot: 1. go to the" -> " fridge", on which full recomputation was right on 29 %);
  * ``open``: the same goal with the first step done, "Robot: 1. go to the fridge, 2." ->
    " open the fridge" or " pick up the apple" (the answer is in another segment than the one the
    goal names: whether the receptacle is closed);
  * ``recall``: "Which object did I pick up at step 14?" / "At step 14, I picked up the" -> " apple"
    among ``n_choices`` objects (the answer is in an event segment).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kitchen_world import HAND, OBJECTS, RECEPTACLES, KitchenWorld, Question, where_phrase

KINDS = ("fetch", "open", "recall")
SYSTEM = (
    "<|im_start|>system\nYou are a household robot. Plan your next step from your memory of the house.<|im_end|>\n"
    "<|im_start|>user\nMemory:\n"
)

# the unit context filler in this memory's own mix of lines (an object, two events), about nothing the
# world has: stored units prefilled after it look like lines deep in such a memory (issue 20)
UNIT_CONTEXT = "The lamp is on the windowsill, off.\nStep 0: I looked around the hallway.\nStep 0: I waited by the door.\n"


@dataclass
class PlanWorld(KitchenWorld):
    """KitchenWorld plus an event log of the last ``log_len`` actions."""

    log_len: int = 24
    t: int = field(init=False, default=0)
    events: list[tuple[int, int, str]] = field(init=False, default_factory=list)  # (step, index, text)
    picks: dict[int, str] = field(init=False, default_factory=dict)  # step -> the one object picked up then
    _pick_counts: dict[int, int] = field(init=False, default_factory=dict)  # step -> objects picked up then

    def step(self) -> list[str]:
        self.t += 1
        done = super().step()
        for i, what in enumerate(done):
            self.events.append((self.t, i, f"Step {self.t}: I {_past(what)}."))
        self._pick_counts[self.t] = sum(what.startswith("pick up the ") for what in done)
        self.events = self.events[-self.log_len :]
        # a recall question has one answer, in the log: a step that picked up two things (the second pick puts the
        # first down) is not asked about, nor one whose pick event fell off (the log cut the step in two)
        logged = {t: text.split("picked up the ", 1)[1].rstrip(".") for t, _, text in self.events if " I picked up the " in text}
        self._pick_counts = {t: n for t, n in self._pick_counts.items() if t in logged}
        self.picks = {t: obj for t, obj in logged.items() if self._pick_counts[t] == 1}
        return done

    def segment_texts(self) -> dict[str, str]:
        out = super().segment_texts()
        out.update({f"event:{t}:{i}": text for t, i, text in self.events})
        return out

    def question(self, kind: str) -> Question:
        placed = [n for n, (_, w) in self.objects.items() if w != HAND]
        if kind == "recall" and self.picks:
            t = self.rng.choice(sorted(self.picks))
            obj = self.picks[t]
            names = [n.lower() for n in OBJECTS]
            others = self.rng.sample([x for x in names if x != obj], self.n_choices - 1)
            options = [n for n in names if n == obj or n in others]
            return Question(kind, obj, f"Which object did I pick up at step {t}?", f"At step {t}, I picked up the",
                            tuple(f" {n}" for n in options), options.index(obj))  # fmt: skip
        if kind == "open":
            closable = [n for n in placed if RECEPTACLES[self.objects[n][1]][1]]
            closed = [n for n in closable if self.receptacles[self.objects[n][1]] == "closed"]
            if closable:  # closed half the time when any is: a put leaves its receptacle open
                pool = closed if closed and self.rng.random() < 0.5 else [n for n in closable if n not in closed] or closable
                subject = self.rng.choice([n for n in self.active if n in pool] or pool)
                where = self.objects[subject][1]
                noun, rec = subject.lower(), where.lower()
                cands = (f" open the {rec}", f" pick up the {noun}")
                gold = 0 if self.receptacles[where] == "closed" else 1
                return Question(kind, subject, f"Plan: bring the {noun} to me.", f"Robot: 1. go to the {rec}, 2.", cands, gold)
        subject = self.rng.choice([n for n in self.active if n in placed] or placed)  # fetch (and the fallbacks)
        where = self.objects[subject][1]
        others = self.rng.sample([r for r in RECEPTACLES if r != where], self.n_choices - 1)
        options = [r for r in RECEPTACLES if r == where or r in others]
        noun = subject.lower()
        return Question("fetch", subject, f"Plan: bring the {noun} to me.", f"Robot: 1. find the {noun}",
                        tuple(f" {where_phrase(r)}" for r in options), options.index(where))  # fmt: skip


def _past(action: str) -> str:
    """KitchenWorld's action description in the past tense: "pick up the apple" -> "picked up the apple"."""
    for now, past in (("pick up", "picked up"), ("put", "put"), ("open", "opened"), ("close", "closed"), ("make", "made")):
        if action.startswith(now + " "):
            return past + action[len(now) :]
    raise ValueError(f"unknown action {action!r}")
