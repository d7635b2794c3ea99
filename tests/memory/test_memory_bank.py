"""Segments, grouping with the real all-MiniLM-L6-v2, static/dynamic transitions, retrieval."""

import pytest

from vla_runtime.memory import EmbodiedMemory, MemoryConfig

OBJECTS = {
    "apple": "{'object': 'Apple', 'state': 'sliced', 'position': 'in the fridge'}",
    "mug": "{'object': 'Mug', 'state': 'clean', 'position': 'on the countertop'}",
    "knife": "{'object': 'Knife', 'state': 'dirty', 'position': 'in the sink'}",
}
RULES = {
    "rule0": "Rule: I can only hold one thing at a time.",
    "rule1": "Rule: before I put something down, I first find the place to put it.",
}


def make(encoder, **cfg) -> EmbodiedMemory:
    mem = EmbodiedMemory(encoder, MemoryConfig(**cfg))
    for sid, text in {**OBJECTS, **RULES}.items():
        mem.add(sid, text)
    return mem


def test_encoder_embeds_by_meaning(encoder):
    e = encoder.encode(["pick up the red block", "grasp the red cube", "open the drawer"])
    assert e.shape == (3, 384)
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.15


def test_segments_cluster_by_meaning(encoder):
    mem = make(encoder, cluster_threshold=0.5)
    group = {s.id: s.group for s in mem.segments()}
    assert group["apple"] == group["mug"] == group["knife"]
    assert group["rule0"] != group["apple"]
    # the size cap splits a cluster
    capped = make(encoder, cluster_threshold=0.5, max_group_size=2)
    assert len({capped.get(s).group for s in OBJECTS}) == 2


def test_versions_and_steps_are_tracked(encoder):
    mem = make(encoder)
    mem.advance(3)
    assert mem.update("apple", OBJECTS["apple"]) is False  # same text: nothing changes
    assert mem.update("apple", OBJECTS["apple"].replace("sliced", "heated")) is True
    seg = mem.get("apple")
    assert (seg.version, seg.changed_step) == (1, 3)
    mem.delete("knife")
    assert "knife" not in mem and len(mem) == 4
    with pytest.raises(KeyError, match="knife"):
        mem.update("knife", "x")
    with pytest.raises(ValueError, match="already exists"):
        mem.add("apple", "x")
    with pytest.raises(ValueError, match="non-empty"):
        mem.add("empty", "  ")


def test_groups_turn_static_after_exactly_t_unchanged_steps(encoder):
    mem = make(encoder, static_after=10)
    objects = mem.get("apple").group
    group = next(g for g in mem.groups() if g.id == objects)
    mem.advance(9)
    assert not mem.is_static(group)
    mem.advance(1)  # step 10: unchanged for 10 steps
    assert mem.is_static(group)
    assert any(u.static and {s.id for s in u.segments} == set(OBJECTS) for u in mem.units())
    mem.advance(2)
    mem.update("mug", OBJECTS["mug"].replace("clean", "dirty"))  # step 12: one member changes
    assert not mem.is_static(group)
    assert {u.id for u in mem.units() if not u.static} >= set(OBJECTS)  # dynamic: one unit per segment
    mem.advance(9)
    assert not mem.is_static(group)
    mem.advance(1)  # step 22
    assert mem.is_static(group)
    # membership changes count as changes
    mem.delete("knife")
    assert not mem.is_static(group)


def test_retrieval_takes_static_groups_whole_and_keeps_a_stable_order(encoder):
    mem = make(encoder, static_after=2, top_k=2)
    dynamic = mem.retrieve("Where is the apple?", k=2)
    assert [u.id for u in dynamic][0] == "apple" or "apple" in [u.id for u in dynamic]
    assert all(not u.static for u in dynamic) and sum(len(u.segments) for u in dynamic) == 2
    mem.advance(2)
    # the 3-object group no longer fits in k=2: the best single units fill it
    units = mem.retrieve("Where is the apple?", k=2)
    assert all(len(u.segments) == 1 for u in units)
    units = mem.retrieve("Where is the apple?", k=4)
    assert units[0].static and {s.id for s in units[0].segments} == set(OBJECTS)
    assert sum(len(u.segments) for u in units) <= 4
    # order: static groups first, then dynamic segments by creation order, whatever the scores
    assert [u.id for u in mem.retrieve("hold one thing", k=5)] == [u.id for u in mem.units()]


def test_retrieval_ranks_an_updated_segment_by_its_new_text(encoder):
    mem = make(encoder, top_k=1)
    mem.upsert("mug", "Rule: the fridge door must be closed after use.")  # the mug's segment now says this
    assert [u.id for u in mem.retrieve("Is the fridge door closed?", k=1)] == ["mug"]
    with pytest.raises(ValueError, match="ids starting with '<' are the prefill's own"):
        mem.add("<prefix>", "x")
