"""bench_keep.py's pure parts: KitchenWorld's and PlanWorld's questions are answerable from their memory, and the per-size
summary carries intervals and paired tests computed from the per-question records (no model runs here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_keep import KINDS, summarize_size  # noqa: E402
import kitchen_world  # noqa: E402
import plan_world  # noqa: E402
from kitchen_world import HAND, OBJECTS, RECEPTACLES, ROOMS, KitchenWorld, where_phrase  # noqa: E402
from plan_world import KINDS as PLAN_KINDS  # noqa: E402
from plan_world import PlanWorld  # noqa: E402


def test_every_question_is_answered_by_its_memory():
    world = KitchenWorld(seed=3)
    for step in range(60):
        world.step()
        q = world.question(KINDS[step % len(KINDS)])
        texts = world.segment_texts()
        state, where = world.objects[q.subject]
        assert where != HAND
        assert len(set(q.candidates)) == len(q.candidates) and 0 <= q.gold < len(q.candidates)
        gold = q.candidates[q.gold].strip()
        if q.kind == "where":
            assert len(q.candidates) == world.n_choices
            assert f"is {gold}," in texts[f"obj:{q.subject}"]
        elif q.kind == "state":
            assert texts[f"obj:{q.subject}"].endswith(f", {gold}.")
        else:  # the room is in the receptacle's segment, which the answer prefix names
            assert f"in the {gold}" in texts[f"obj:{where}"] and where.lower() in q.answer_prefix
            assert RECEPTACLES[where][0] == gold


def test_world_validates_choices():
    with pytest.raises(ValueError, match="n_choices"):
        KitchenWorld(n_choices=1)


def _records():
    # 20 questions; keep agrees on 18, reuse on 10 (reuse right only where keep is too), full is right on 15
    recs = []
    for i in range(20):
        full = {"ttft_ms": 100.0 + i, "build_ms": 0.0, "answer": 0, "agree": 1, "correct": int(i < 15), "kl_cand": 0.0, "kl_token": 0.0, "share": 1.0, "built": 0}
        keep = {**full, "ttft_ms": 25.0 + i / 4, "agree": int(i < 18), "share": 0.2}
        reuse = {**full, "ttft_ms": 10.0, "agree": int(i < 10), "share": 0.0}
        recs.append({"kind": KINDS[i % 3], "tokens": 500, "methods": {"full": full, "keep": keep, "reuse": reuse}})
    return recs


def test_summary_has_intervals_and_paired_tests():
    s = summarize_size(_records(), ["full", "keep", "reuse"])
    assert s["questions"] == 20
    keep, reuse = s["methods"]["keep"], s["methods"]["reuse"]
    assert keep["agreement"]["estimate"] == pytest.approx(0.9)
    assert keep["agreement"]["low"] < 0.9 < keep["agreement"]["high"]
    assert s["methods"]["full"]["accuracy"]["estimate"] == pytest.approx(0.75)
    assert keep["speedup_vs_full"]["estimate"] == pytest.approx(109.5 / 27.375)
    # reuse agrees on 8 fewer questions, never where keep does not: McNemar p = 2 / 2^8
    assert (reuse["vs_keep"]["only_ref_agrees"], reuse["vs_keep"]["only_this_agrees"]) == (8, 0)
    assert reuse["vs_keep"]["mcnemar_p"] == pytest.approx(2 / 256)
    assert reuse["vs_keep"]["agreement_diff"]["estimate"] == pytest.approx(0.4)
    assert "vs_keep" not in keep


@pytest.mark.parametrize("seed", [0, 1, 4])  # seed 0 and 1: the bench's worlds, where the log once cut a step's pick off
def test_every_plan_question_is_answered_by_its_memory(seed):
    world = PlanWorld(seed=seed)
    kinds = set()
    world.step_log = {}  # step -> what it did (every pick, logged or not)
    for step in range(120):
        done = world.step()
        world.step_log[world.t] = done
        texts = world.segment_texts()
        events = [t for sid, t in texts.items() if sid.startswith("event:")]
        assert len(events) <= world.log_len
        q = world.question(PLAN_KINDS[step % len(PLAN_KINDS)])
        kinds.add((q.kind, q.gold if q.kind == "open" else None))
        assert len(set(q.candidates)) == len(q.candidates) and 0 <= q.gold < len(q.candidates)
        gold = q.candidates[q.gold].strip()
        if q.kind == "fetch":  # the next subtask goes where the object's segment says it is
            assert f" {gold}," in texts[f"obj:{q.subject}"] or texts[f"obj:{q.subject}"].endswith(f" {gold}.")
        elif q.kind == "open":  # open the receptacle iff its segment says closed
            where = world.objects[q.subject][1]
            assert texts[f"obj:{where}"].endswith(", closed.") == (gold == f"open the {where.lower()}")
        else:  # the event segment of that step names the object, and no other pick of that step
            step_no = q.answer_prefix.split()[2].rstrip(",")
            assert any(t == f"Step {step_no}: I picked up the {gold}." for t in events)
            assert sum(t.startswith(f"Step {step_no}: I picked up the ") for t in events) == 1
            assert sum(what.startswith("pick up the ") for what in world.step_log[int(step_no)]) == 1
    assert {k for k, _ in kinds} == set(PLAN_KINDS) and ("open", 0) in kinds and ("open", 1) in kinds


def test_the_event_log_agrees_with_where_things_are():
    """Every move is logged: an object's latest pick-up or put in the event log names where its segment puts it.
    (Picking something up while holding another once moved the held object to a receptacle without a word.)"""
    world = PlanWorld(seed=5)
    checked = 0
    for _ in range(200):
        world.step()
        last = {}  # object -> HAND or receptacle, by its latest logged move
        for _, _, text in world.events:
            for n in OBJECTS:
                if text.endswith(f": I picked up the {n.lower()}."):
                    last[n] = HAND
                for r in RECEPTACLES:
                    if text.endswith(f": I put the {n.lower()} {where_phrase(r)}."):
                        last[n] = r
        for n, where in last.items():
            assert world.objects[n][1] == where, (world.t, n, where, world.objects[n])
            checked += 1
        assert sum(w == HAND for _, w in world.objects.values()) <= 1  # one thing at a time
    assert checked > 500


@pytest.mark.parametrize("filler", [kitchen_world.UNIT_CONTEXT, plan_world.UNIT_CONTEXT], ids=["kitchen", "plan"])
def test_a_unit_context_filler_names_nothing_the_world_has(filler):
    """The *-ctx rows prefill stored units after the filler; it never enters the prompt, so it must not
    carry an answer: no object, receptacle or room of the house, and no step the event log can hold."""
    names = [n.lower() for n in [*OBJECTS, *RECEPTACLES, *ROOMS]]
    lines = filler.lower().splitlines()
    assert len(lines) == 3 and filler.endswith("\n")
    assert not [n for n in names if n in filler.lower()]
    steps = [int(w.rstrip(":")) for line in lines for w in line.split()[1:2] if line.startswith("step ")]
    assert all(s < 1 for s in steps)  # PlanWorld's events start at step 1
