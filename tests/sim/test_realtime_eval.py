"""Evaluation on the control loop in simulated time (``RealtimeEpisode``): a fake simulator that counts
ticks, a fake session whose actions name the tick they are for, and a fake timer giving each step the
duration the test chooses. Then the CLI end to end on a tiny OpenVLA in Meta-World."""

import importlib.util
import json

import numpy as np
import pytest

from vla_runtime.api import EpisodeSession, StepResult
from vla_runtime.config import SessionConfig
from vla_runtime.control import ControlConfig
from vla_runtime.kv.base import KVStats
from vla_runtime.sim.base import SimObservation, StepInfo
from vla_runtime.sim.realtime import RealtimeEpisode, hold_action

RATE = 10.0
PERIOD = 1 / RATE


class TickWorld:
    """Observation ``t`` = the tick whose world it shows: the reset's is tick 0's, the one rendered after tick
    k's action tick k + 1's; ends after ``ticks``."""

    fps = 10

    def __init__(self, ticks: int) -> None:
        self.ticks, self.k, self.applied = ticks, 0, []

    def reset(self):
        return SimObservation(images={"primary": np.zeros((4, 4, 3), np.uint8)}, state=np.zeros(2), instruction="go", t=0.0)

    def step(self, action):
        self.applied.append(np.array(action))
        self.k += 1
        obs = SimObservation(images={"primary": np.zeros((4, 4, 3), np.uint8)}, state=np.zeros(2), instruction="go", t=self.k)
        done = self.k >= self.ticks
        return obs, done, False, StepInfo(self.k, done, np.array(action))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TickSession(EpisodeSession):
    """Each step's chunk row ``i`` says (in dimension 0) the tick it is for: the frame's tick + ``i`` (a policy
    acts on the world it saw: row 0 for the state in its frame); the step takes ``step_s`` on the fake clock."""

    def __init__(self, clock: FakeClock, chunk: int, step_s: float) -> None:
        super().__init__("go", SessionConfig())
        self.clock, self.chunk, self.step_s, self.frames = clock, chunk, step_s, []

    def reset(self, instruction=None) -> None:
        pass

    def step(self, obs) -> StepResult:
        self.clock.now += self.step_s
        frame = int(obs.t)
        self.frames.append(frame)
        actions = np.zeros((self.chunk, 7))
        actions[:, 0] = frame + np.arange(self.chunk)
        actions[:, 6] = 0.5  # a gripper command no hold sends
        return StepResult(actions=actions, timings={}, kv=KVStats(tokens_raw=1, bytes=1, tokens_seen=1))


def play(chunk: int, step_periods: float, ticks: int = 60, **control):
    clock, world = FakeClock(), TickWorld(ticks)
    session = TickSession(clock, chunk, step_periods * PERIOD)
    episode = RealtimeEpisode(world, session, ControlConfig(rate_hz=RATE, align_to_frames=False, **control),
                              chunked=chunk > 1, action_dim=7, timer=clock)  # fmt: skip
    success, info, stats, error = episode.run(world.reset())
    assert error is None and info.step == ticks and stats["ticks"] == ticks
    return world.applied, stats, session.frames


def test_a_chunk_policy_whose_step_takes_three_periods_acts_on_every_tick_after_the_first_chunk():
    applied, stats, _ = play(chunk=8, step_periods=3.0)
    executed = [a[0] for a in applied]
    first = next(k for k, a in enumerate(applied) if a[6] == 0.5)  # the first tick served by a chunk
    assert first <= 4  # the first step starts at once and takes 3 periods
    # latency-aware: tick k executes the row meant for tick k (rows for ticks past when a chunk lands are skipped)
    assert executed[first:] == list(range(first, len(applied)))
    assert stats["fallbacks"] == first and stats["actions_skipped"] > 0
    # before it: hold (no motion; no gripper command seen yet: open)
    assert all(not a[:6].any() and a[6] == 1.0 for a in applied[:first])


@pytest.mark.parametrize("chunk", [8, 1])
def test_without_a_margin_a_step_planned_to_start_on_a_tick_starts_there(chunk):
    """No step time measured yet and ``margin_ms`` 0: the first plan starts exactly on a tick (once, a step that
    started there was never run)."""
    applied, stats, frames = play(chunk=chunk, step_periods=0.3, margin_ms=0.0)
    assert stats["steps"] >= len(applied) // max(chunk - 2, 1) - 2 and frames[0] == 0


def test_a_single_action_policy_acts_on_the_newest_frame_with_no_empty_ticks():
    applied, stats, frames = play(chunk=1, step_periods=0.3)
    # tick 0 comes before any step; the first step is planned before any step time is known, so it lands after
    # tick 1, which waits for it (the default late_grace_ms: up to 0.45 of a period); no tick after tick 0 goes
    # without an action
    assert stats["fallbacks"] == 1 and stats["steps_late"] == 1 and stats["ticks_late"] == 1
    assert stats["steps"] == stats["ticks"] - 1
    # each action was computed from the frame of the tick before the one it serves: a step starts late in the
    # period (deadline scheduling), on the newest frame
    executed = [int(a[0]) for a in applied]
    assert executed[3:] == [k - 1 for k in range(3, len(applied))]
    assert frames[-1] == len(applied) - 2


