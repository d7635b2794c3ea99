"""The control half of ``PolicyNode``: episodes, control ticks, worker steps, publishing.

``PolicyControl`` is a mixin of ``PolicyNode`` (``policy_node.py`` holds the lifecycle, the
subscriptions and /diagnostics); it reads the node's state under the node's lock. The control thread
(``DeadlineTicker``) runs the ticks and the wakes between them, so they never overlap each other, and
activate starts it and deactivate joins it, so they never overlap a lifecycle transition;
``_start_episode`` and ``_step`` run on the one-thread worker.

A tick publishes its action (queued; the step planned for it, if it overran the tick by less than
``late_grace_ms``: the tick waits for it; else the fallback) and asks the ``ControlLoop`` when the next step
should start; a worker job waits until then, takes the newest usable frame of that moment and steps
the session. An episode request (instruction, reset service, activation) is applied by the worker
once no step is in flight; the old episode's queued actions are dropped.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait

import numpy as np
from std_srvs.srv import Trigger
from vla_runtime.api import ActionPrefix
from vla_runtime.kv.base import KVStats

from .episodes import BadInputError, EpisodeRequest, StepOutcome
from .inputs import Frame
from .telemetry import control_values

RESET_TIMEOUT_S = 30.0


class PolicyControl:
    """Episodes and control ticks of ``PolicyNode`` (see the module docstring)."""

    # ------------------------------------------------------------------ episodes
    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._lock:
            text = self._inputs.current_instruction() if self._cfg is not None else ""
            if not self._active:
                response.success, response.message = False, "node is not active; activation starts a new episode"
                return response
            if not text:
                response.success, response.message = False, "no instruction yet; publish one on `instruction`"
                return response
            request_ = self._request_episode(text)
        if not request_.applied.wait(RESET_TIMEOUT_S):
            response.success, response.message = False, f"reset not applied within {RESET_TIMEOUT_S} s"
        elif request_.error:
            response.success, response.message = False, request_.error
        else:
            response.success, response.message = True, f"episode {request_.episode} started: {text!r}"
        return response

    def _request_episode(self, instruction: str) -> EpisodeRequest:
        """Ask the control tick for a new episode (caller holds ``_lock``); supersedes a pending request."""
        if self._episode_request is not None:
            self._episode_request.error = "superseded by a newer request"
            self._episode_request.applied.set()
        self._episode_instruction = instruction
        self._episode_request = EpisodeRequest(instruction)
        return self._episode_request

    def _start_episode(self, request: EpisodeRequest) -> EpisodeRequest:
        """Worker: a new session, or the current one reset to ``request.instruction``."""
        self._runner.start_episode(request)
        if not request.error:
            self.get_logger().info(f"episode {request.episode}: {request.instruction!r}")
        with self._lock:
            request.frames_before = self._inputs.frame_seq
        request.applied.set()
        return request

    # ------------------------------------------------------------------ ticks
    def _on_control_tick(self, due: float) -> None:
        """The tick due at ``due`` (monotonic s): publish its action (queued, or the fallback) and plan the next
        step (``ControlLoop``)."""
        try:
            self._control_tick(due)
        finally:
            self._sync_view()

    def _control_tick(self, due: float) -> None:
        now = time.monotonic()
        self._collect()
        with self._lock:
            request = self._episode_request if self._future is None else None  # applied once the worker is idle
            if request is not None:
                self._episode_request = None
                self._episode += 1
                request.episode = self._episode
            hold = self._watchdog(now)
        # every tick that publishes nothing below still passes in the loop: a step landing later serves the next
        if request is not None:  # whatever the old episode still had is dropped
            self._ready = False
            self._loop.reset()
            self._loop.skip_tick(now, due=due)
            self._future = self._worker.submit(self._start_episode, request)
            self._future.add_done_callback(lambda _: self._wake())
            return
        if self._episode_request is not None:  # a new episode waits for the step in flight: the old one's actions stop
            self._cancel.set()
            self._loop.reset()
            self._loop.skip_tick(now, due=due)
            return
        if not self._ready:
            self._loop.skip_tick(now, due=due)
            return
        if hold:
            pending = self._loop.queued()
            self._loop.reset()
            self._loop.skip_tick(now, due=due)
            if pending:
                with self._lock:
                    self._telemetry.actions_withheld += pending
            self.get_logger().warning(f"no action: {hold}", throttle_duration_sec=2.0)
            return
        until = self._loop.grace_until(now, due=due)
        if until is not None and self._future is not None:  # the step for this tick overran it: wait a little
            wait([self._future], timeout=max(0.0, until - time.monotonic()))
            now = time.monotonic()
            self._collect()
        out = self._loop.on_tick(now, due=due)
        if out.action is not None:
            self._publish(out.action, received=self._latency_of(out.tick))
        self._loop.phase_shift()  # first: the next step is planned, and the next tick waited for, on the moved grid
        self._submit_step()

    def _sync_view(self, *, collected: bool = False) -> None:
        """Copy the loop's state for diagnostics, which run on another thread (the loop is not thread-safe and
        changes in this callback group only); ``collected``: a worker job's outcome was just handled."""
        view = {"queue_len": self._loop.queued(), **control_values(self._loop, self._cfg)} if self._loop is not None else {}
        with self._lock:
            self._loop_view = view
            if collected:
                self._busy = False

    def _on_frame_ready(self) -> None:
        """A frame or a joint state arrived, or a worker job ended: collect it and start a step if one is due."""
        if self._loop is not None:
            self._collect()
            self._submit_step()
            self._sync_view()

    def _latency_of(self, tick: int) -> float | None:
        """The frame receipt time of the newest step whose first action serves ``tick`` (once per step)."""
        if self._latency_mark is None or tick < self._latency_mark[0]:
            return None
        received, self._latency_mark = self._latency_mark[1], None
        return received

    # ------------------------------------------------------------------ steps
    def _usable_frame(self, now: float) -> Frame | None:
        """The newest frame a step may take now, if any (caller holds ``_lock``): no episode change waits,
        inputs fresh, not used yet, its joint state arrived."""
        if self._episode_request is not None or self._watchdog(now):
            return None
        return self._inputs.usable_frame(now)

    def _submit_step(self) -> None:
        """Hand the worker the next step ``ControlLoop.plan`` asks for, once it starts before the next tick.

        The job waits for its start time and takes the newest frame then. A step due now needs a frame now;
        otherwise a frame's arrival calls this again. A step that starts after the next tick is planned at that
        tick, on the grid and step times of that moment (a phase move there must not find it waiting).
        """
        if self._future is not None or not self._ready or self._loop is None:
            return
        now = time.monotonic()
        with self._lock:
            frames = self._inputs.clock.phase()  # a chunk refill starts on a frame's arrival
        plan = self._loop.plan(now, frames=frames)
        if plan is None or plan.start_at > max(now, self._loop.grid.time(self._loop.served + 1)):
            return
        with self._lock:
            if self._episode_request is not None or (plan.start_at <= now and self._usable_frame(now) is None):
                return  # a new episode starts first; a step due now needs a frame now
            episode = self._episode
        self._cancel = threading.Event()
        # Blend.RTC: the actions queued for the step's chunk, read here (the loop's own callback group); the
        # frame it will take arrives about at its start
        prefix = self._loop.guidance(plan.start_at, max(now, plan.start_at))
        self._loop.started(plan)
        self._future = self._worker.submit(self._step, plan.start_at, self._cancel, episode, prefix,
                                           self._loop.cfg.frame_wait_ms / 1e3, self._loop.grid.time(plan.tick))  # fmt: skip
        self._future.add_done_callback(lambda _: self._wake())

    def _step(self, start_at: float, cancel: threading.Event, episode: int, prefix: ActionPrefix | None = None,
              frame_wait_s: float = 0.0, tick_due: float = float("inf")) -> StepOutcome | None:  # fmt: skip
        """Worker: wait until ``start_at`` (and for a frame due within ``frame_wait_s``), take the newest usable
        frame and step the session on it.

        ``None`` when cancelled, or when no frame is usable at the start (the next tick or frame plans again). With
        ``frame_wait_s`` a frame later than that is waited for (``steps_without_frame``) up to a camera period and
        until ``tick_due``, the step's tick: a frame that comes after its tick is left to the next step.
        """
        if cancel.wait(max(0.0, start_at - time.monotonic())):
            return None
        planned = start_at
        with self._lock:
            waited = self._await_next_frame(cancel, frame_wait_s)
            now = time.monotonic()
            frame = self._usable_frame(now)
            if frame is None and frame_wait_s > 0 and self._camera_late(episode, cancel, now):
                # the frame is later than the wait: wait for it until the tick. Its negative age then moves the
                # ticks later (a step that gave up would start again on its arrival and look aligned)
                self._telemetry.steps_without_frame += 1
                waited = self._await_frame(cancel, min(self._inputs.clock.period() or 0.0, tick_due - now))
                frame = self._usable_frame(time.monotonic())
            if frame is None or episode != self._episode or cancel.is_set():  # deactivated during a frame wait
                return None
            if waited:  # the plan's turnaround counts from the frame's arrival, not the wait for it
                start_at = max(start_at, frame.received)
            self._inputs.skip_frames_until(frame.seq)
            found, state = self._inputs.state_at(frame)
            if not found:
                self._telemetry.frames_unpaired += 1
                return None
            self._busy = True
        outcome = self._runner.step(frame, state, episode=episode, start_at=start_at, prefix=prefix)
        outcome.frame_wait_s = max(0.0, frame.received - planned) if waited else 0.0
        return outcome

    def _await_next_frame(self, cancel: threading.Event, frame_wait_s: float) -> bool:
        """Worker, holding ``_lock``: when the camera's next frame is due within ``frame_wait_s``, wait for it (at
        most that long). Whether a frame arrived in the wait."""
        return self._await_frame(cancel, self._inputs.clock.wait_for_next(time.monotonic(), frame_wait_s))

    def _camera_late(self, episode: int, cancel: threading.Event, now: float) -> bool:
        """Worker, holding ``_lock``: no usable frame at a step's start only because none came since the last step
        (not an episode change, a cancel or stale inputs)."""
        return episode == self._episode and not cancel.is_set() and self._episode_request is None \
            and not self._watchdog(now)

    def _await_frame(self, cancel: threading.Event, limit: float) -> bool:
        """Worker, holding ``_lock``: wait up to ``limit`` s for a new frame (the lock is released meanwhile).
        Whether one arrived."""
        if limit <= 0:
            return False
        seq = self._inputs.frame_seq
        return self._frame_arrived.wait_for(lambda: self._inputs.frame_seq > seq or cancel.is_set(), timeout=limit) \
            and not cancel.is_set()

    def _collect(self) -> None:
        """Account for a finished worker job: a started episode, or a step's actions (into the loop)."""
        if self._future is None or not self._future.done():
            return
        future, self._future = self._future, None
        try:
            self._take_outcome(future)
        finally:
            self._sync_view(collected=True)  # `stepping` ends with its actions queued, in one step for diagnostics

    def _take_outcome(self, future: Future) -> None:
        try:
            outcome = future.result()
        except BadInputError as e:
            self._report_error(f"image rejected: {e}", kind="input")
            return
        except Exception as e:  # noqa: BLE001 - a failing policy must not take the node down; it is reported
            self._report_error(f"inference failed: {type(e).__name__}: {e}", kind="inference")
            return
        if isinstance(outcome, EpisodeRequest):
            if outcome.error:
                self._report_error(outcome.error, kind="inference")
                with self._lock:  # no session now: said on /diagnostics until one starts; the same text retries
                    self._episode_failure = f"no episode: {outcome.error}"
                    if self._episode_request is None and self._episode_instruction == outcome.instruction:
                        self._episode_instruction = None
                return
            self._ready = True
            with self._lock:
                self._episode_failure = ""
                self._inputs.skip_frames_until(outcome.frames_before)  # a frame of the old episode is not acted on
                self._telemetry.episode = outcome.episode
                self._telemetry.kv = KVStats()
            return
        if outcome is None or outcome.episode != self._episode or self._loop is None:
            return
        if not np.all(np.isfinite(outcome.actions)):
            self._report_error(f"policy produced non-finite actions {outcome.actions[0].tolist()}", kind="inference")
            self._loop.reset()
            return
        with self._lock:
            self._telemetry.steps += 1
            self._telemetry.step_ms.add(outcome.step_ms)
            self._telemetry.frame_age_ms.add((outcome.started - outcome.frame.received) * 1e3)
            self._telemetry.kv = outcome.result.kv
            hold = bool(self._episode_request is not None or self._watchdog(time.monotonic()))
        if not self._cfg.dry_run:
            self._outputs.publish_chunk(outcome.result.actions)
        action = self._loop.on_result(outcome.actions, frame_time=outcome.frame.received, step_s=outcome.turnaround_s,
                                      now=time.monotonic(), started=outcome.started - outcome.frame_wait_s)
        self._latency_mark = (self._loop.placed_from, outcome.frame.received) if self._loop.placed_from is not None else None
        if action is not None and not hold:  # PublishMode.IMMEDIATE
            self._latency_mark = None
            self._publish(action, received=outcome.frame.received)

    def _publish(self, action: np.ndarray, *, received: float | None) -> None:
        """One action [action_dim] out (clipped; counted, and suppressed under ``dry_run``)."""
        action, clipped = self._outputs.clip(action)
        now = time.monotonic()
        with self._lock:
            self._telemetry.values_clipped += clipped
            if received is not None:
                self._telemetry.latency_ms.add((now - received) * 1e3)
            if self._cfg.dry_run:
                self._telemetry.actions_suppressed += 1
                return
            self._telemetry.actions_published += 1
            self._telemetry.action_rate.tick(now)
        self._outputs.publish_action(action)
