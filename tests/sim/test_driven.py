"""Driven spells (``collect --driver CKPT --driven F``): a real (tiny) policy drives the arm for a few steps after go,
seeing every frame from the first, while the stored actions stay the expert's at the states it reached; the draws are
per seed; the expert finishes the episode; the dataset records the spells; clear errors."""

import importlib.util

import numpy as np
import pytest
import torch

from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.cli import main
from vla_runtime.data import LeRobotDataset
from vla_runtime.sim import MetaWorldConfig, MetaWorldEnv
from vla_runtime.sim.actions import MetaWorldActions
from vla_runtime.sim.collect import CollectConfig, record_cue_steps, run_expert_episode
from vla_runtime.sim.driven import DRIVEN_STEPS, PolicyDriver, draw_spell
from vla_runtime.sim.memory import CountingTask, TallyTask
from vla_runtime.sim.memory.base import move_toward
from vla_runtime.sim.memory.reach import OPEN

needs_metaworld = pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed")
RESOLUTION = 28


def test_spell_draws_are_per_seed_and_task_and_follow_the_fraction():
    episodes = [TallyTask.sample(seed) for seed in range(200)]
    drawn = [draw_spell(ep, seed, 0.5) for seed, ep in enumerate(episodes)]
    assert [d and d.record() for d in drawn] == [d and d.record() for d in (draw_spell(ep, s, 0.5) for s, ep in enumerate(episodes))]
    assert 70 <= sum(d is not None for d in drawn) <= 130  # Binomial(200, 0.5): fixed seeds, no flakiness
    assert all(draw_spell(ep, seed, 0.0) is None for seed, ep in enumerate(episodes))
    for ep, d in zip(episodes, drawn):
        if d is not None:
            assert d.start == ep.go_step and DRIVEN_STEPS[0] <= d.steps <= DRIVEN_STEPS[1] and d.end == d.start + d.steps
            assert d.covers(d.start) and d.covers(d.end - 1) and not d.covers(d.end) and not d.covers(d.start - 1)
    with pytest.raises(ValueError, match="memory-counting has none"):
        draw_spell(CountingTask.sample(0), 0, 0.5)


class RecordingDriver(PolicyDriver):
    """The real driver, keeping what it was shown and what it chose (the test's window into the rollout)."""

    def start(self, instruction):
        super().start(instruction)
        self.seen, self.chosen = [], []

    def act(self, observation):
        action = super().act(observation)
        self.seen.append(observation.t)
        self.chosen.append(action)
        return action


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    torch.manual_seed(0)
    return make_tiny_openvla(tmp_path_factory.mktemp("driver") / "tiny", image_size=RESOLUTION, dtype=torch.float32)


@needs_metaworld
@pytest.mark.sim
def test_the_policy_drives_its_spell_and_the_labels_stay_the_experts(tiny_policy):
    actions = MetaWorldActions()
    driver = RecordingDriver(tiny_policy)
    seed = next(s for s in range(20) if draw_spell(TallyTask.sample(s), s, 1.0).steps >= 8)
    spell = draw_spell(TallyTask.sample(seed), seed, 1.0)
    with MetaWorldEnv(MetaWorldConfig(cameras=("corner",), resolution=(RESOLUTION, RESOLUTION))) as env:
        rollout = run_expert_episode(env, "memory-tally", seed, driven=1.0, driver=driver)
        target = env.memory_episode.target()
        stored, hand = rollout.episode.action, rollout.episode.state[:, :3]
        assert rollout.success and rollout.driven == spell.record()  # the expert took over and finished
        # every frame from the first, until the spell ends (an observation's t is its time in seconds)
        np.testing.assert_allclose(driver.seen, np.arange(spell.end) / env.fps, atol=1e-9)
        for t in range(spell.start, len(stored)):  # every stored action is the expert's at the state reached
            np.testing.assert_allclose(stored[t], actions.from_native(move_toward(hand[t], target, OPEN)), atol=1e-6)
        # the executed actions were the policy's in the spell and the stored ones elsewhere: replaying exactly that
        # sequence reproduces the stored states, and it is not what the expert alone does
        executed = [driver.chosen[t] if spell.covers(t) else stored[t] for t in range(len(stored))]
        obs, states = env.reset("memory-tally", seed), []
        for a in executed:
            states.append(obs.state)
            obs, *_ = env.step(a)
        np.testing.assert_allclose(np.stack(states), rollout.episode.state, atol=1e-6)
        assert any(np.abs(driver.chosen[t][:3] - stored[t, :3]).max() > 1e-3 for t in range(spell.start, spell.end))
        clean = run_expert_episode(env, "memory-tally", seed)
        assert clean.driven == [] and not np.allclose(clean.episode.state[spell.end], rollout.episode.state[spell.end])


@needs_metaworld
@pytest.mark.sim
def test_collect_records_the_spells_and_refuses_a_replay(tiny_policy, tmp_path, capsys):
    out = tmp_path / "ds"
    code = main(["collect", "--sim", "metaworld", "--tasks", "memory-tally", "--episodes", "3", "--seed", "0",
                 "--resolution", str(RESOLUTION), "--driver", str(tiny_policy), "--driven", "0.5", "--out", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr()
    ds = LeRobotDataset(out)
    seeds = ds.extra["per_episode"]["episode_seeds"]
    expected = [draw_spell(TallyTask.sample(s), s, 0.5) for s in seeds]
    assert ds.extra["per_episode"]["episode_driven"] == [[] if d is None else d.record() for d in expected]
    assert any(expected) and ds.extra["driven"] == 0.5 and ds.extra["driver"] == str(tiny_policy)
    assert "episode_detours" not in ds.extra["per_episode"]
    with pytest.raises(ValueError, match="policy driving .* cannot repeat"):
        record_cue_steps(out, MetaWorldConfig(resolution=(RESOLUTION, RESOLUTION)), progress=False)


def test_driven_spells_need_a_driver_a_fraction_and_a_go_step(tmp_path, tiny_policy):
    with pytest.raises(ValueError, match="both a `driver` checkpoint and a `driven` fraction"):
        CollectConfig(tasks=["memory-tally"], episodes=1, out=tmp_path / "a", driven=0.5)
    with pytest.raises(ValueError, match="both a `driver` checkpoint and a `driven` fraction"):
        CollectConfig(tasks=["memory-tally"], episodes=1, out=tmp_path / "b", driver=tiny_policy)
    with pytest.raises(ValueError, match="policy checkpoint directory"):
        CollectConfig(tasks=["memory-tally"], episodes=1, out=tmp_path / "c", driver=tmp_path, driven=0.5)
    with pytest.raises(ValueError, match="go step.*reach-v3"):
        CollectConfig(tasks=["reach-v3"], episodes=1, out=tmp_path / "d", driver=tiny_policy, driven=0.5)
    with pytest.raises(ValueError, match="cannot be combined"):
        CollectConfig(tasks=["memory-tally"], episodes=1, out=tmp_path / "e", driver=tiny_policy, driven=0.5, detours=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\], got 2.0"):
        CollectConfig(tasks=["memory-tally"], episodes=1, out=tmp_path / "f", driver=tiny_policy, driven=2.0)
    with pytest.raises(RuntimeError, match="before start"):
        PolicyDriver(tiny_policy).act(None)