class SlowOnceSession(TickSession):
    """``TickSession`` with one action per step taking 20 ms, except step ``slow_at``, which takes ``slow_s``; the
    action's dimension 0 is its frame's tick + 100 (never 0, so a hold is told apart)."""

    def __init__(self, clock: FakeClock, slow_at: int, slow_s: float) -> None:
        super().__init__(clock, 1, 0.02)
        self.slow_at, self.slow_s = slow_at, slow_s

    def step(self, obs) -> StepResult:
        self.step_s = self.slow_s if len(self.frames) == self.slow_at else 0.02
        result = super().step(obs)
        result.actions[:, 0] += 100
        return result


def test_a_step_that_overruns_its_tick_by_less_than_the_grace_is_executed_late_not_replaced_by_the_hold():
    runs = {}
    for grace_ms in (0.0, 20.0):
        clock, world = FakeClock(), TickWorld(40)
        session = SlowOnceSession(clock, slow_at=20, slow_s=0.035)  # planned 23 ms (20 + the margin): lands 12 ms late
        cfg = ControlConfig(rate_hz=RATE, align_to_frames=False, late_grace_ms=grace_ms)
        episode = RealtimeEpisode(world, session, cfg, chunked=False, action_dim=7, timer=clock)
        _, _, stats, error = episode.run(world.reset())
        assert error is None
        held = [not a[:6].any() for a in world.applied]  # the hold: no motion
        assert stats["fallbacks"] == sum(held)
        runs[grace_ms] = (world.applied, held, stats, session.frames[20] + 1)  # the tick the slow step serves
    applied, held, stats, slow_tick = runs[0.0]
    assert held[slow_tick] and stats["ticks_late"] == 0  # no grace: the tick holds
    applied, held, graced, slow_tick = runs[20.0]
    assert not held[slow_tick] and int(applied[slow_tick][0]) == 100 + slow_tick - 1  # its own action, 12 ms late
    # every tick the grace saved was a hold without it (the slow one, and the first step: planned before any step time)
    assert graced["ticks_late"] >= 1 and graced["fallbacks"] == stats["fallbacks"] - graced["ticks_late"]


def test_runs_repeat_exactly_and_time_scale_stretches_step_times():
    first_applied, fast, _ = play(chunk=8, step_periods=0.5)
    again_applied, again, _ = play(chunk=8, step_periods=0.5)
    assert fast == again and np.array_equal(first_applied, again_applied)  # the same step times, the same episode
    clock, world = FakeClock(), TickWorld(30)
    episode = RealtimeEpisode(world, TickSession(clock, 8, 0.5 * PERIOD), ControlConfig(rate_hz=RATE, align_to_frames=False),
                              chunked=True, action_dim=7, timer=clock, time_scale=6.0)  # fmt: skip
    _, _, stats, _ = episode.run(world.reset())
    assert stats["fallbacks"] > fast["fallbacks"]  # 3 periods per step: the first chunk lands later
    with pytest.raises(ValueError, match="`time_scale` must be > 0, got 0"):
        RealtimeEpisode(world, None, ControlConfig(), chunked=True, action_dim=7, time_scale=0)


def test_hold_keeps_the_gripper_and_stops_the_arm():
    assert hold_action(None, 4).tolist() == [0, 0, 0, 1.0]  # before any command: open (0 would close it)
    assert hold_action(np.array([0.3, -0.2, 0.1, -1.0]), 4).tolist() == [0, 0, 0, -1.0]


@pytest.mark.sim
@pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed")
def test_eval_cli_on_the_control_loop(tmp_path, capsys):
    from vla_runtime.cli import main

    ckpt = tmp_path / "ckpt"
    assert main(["make-tiny", str(ckpt), "--family", "openvla", "--dtype", "float32"]) == 0
    out = tmp_path / "eval"
    argv = ["eval", "--checkpoint", str(ckpt), "--sim", "metaworld", "--tasks", "reach-v3", "--episodes", "1",
            "--max-steps", "12", "--resolution", "56", "--no-video", "--out", str(out), "--control-rate", "20",
            "--time-scale", "0.001"]  # steps land within a tick however slow this machine is  # fmt: skip
    assert main(argv) == 0
    control = json.loads((out / "report.json").read_text())["summary"]["overall"]["control"]
    # tick 0 comes before any step; from then on each tick's step lands before the next one
    assert control["ticks"] == 12 and control["steps"] >= 10 and 1 <= control["fallbacks"] <= 2
    assert "control loop at 20 Hz: 12 ticks" in capsys.readouterr().out
