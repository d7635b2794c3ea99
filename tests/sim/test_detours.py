"""Detours (``collect --detours``; collect's records of slowdowns too): the arm heads for a decoy's answer after go while the stored actions stay the
true expert's; the draws are per seed; the episode still succeeds; clear errors for tasks without a go step."""

import importlib.util
import json

import numpy as np
import pytest

from vla_runtime.data import LeRobotDataset
from vla_runtime.sim import MetaWorldConfig, MetaWorldEnv
from vla_runtime.sim.actions import MetaWorldActions
from vla_runtime.sim.collect import CollectConfig, collect, record_cue_steps, run_expert_episode
from vla_runtime.sim.memory import MEMORY_TASKS, CountingTask, TallyTask
from vla_runtime.sim.memory.base import move_toward
from vla_runtime.sim.memory.detour import DECOY_MIN_DISTANCE, DETOUR_STEPS, draw_detour
from vla_runtime.sim.memory.reach import OPEN
from vla_runtime.sim.memory.slowdown import draw_slowdown

needs_metaworld = pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed")
REACH_TASKS = ["memory-reference", "memory-order", "memory-tally"]


@pytest.fixture(scope="module")
def blind_env():
    with MetaWorldEnv(MetaWorldConfig(cameras=())) as env:
        yield env


def test_detour_draws_are_per_seed_and_task_and_follow_the_fraction():
    episodes = [TallyTask.sample(seed) for seed in range(200)]
    drawn = [draw_detour(ep, seed, 0.5) for seed, ep in enumerate(episodes)]
    again = [draw_detour(ep, seed, 0.5) for seed, ep in enumerate(episodes)]
    assert [d and d.record() for d in drawn] == [d and d.record() for d in again]
    assert 70 <= sum(d is not None for d in drawn) <= 130  # Binomial(200, 0.5): fixed seeds, no flakiness
    assert all(draw_detour(ep, seed, 0.0) is None for seed, ep in enumerate(episodes))
    assert all(draw_detour(ep, seed, 1.0) is not None for seed, ep in enumerate(episodes))
    for seed, (ep, d) in enumerate(zip(episodes, drawn)):
        if d is not None:
            assert d.start == ep.go_step and DETOUR_STEPS[0] <= d.steps <= DETOUR_STEPS[1]
            assert np.linalg.norm(d.decoy.target - ep.target()) >= DECOY_MIN_DISTANCE
    order = MEMORY_TASKS["memory-order"]
    other_task = [draw_detour(order.sample(seed), seed, 1.0).steps for seed in range(50)]
    assert other_task != [draw_detour(TallyTask.sample(seed), seed, 1.0).steps for seed in range(50)]


@needs_metaworld
@pytest.mark.sim
@pytest.mark.parametrize("task", REACH_TASKS)
def test_a_detour_heads_for_the_decoy_while_the_labels_steer_to_the_answer(blind_env, task):
    actions = MetaWorldActions()
    steered_seeds = 0
    for seed in range(3):
        detour = draw_detour(MEMORY_TASKS[task].sample(seed), seed, 1.0)
        rollout = run_expert_episode(blind_env, task, seed, detours=1.0)
        target = blind_env.memory_episode.target()
        assert rollout.success and rollout.detour == [detour.start, detour.steps]
        hand, stored = rollout.episode.state[:, :3], rollout.episode.action
        go, end = detour.start, detour.start + detour.steps
        # every stored action is the true expert's at the state it was stored at, in the detour too
        for t in range(go, len(stored)):
            label = actions.from_native(move_toward(hand[t], target, OPEN))
            np.testing.assert_allclose(stored[t], label, atol=1e-6)
        # ... while the executed ones took the hand toward the decoy's answer, a step at a time
        steps = np.diff(hand[go : end + 1], axis=0)
        toward_decoy = [actions.from_native(move_toward(hand[t], detour.decoy.target, OPEN))[:3] for t in range(go, end)]
        cos = [float(s @ d) / (np.linalg.norm(s) * np.linalg.norm(d) + 1e-12) for s, d in zip(steps[1:], toward_decoy[1:])]
        assert np.mean(cos) > 0.9 and min(cos) > 0.5, cos  # (the first step starts from rest; the hand lags)
        clean = run_expert_episode(blind_env, task, seed)
        assert clean.detour == [] and np.array_equal(clean.episode.state[:go], rollout.episode.state[:go])  # cue, delay
        # a decoy whose way starts like the answer's (both beyond full speed in every axis) drives what the expert would
        steered = any(np.abs(d - stored[t, :3]).max() > 1e-6 for t, d in zip(range(go, end), toward_decoy))
        assert steered == (not np.array_equal(clean.episode.state, rollout.episode.state))
        steered_seeds += steered
    assert steered_seeds > 0


@needs_metaworld
@pytest.mark.sim
@pytest.mark.parametrize("kind, draw, other, seed", [("detours", draw_detour, "slowdowns", 0), ("slowdowns", draw_slowdown, "detours", 3)])
def test_collect_records_each_episodes_detour_or_slowdown(tmp_path, kind, draw, other, seed):
    env = MetaWorldConfig(cameras=("corner",), resolution=(16, 16))
    out = tmp_path / "ds"
    results = collect(CollectConfig(tasks=["memory-tally"], episodes=4, out=out, seed=seed, env=env, **{kind: 0.5}), progress=False)
    assert results["memory-tally"].kept == 4
    ds = LeRobotDataset(out)
    recorded = ds.extra["per_episode"][f"episode_{kind}"]
    expected = [draw(TallyTask.sample(s), s, 0.5) for s in ds.extra["per_episode"]["episode_seeds"]]
    assert recorded == [[] if d is None else d.record() for d in expected]
    assert ds.extra[kind] == 0.5 and any(recorded) and not all(recorded)
    assert other not in ds.extra and f"episode_{other}" not in ds.extra["per_episode"]
    # the cue steps of such a dataset can be recorded again: the replay repeats each episode's detour or slowdown
    cue_steps = ds.extra["per_episode"]["episode_cue_steps"]
    extra_path = out / "meta/vla_runtime.json"
    extra = json.loads(extra_path.read_text())
    del extra["per_episode"]["episode_cue_steps"]
    extra_path.write_text(json.dumps(extra))
    assert record_cue_steps(out, MetaWorldConfig(resolution=(16, 16)), progress=False) == cue_steps


def test_detours_need_a_task_with_a_go_step(tmp_path):
    with pytest.raises(ValueError, match="go step.*reach-v3"):
        CollectConfig(tasks=["reach-v3"], episodes=1, out=tmp_path / "a", detours=0.5)
    with pytest.raises(ValueError, match="memory-counting"):
        CollectConfig(tasks=["memory-tally", "memory-counting"], episodes=1, out=tmp_path / "b", detours=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\], got 1.5"):
        CollectConfig(tasks=["memory-tally"], episodes=1, out=tmp_path / "c", detours=1.5)
    with pytest.raises(ValueError, match="memory-counting has none"):
        draw_detour(CountingTask.sample(0), 0, 0.5)
    CollectConfig(tasks=["reach-v3"], episodes=1, out=tmp_path / "d")  # no detours: any task
