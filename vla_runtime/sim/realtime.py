"""Closed-loop evaluation on the robot's control loop, in simulated time (``vla-runtime eval --control-rate``).

The plain evaluation steps the policy, then the simulator, in turn: however slow the policy, the world
waits for it. A robot does not wait. Here the simulator advances one control tick per period whatever the
policy does, and ``ControlLoop`` (the loop the ROS node and ``RemotePolicyLoop`` run) decides, as on the
robot, when each step starts (deadline scheduling), which observation it takes (the newest at its start)
and which action each tick executes (queued chunk rows with latency skipping and blending, a step that
overran the tick by less than ``late_grace_ms``, or the fallback). A step's duration is its measured wall
time, times ``time_scale`` (> 1 plays a slower machine): its actions land that much simulated time after its
start, and the ticks in between run on what was queued.

One thread and a discrete-event clock: the same measured step times give the same episode. Between ticks
the clock jumps from event to event (a step landing, a step starting); every step starts on the frame of the
last tick at or before its start (the simulator renders frames only at ticks). The observation
``env.step`` returns after tick k's action shows the world at tick k + 1, so it is that tick's frame: a step
starting between ticks k and k + 1 sees the world as it was at tick k, and row ``i`` of its chunk is the action
for tick k + i (rows for ticks already past when it lands are skipped).

``Fallback.HOLD`` (publish nothing) means, for a simulated arm driven by delta actions, no motion with the
gripper command unchanged: zeros, with the last executed action's final dimension (the gripper) kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ..config import SessionConfig
from ..control import ControlConfig, ControlLoop
from ..policies.base import Policy
from .actions import GRIPPER_OPEN
from .base import SimEnv

log = logging.getLogger(__name__)


@dataclass
class _Step:
    """A step computed at ``start`` (planned for ``planned_at``) whose ``actions`` land at ``lands``."""

    actions: np.ndarray  # [H, action_dim]
    frame_time: float
    planned_at: float
    start: float
    lands: float
    result: object  # the session's StepResult


def hold_action(last: np.ndarray | None, action_dim: int) -> np.ndarray:
    """No motion, the gripper (the last dimension) as last commanded, open before any command (the policy
    convention's 1; a 0 would close it): [action_dim]."""
    action = np.zeros(action_dim)
    action[-1] = last[-1] if last is not None else GRIPPER_OPEN
    return action


class RealtimeEpisode:
    """One episode of ``env`` driven by ``session`` through ``ControlLoop`` on a simulated clock.

    ``chunked``: the loop places chunks (``control_chunked``); ``horizon``: rows kept of each predicted chunk
    (``None``: all). ``on_step(result, step_ms, tick)`` is called for every policy step with the tick whose
    frame it saw (timings, KV, retention traces), ``on_frame(obs)`` for every observation after a tick;
    ``timer`` measures step times.
    """

    def __init__(self, env: SimEnv, session, cfg: ControlConfig, *, chunked: bool, action_dim: int,
                 horizon: int | None = None, time_scale: float = 1.0, on_step=None, on_frame=None,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        if not time_scale > 0:
            raise ValueError(f"`time_scale` must be > 0, got {time_scale}")
        self.env, self.session, self.cfg = env, session, cfg
        self.action_dim, self.horizon, self.time_scale = action_dim, horizon, time_scale
        self.loop = ControlLoop(cfg, t0=0.0, chunked=chunked)
        self.on_step = on_step or (lambda result, ms, tick: None)
        self.on_frame = on_frame or (lambda obs: None)
        self.timer = timer  # measures step times (tests pass a fake one)
        self.env_s = 0.0

    def run(self, obs, *, label: str = "episode", max_ticks: int = 100_000):
        """Play the episode from the reset observation ``obs``. Returns ``(success, info, stats, error)``:
        the simulator's last ``StepInfo``, the loop's counters (``ControlStats`` as a dict) and the error of
        an action the simulator refused (the episode then ends as a failure)."""
        period = self.cfg.period
        now, pending = 0.0, None
        frame, frame_time, upcoming = None, None, obs  # the last tick's frame; this tick's (the reset: tick 0's)
        done, success, info, applied = False, False, None, None
        for k in range(max_ticks):
            tick = k * period
            while True:  # events up to this tick: a step landing, the next step starting
                if pending is not None and pending.lands <= tick:
                    now = pending.lands
                    self.loop.on_result(pending.actions, frame_time=pending.frame_time, now=now,
                                        step_s=now - pending.planned_at, started=pending.start)
                    pending = None
                if pending is None:
                    plan = self.loop.plan(now)
                    if plan is not None and plan.start_at <= tick:
                        self.loop.started(plan)
                        start = max(plan.start_at, now)
                        seen, seen_at = (upcoming, tick) if start >= tick or frame is None else (frame, frame_time)
                        pending = self._compute(seen, seen_at, plan.start_at, start)
                        continue
                break
            now = tick
            until = self.loop.grace_until(tick)  # the step for this tick overran it: wait a little for it
            if until is not None and pending is not None and pending.lands <= until:
                now = pending.lands
                self.loop.on_result(pending.actions, frame_time=pending.frame_time, now=now,
                                    step_s=now - pending.planned_at, started=pending.start)
                pending = None
            action = self.loop.on_tick(now, due=tick).action
            applied = action if action is not None else hold_action(applied, self.action_dim)
            t0 = time.perf_counter()
            try:
                obs, done, success, info = self.env.step(applied)
            except ValueError as e:  # an action the simulator cannot take (wrong shape, NaN)
                log.warning("%s: episode ended at tick %d: %s", label, k, e)
                return False, info, asdict(self.loop.stats), str(e)
            self.env_s += time.perf_counter() - t0
            frame, frame_time, upcoming = upcoming, tick, obs  # obs: the world at the next tick
            self.on_frame(obs)
            if done:
                break
        return success, info, asdict(self.loop.stats), None

    def _compute(self, obs, frame_time: float, planned_at: float, start: float) -> _Step:
        policy_obs = obs.to_policy()
        policy_obs.prefix = self.loop.guidance(frame_time, start)  # Blend.RTC: what is queued for this chunk
        t0 = self.timer()
        result = self.session.step(policy_obs)
        seconds = self.timer() - t0
        self.on_step(result, seconds * 1e3, round(frame_time / self.cfg.period))
        actions = np.atleast_2d(np.asarray(result.actions, dtype=np.float64))[: self.horizon]
        return _Step(actions, frame_time, planned_at, start, start + seconds * self.time_scale, result)


def control_chunked(policy: Policy, session_config: SessionConfig) -> bool:
    """Whether the loop places chunks: the policy predicts several actions and more than one is executed."""
    return policy.chunk_size > 1 and session_config.execution_horizon != 1
