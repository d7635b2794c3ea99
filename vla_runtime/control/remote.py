"""The control loop on a robot whose policy runs elsewhere: ``RemotePolicyLoop``.

The robot's own control loop calls ``tick(observation)`` once per control period; the policy is any
``infer(observation) -> {"actions": [H, action_dim], ...}`` callable, e.g. openpi's
``WebsocketClientPolicy("gpu-box", 8000).infer`` talking to ``vla-runtime serve``. Requests run on one
background thread at the times ``ControlLoop`` plans (deadline scheduling on the round trip, the next
chunk asked for before the queue runs dry, rows for ticks already past skipped, overlaps blended), each
on the newest observation of its start::

    chunked = client.get_server_metadata()["action_horizon"] > 1
    loop = RemotePolicyLoop(client.infer, ControlConfig(rate_hz=10, blend="temporal"), chunked=chunked)
    while robot.ok():
        robot.apply(loop.tick(robot.observation()))   # None: the fallback is "hold" (do nothing this tick)

The clock and the way a request waits for its start are injectable (tests drive both by hand).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

import numpy as np

from .config import Blend, ControlConfig, PublishMode
from .loop import ControlLoop, ControlStats

log = logging.getLogger(__name__)

Infer = Callable[[Any], dict]


class RemotePolicyLoop:
    """Ticks of a robot driven by a remote chunk policy (see the module docstring).

    ``chunked``: replies hold chunks, row ``i`` for the ``i``-th tick from the observation (rows for ticks gone
    by the reply's arrival are skipped); ``False`` for a policy of one action per request (OpenVLA: the server's
    metadata says ``action_horizon`` 1), whose action serves the tick its request was planned for.
    ``submit``: runs a request job in the background (default: one worker thread); ``wait_until(t, cancel)``
    blocks a job until clock time ``t`` (default: ``cancel.wait``), True when cancelled.
    """

    def __init__(self, infer: Infer, cfg: ControlConfig, *, chunked: bool = True, clock: Callable[[], float] = time.monotonic,
                 submit: Callable[[Callable[[], None]], Future] | None = None,
                 wait_until: Callable[[float, threading.Event], bool] | None = None) -> None:
        if cfg.publish_mode is not PublishMode.TICK:
            raise ValueError("RemotePolicyLoop publishes on ticks only: publish_mode must be 'tick'")
        if cfg.blend is Blend.RTC:
            raise ValueError("blend 'rtc' needs the policy in this process (the openpi protocol carries no queued actions); "
                             "use none, temporal or adaptive")
        self.infer, self.cfg, self.chunked, self.clock = infer, cfg, chunked, clock
        self._executor = None if submit is not None else ThreadPoolExecutor(max_workers=1, thread_name_prefix="vla_remote")
        self._submit = submit or self._executor.submit
        self._wait_until = wait_until or (lambda t, cancel: cancel.wait(max(0.0, t - self.clock())))
        self._lock = threading.Lock()  # the loop and the newest observation are shared with the request thread
        self._loop: ControlLoop | None = None  # made at the first tick: tick 0 is then
        self._newest: tuple[Any, float] | None = None  # (observation, when tick() received it)
        self._future: Future | None = None
        self._cancel = threading.Event()
        self._episode = 0
        self._error: BaseException | None = None

    @property
    def stats(self) -> ControlStats:
        """Ticks, fallbacks, requests, late requests, skipped and blended rows since the first tick."""
        return self._loop.stats if self._loop is not None else ControlStats()

    def tick(self, observation: Any, *, due: float | None = None) -> np.ndarray | None:
        """This tick's action [action_dim] (queued, else the fallback; ``None`` = do nothing). ``observation``
        becomes the newest one a request may take. An exception a request raised is raised here, once.

        ``due``: when the robot's loop scheduled this tick, on ``clock`` (e.g. its rate's deadline). Without it a
        tick is named by when it is called, so a call more than half a period late takes the next tick's row and
        the next call finds that tick served (nothing to publish); with it the late call gets its own row."""
        now = self.clock()
        if due is not None and not due <= now + self.cfg.period:
            raise ValueError(f"tick due at {due} is more than a period after now ({now}): expected the time the robot's "
                             "loop scheduled this tick, on the loop's clock")
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise RuntimeError(f"the policy request failed: {type(error).__name__}: {error}") from error
            self._newest = (observation, now)
            if self._loop is None:
                self._loop = ControlLoop(self.cfg, t0=now, chunked=self.chunked)
            out = self._loop.on_tick(now, due=due)
            self._plan_request(now)
        return out.action

    def reset(self) -> None:
        """A new episode: queued actions are dropped, and a request in flight is not used."""
        with self._lock:
            self._episode += 1
            self._cancel.set()
            if self._loop is not None:
                self._loop.reset()
            self._future = None

    def close(self) -> None:
        """Stop: a request waiting for its start gives up; one in flight finishes unused."""
        self.reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> "RemotePolicyLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def _plan_request(self, now: float) -> None:
        """Start the request the loop plans once its start is less than a period away (caller holds the lock)."""
        if self._future is not None and not self._future.done():
            return
        plan = self._loop.plan(now)
        if plan is None or plan.start_at > now + self.cfg.period:
            return  # a later tick plans again
        self._loop.started(plan)
        self._cancel = threading.Event()
        self._future = self._submit(partial(self._request, plan.start_at, self._cancel, self._episode))

    def _request(self, start_at: float, cancel: threading.Event, episode: int) -> None:
        """Request thread: wait for the planned start, ask the policy about the newest observation, queue the chunk."""
        if self._wait_until(start_at, cancel):
            return
        with self._lock:
            observation, received = self._newest
        started = self.clock()
        try:
            actions = np.atleast_2d(np.asarray(self.infer(observation)["actions"], dtype=np.float64))  # [H, action_dim]
        except Exception as e:  # noqa: BLE001 - handed to the robot's next tick, never lost
            with self._lock:
                if episode == self._episode:  # a request of an episode since reset is not the new episode's error
                    self._error = e
                else:
                    log.warning("a request of episode %d failed after its reset: %s", episode, e)
            return
        done = self.clock()
        with self._lock:
            if episode == self._episode and self._loop is not None:
                self._loop.on_result(actions, frame_time=received, step_s=done - start_at, now=done, started=started)
