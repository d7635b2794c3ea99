"""KitchenWorld: a seeded household whose memory changes every step, with questions whose answers
are scored by candidate log-likelihood (keep.md §5.2).

Memory segments, short sentences (position first, so the answer follows the words a question repeats):
  * objects: "The apple is in the fridge, sliced."; receptacles stand in rooms and may be
    opened/closed: "The fridge is in the kitchen, closed.", "The sofa is in the living room.";
  * rules and few-shot examples in LoTA-Bench's ``Human: ... Robot: 1. ..., 2. ...`` format (never change).
Each step applies 1-2 actions (pick, put, open, close, slice, heat, clean, dirty) that rewrite 1-3
segments, mostly on a few "active" objects (the rest of the house stays put, so groups can turn
static), then asks one question, answered by the candidate continuation with the highest likelihood:
  * ``where``: "Where is the apple?" / "The apple is" -> " in the fridge" among ``n_choices`` receptacles;
  * ``state``: "What state is the apple in?" / "The apple is in the fridge," -> " sliced";
  * ``room`` (the answer is in another segment than the one the question names): "Which room is the
    apple in?" / "The apple is in the fridge. The fridge is in the" -> " kitchen". The first hop is
    spelled out: SmolLM2-135M does not make it itself (near chance when it has to).
Calibrated so that full recomputation with SmolLM2-135M answers most questions (issue 20): the
earlier dict segments (``{'object': ..., 'state': ..., 'position': ...}``) with 20 receptacle
candidates and un-cued 2-hop questions left it right on 1-4 of 10 questions per kind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

ROOMS = ["kitchen", "living room", "bedroom", "bathroom"]

# receptacle -> (room, openable)
RECEPTACLES = {
    "Fridge": ("kitchen", True),
    "Drawer": ("kitchen", True),
    "Cabinet": ("kitchen", True),
    "Microwave": ("kitchen", True),
    "Countertop": ("kitchen", False),
    "Sink": ("kitchen", False),
    "Stove": ("kitchen", False),
    "Dining Table": ("living room", False),
    "Coffee Table": ("living room", False),
    "Shelf": ("living room", False),
    "Sofa": ("living room", False),
    "Box": ("living room", True),
    "Bed": ("bedroom", False),
    "Nightstand": ("bedroom", True),
    "Dresser": ("bedroom", True),
    "Desk": ("bedroom", False),
    "Bathtub": ("bathroom", False),
    "Towel Rack": ("bathroom", False),
    "Laundry Basket": ("bathroom", False),
    "Bathroom Cabinet": ("bathroom", True),
}

# portable object -> states it can take
FOOD = ["whole", "sliced", "heated", "cooked"]
DISH = ["clean", "dirty", "filled"]
THING = ["new", "used up"]
OBJECTS = {
    "Apple": FOOD, "Bread": FOOD, "Tomato": FOOD, "Potato": FOOD, "Egg": FOOD, "Lettuce": FOOD,
    "Mug": DISH, "Cup": DISH, "Bowl": DISH, "Plate": DISH, "Pan": DISH, "Pot": DISH,
    "Knife": ["clean", "dirty"], "Fork": ["clean", "dirty"], "Spoon": ["clean", "dirty"],
    "Book": THING, "Remote Control": THING, "Phone": ["on", "off"], "Keys": THING, "Pen": THING,
    "Towel": ["clean", "dirty"], "Soap": THING, "Pillow": THING, "Laptop": ["on", "off"],
    "Candle": ["on", "off"], "Vase": THING,
}  # fmt: skip

RULES = [
    "Rule: before I put something down, I first find the place to put it.",
    "Rule: I can only hold one thing at a time.",
    "Rule: to slice something, I first find and pick up the knife, then find and slice the target.",
]

EXAMPLES = [
    "Example: Human: put a sliced apple in the fridge. Robot: 1. find a knife, 2. pick up the knife, 3. find an apple, 4. slice the apple, 5. put down the knife, 6. pick up the apple, 7. find a fridge, 8. open the fridge, 9. put down the apple, 10. done.",
    "Example: Human: heat a mug of water. Robot: 1. find a mug, 2. pick up the mug, 3. find a microwave, 4. open the microwave, 5. put down the mug, 6. close the microwave, 7. turn on the microwave, 8. done.",
    "Example: Human: put the book on the shelf. Robot: 1. find a book, 2. pick up the book, 3. find a shelf, 4. put down the book, 5. done.",
    "Example: Human: clean the plate and put it in the cabinet. Robot: 1. find a plate, 2. pick up the plate, 3. find a sink, 4. put down the plate, 5. turn on the faucet, 6. pick up the plate, 7. find a cabinet, 8. open the cabinet, 9. put down the plate, 10. done.",
    "Example: Human: bring the remote control to the sofa. Robot: 1. find a remote control, 2. pick up the remote control, 3. find a sofa, 4. put down the remote control, 5. done.",
    "Example: Human: cook a potato. Robot: 1. find a potato, 2. pick up the potato, 3. find a stove, 4. put down the potato, 5. turn on the stove, 6. done.",
]

HAND = "in the robot's hand"
KINDS = ("where", "state", "room")  # the question kinds, asked in turn
# a fixed filler in the memory's own format about things no world has: stored units prefilled after
# [system prefix][UNIT_CONTEXT] look like lines deep in a memory (issue 20)
UNIT_CONTEXT = "The lamp is on the windowsill, off.\nThe rug is in the hallway, clean.\nThe umbrella is in the closet, dry.\n"
SYSTEM = (
    "<|im_start|>system\nYou are a household robot. Answer questions from your memory of the house.<|im_end|>\n"
    "<|im_start|>user\nMemory:\n"
)


def where_phrase(receptacle: str) -> str:
    """"in the fridge", "on the sofa": where a thing put into ``receptacle`` is."""
    return f"in the {receptacle.lower()}" if RECEPTACLES[receptacle][1] or receptacle in ("Sink", "Bathtub", "Laundry Basket", "Box") else f"on the {receptacle.lower()}"


def obj_text(name: str, state: str, position: str) -> str:
    """An object's segment, position first: "The apple is in the fridge, sliced." (receptacles that
    cannot be opened have no state: "The sofa is in the living room.")."""
    return f"The {name.lower()} is {position}, {state}." if state != "none" else f"The {name.lower()} is {position}."


@dataclass(frozen=True)
class Question:
    kind: str  # where | state | room
    subject: str
    text: str  # the user question
    answer_prefix: str  # the assistant's words before the candidates
    candidates: tuple[str, ...]  # continuations, each starting with a space
    gold: int


@dataclass
class KitchenWorld:
    """The house: object states and positions, receptacle states. ``step()`` changes it."""

    seed: int = 0
    n_active: int = 8
    n_choices: int = 4  # candidates of a "where" question (the 135M model picks badly among all 20)
    rng: random.Random = field(init=False)
    objects: dict[str, list[str]] = field(init=False)  # name -> [state, receptacle or HAND]
    receptacles: dict[str, str] = field(init=False)  # name -> opened | closed | none
    holding: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        names = list(OBJECTS)
        self.objects = {n: [self.rng.choice(OBJECTS[n]), self.rng.choice(list(RECEPTACLES))] for n in names}
        self.receptacles = {r: ("closed" if openable else "none") for r, (_, openable) in RECEPTACLES.items()}
        self.active = self.rng.sample(names, self.n_active)
        if not 2 <= self.n_choices <= len(RECEPTACLES):
            raise ValueError(f"`n_choices` must be in [2, {len(RECEPTACLES)}], got {self.n_choices}")

    # ---- memory view ----------------------------------------------------------------------------
    def segment_texts(self) -> dict[str, str]:
        """segment id -> text, for every piece of memory."""
        out = {f"rule:{i}": r for i, r in enumerate(RULES)}
        out.update({f"example:{i}": e for i, e in enumerate(EXAMPLES)})
        for r, (room, _) in RECEPTACLES.items():
            out[f"obj:{r}"] = obj_text(r, self.receptacles[r], f"in the {room}")
        for n, (state, where) in self.objects.items():
            out[f"obj:{n}"] = obj_text(n, state, HAND if where == HAND else where_phrase(where))
        return out

    # ---- dynamics -------------------------------------------------------------------------------
    def _pick_object(self) -> str:
        if self.rng.random() < 0.85:
            return self.rng.choice(self.active)
        return self.rng.choice(list(self.objects))

    def step(self) -> list[str]:
        """Apply 1-2 random actions; returns the descriptions of everything they did, in order."""
        done = []
        for _ in range(self.rng.choice([1, 2])):
            done.extend(self._act())
        return done

    def _act(self) -> list[str]:
        r = self.rng.random()
        if self.holding is not None and r < 0.5:
            return [self._put(self.rng.choice(list(RECEPTACLES)))]
        if r < 0.6:
            obj = self._pick_object()
            done = []
            if self.holding is not None:  # one thing at a time: what the hand holds is put down first
                done.append(self._put(self.rng.choice(list(RECEPTACLES))))
            self.objects[obj][1] = HAND
            self.holding = obj
            return done + [f"pick up the {obj.lower()}"]
        if r < 0.75:
            target = self.rng.choice([x for x, (_, o) in RECEPTACLES.items() if o])
            self.receptacles[target] = "closed" if self.receptacles[target] == "opened" else "opened"
            return [f"{'open' if self.receptacles[target] == 'opened' else 'close'} the {target.lower()}"]
        obj = self._pick_object()
        states = [s for s in OBJECTS[obj] if s != self.objects[obj][0]]
        self.objects[obj][0] = self.rng.choice(states)
        return [f"make the {obj.lower()} {self.objects[obj][0]}"]

    def _put(self, target: str) -> str:
        """Put what the hand holds into ``target`` (opening it if it opens)."""
        if RECEPTACLES[target][1]:
            self.receptacles[target] = "opened"
        self.objects[self.holding][1] = target
        obj, self.holding = self.holding, None
        return f"put the {obj.lower()} {where_phrase(target)}"

    # ---- questions ------------------------------------------------------------------------------
    def question(self, kind: str) -> Question:
        placed = [n for n, (_, w) in self.objects.items() if w != HAND]
        pool = [n for n in self.active if n in placed] or placed
        subject = self.rng.choice(pool)
        state, where = self.objects[subject]
        noun = subject.lower()
        where_text = where_phrase(where)
        if kind == "where":  # the true receptacle and n_choices - 1 others, in a fixed order
            others = self.rng.sample([r for r in RECEPTACLES if r != where], self.n_choices - 1)
            options = [r for r in RECEPTACLES if r == where or r in others]
            cands = tuple(f" {where_phrase(r)}" for r in options)
            return Question(kind, subject, f"Where is the {noun}?", f"The {noun} is", cands, options.index(where))
        if kind == "state":
            states = OBJECTS[subject]
            cands = tuple(f" {s}" for s in states)
            return Question(kind, subject, f"What state is the {noun} in?", f"The {noun} is {where_text},", cands, states.index(state))
        if kind == "room":  # the first hop is spelled out; the answer is in the receptacle's segment
            cands = tuple(f" {r}" for r in ROOMS)
            room = RECEPTACLES[where][0]
            prefix = f"The {noun} is {where_text}. The {where.lower()} is in the"
            return Question(kind, subject, f"Which room is the {noun} in?", prefix, cands, ROOMS.index(room))
        raise KeyError(f"unknown question kind {kind!r}; known: where, state, room")
