"""Slowdowns (``collect --slowdowns``): after go the executed moves are the expert's scaled down by per-spell
factors while the stored actions stay the expert's; the draws are per seed and task; the episode still succeeds (collect's records: ``test_detours.py``);
clear errors for tasks without a go step."""

import importlib.util

import numpy as np
import pytest

from vla_runtime.sim import MetaWorldConfig, MetaWorldEnv
from vla_runtime.sim.actions import MetaWorldActions
from vla_runtime.sim.collect import CollectConfig, run_expert_episode
from vla_runtime.sim.memory import MEMORY_TASKS, CountingTask, TallyTask
from vla_runtime.sim.memory.base import move_toward
from vla_runtime.sim.memory.reach import OPEN
from vla_runtime.sim.memory.slowdown import SPEED_RANGE, SPELL_STEPS, draw_slowdown

needs_metaworld = pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed")


def _spells(factors: np.ndarray) -> list[int]:
    """Lengths of the runs of equal rows in factors [n, 3]."""
    change = np.flatnonzero(np.any(np.diff(factors, axis=0) != 0, axis=1)) + 1
    return np.diff(np.r_[0, change, len(factors)]).tolist()


def test_slowdown_draws_are_per_seed_and_task_and_follow_the_fraction():
    episodes = [TallyTask.sample(seed) for seed in range(200)]
    drawn = [draw_slowdown(ep, seed, 0.5) for seed, ep in enumerate(episodes)]
    again = [draw_slowdown(ep, seed, 0.5) for seed, ep in enumerate(episodes)]
    assert all((a is None) == (b is None) for a, b in zip(drawn, again))
    assert all(np.array_equal(a.factors, b.factors) for a, b in zip(drawn, again) if a is not None)
    assert 70 <= sum(d is not None for d in drawn) <= 130  # Binomial(200, 0.5): fixed seeds, no flakiness
    assert all(draw_slowdown(ep, seed, 0.0) is None for seed, ep in enumerate(episodes))
    for ep, d in zip(episodes, drawn):
        if d is None:
            continue
        assert d.start == ep.go_step and d.record() == [ep.go_step]
        assert d.factors.shape == (ep.step_limit() - ep.go_step + 1, 3)
        assert SPEED_RANGE[0] <= d.factors.min() and d.factors.max() <= SPEED_RANGE[1]
        spells = _spells(d.factors)
        assert all(SPELL_STEPS[0] <= n <= SPELL_STEPS[1] for n in spells[:-1]) and spells[-1] <= SPELL_STEPS[1]
    order = MEMORY_TASKS["memory-order"]
    assert not np.array_equal(draw_slowdown(order.sample(3), 3, 1.0).factors[:20], draw_slowdown(TallyTask.sample(3), 3, 1.0).factors[:20])


def test_a_slowdown_scales_the_moves_after_go_only():
    d = draw_slowdown(TallyTask.sample(0), 0, 1.0)
    action = np.array([0.5, -0.25, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=np.float32)
    np.testing.assert_array_equal(d.executed(d.start - 1, action), action)
    for t in (d.start, d.start + 7, d.start + 10_000):
        out = d.executed(t, action)
        np.testing.assert_allclose(out[:3], action[:3] * d.factors[min(t - d.start, len(d.factors) - 1)], rtol=1e-6)
        np.testing.assert_array_equal(out[3:], action[3:])
    assert action[0] == 0.5  # the stored action is not changed in place


@needs_metaworld
@pytest.mark.sim
@pytest.mark.parametrize("task", ["memory-reference", "memory-order", "memory-tally"])
def test_a_slowdown_executes_scaled_moves_while_the_labels_stay_the_experts(task, monkeypatch):
    actions = MetaWorldActions()
    with MetaWorldEnv(MetaWorldConfig(cameras=())) as env:
        executed = []
        step = env.step
        monkeypatch.setattr(env, "step", lambda a: (executed.append(np.array(a)), step(a))[1])
        for seed in range(2):
            executed.clear()
            slowdown = draw_slowdown(MEMORY_TASKS[task].sample(seed), seed, 1.0)
            rollout = run_expert_episode(env, task, seed, slowdowns=1.0)
            target = env.memory_episode.target()
            assert rollout.success and rollout.slowdown == [slowdown.start]
            hand, stored, go = rollout.episode.state[:, :3], rollout.episode.action, slowdown.start
            for t in range(go, len(stored)):  # every stored action is the true expert's at its state
                np.testing.assert_allclose(stored[t], actions.from_native(move_toward(hand[t], target, OPEN)), atol=1e-6)
                np.testing.assert_allclose(executed[t][:3], stored[t, :3] * slowdown.factors[t - go], rtol=1e-5, atol=1e-7)
            np.testing.assert_array_equal(np.stack(executed[:go]), stored[:go])  # the cue and the delay: unchanged
            clean = run_expert_episode(env, task, seed)
            assert clean.slowdown == [] and np.array_equal(clean.episode.state[: go + 1], rollout.episode.state[: go + 1])
            moved = np.linalg.norm(np.diff(hand[go : go + 8], axis=0), axis=1).sum()
            moved_clean = np.linalg.norm(np.diff(clean.episode.state[go : go + 8, :3], axis=0), axis=1).sum()
            assert moved < moved_clean  # the frames show the hand slower than the labels ask


def test_slowdowns_need_a_task_with_a_go_step(tmp_path):
    with pytest.raises(ValueError, match="slowdowns need.*go step.*reach-v3"):
        CollectConfig(tasks=["reach-v3"], episodes=1, out=tmp_path / "a", slowdowns=0.5)
    with pytest.raises(ValueError, match=r"`slowdowns` is a fraction of episodes in \[0, 1\], got -0.1"):
        CollectConfig(tasks=["memory-tally"], episodes=1, out=tmp_path / "b", slowdowns=-0.1)
    with pytest.raises(ValueError, match="slowdowns need.*memory-counting has none"):
        draw_slowdown(CountingTask.sample(0), 0, 0.5)
    with pytest.raises(ValueError, match=r"slowdowns fraction must be in \[0, 1\], got 2"):
        draw_slowdown(TallyTask.sample(0), 0, 2)
