"""The control loop's decisions, free of threads, ROS and wall clocks.

A driver (the ROS policy node, a simulator, a server) owns the clock, the frames and one worker that
runs ``session.step``; it asks ``ControlLoop`` three things and does what it says:

    loop = ControlLoop(ControlConfig(rate_hz=10), t0=clock(), chunked=policy.chunk_size > 1)
    plan = loop.plan(now)            # when the next step should start, and which tick it serves
    ... at plan.start_at the worker steps on the newest frame ...
    now_action = loop.on_result(actions, frame_time=t_frame, step_s=dt, now=clock())
    until = loop.grace_until(clock())  # at every tick: a step running late for it? wait for it until then
    out = loop.on_tick(clock())      # the action to publish (queued or fallback)

Every time is seconds on the driver's monotonic clock; tests pass a fake one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np

from .broker import ChunkBroker, Missed
from ..api import ActionPrefix
from .config import Blend, ControlConfig, Fallback, PublishMode, Schedule
from .timing import FramePhase, StepTimer, TickGrid

# camera periods a chunk refill may start early, on a frame (a 30 Hz camera has 3 phases against 50 or 100 Hz ticks)
REFILL_FRAMES_BACK = 3
FIRST_ALIGN_STEPS = 4  # steps whose frame ages decide the first phase move (``align_window``: later ones)


class Source(str, Enum):
    """Where a tick's output came from."""

    QUEUE = "queue"  # a step's action (fresh or queued) planned for this tick
    PUBLISHED = "published"  # nothing to do: an action went out immediately during this period
    FALLBACK = "fallback"  # no action for this tick: ``ControlConfig.fallback``


@dataclass
class Plan:
    """The next step: start it at ``start_at`` so that its first action serves tick ``tick``."""

    start_at: float
    tick: int


@dataclass
class TickOutput:
    """What tick ``tick`` publishes: ``action`` [action_dim] (``None``: nothing) and why."""

    tick: int
    action: np.ndarray | None
    source: Source


@dataclass
class ControlStats:
    """Counters since the loop was made (reported on ``/diagnostics`` by the node)."""

    ticks: int = 0
    fallbacks: int = 0  # ticks without an action of their own (whatever the fallback published)
    steps: int = 0
    steps_late: int = 0  # a step landed after the tick it was planned for
    ticks_overrun: int = 0  # ticks due from a late step's planned tick until it landed (the most it can leave empty)
    actions_skipped: int = 0  # chunk rows for ticks already past when the chunk landed
    actions_blended: int = 0  # chunk rows that overlapped a queued prediction
    immediate: int = 0  # actions published at once (``PublishMode.IMMEDIATE``)
    phase_shifts: int = 0  # tick phase moved earlier to meet the camera's frames (``align_to_frames``)
    ticks_late: int = 0  # ticks served late by a step that overran them, within ``late_grace_ms``
    ticks_missed: int = 0  # ticks whose timer callback never ran (the driver's timer skipped them): nothing went out


class ControlLoop:
    """Deadline scheduling, chunk placement with latency skipping and blending, and the fallback.

    Args:
        cfg: the loop's parameters.
        t0: when tick 0 is due, until ``on_tick`` calls tell: the first call is tick ``0`` (or the one after the
            last handled), and later ones move the phase to the earliest call seen (timer callbacks run late,
            never early).
        chunked: the policy predicts several actions per step (refill and latency skipping apply).
    """

    def __init__(self, cfg: ControlConfig, *, t0: float, chunked: bool) -> None:
        self.cfg = cfg
        self.chunked = chunked
        self.grid = TickGrid(t0, cfg.period)
        self.timer = StepTimer(cfg.step_quantile, cfg.step_window)
        self.broker = ChunkBroker(cfg.blend, temporal_coeff=cfg.temporal_coeff, adaptive_alpha=cfg.adaptive_alpha)
        self.stats = ControlStats()
        self.served = -1  # the last tick handled by on_tick (or published immediately)
        self.last_action: np.ndarray | None = None
        self._last_immediate = float("-inf")
        self._planned: tuple[int, float] | None = None  # (tick, when it is due) the step in flight was planned for
        self.placed_from: int | None = None  # the first tick the last step's actions serve
        self._calibrated = False  # the grid's phase comes from the first on_tick (then the earliest callback)
        self._ages: deque[float] = deque(maxlen=cfg.align_window)  # frame age when each recent step started
        self._graced: int | None = None  # the tick grace_until last let wait for a late step
        self._align_checked = False  # a phase move was decided (on FIRST_ALIGN_STEPS steps; later: align_window)

    def reset(self) -> None:
        """A new episode: forget queued actions and the last action (step-time statistics stay)."""
        self.broker.clear()
        self.last_action = None
        self._planned = None

    # ------------------------------------------------------------------ planning
    def lead(self) -> float:
        """Seconds planned for a step: the running quantile of step times plus the margin."""
        return self.timer.estimate() + self.cfg.margin_ms / 1e3

    def plan(self, now: float, *, frames: FramePhase | None = None) -> Plan | None:
        """When the next step should start (``>= now``); ``None``: no step is needed yet (``ASAP`` with a
        non-empty queue). The driver starts it at ``start_at`` on the newest frame of that moment.

        ``frames``: when the camera's frames arrive. With ``align_to_frames`` a time-indexed chunk refill then
        starts on a frame's arrival (``_refill_on_a_frame``)."""
        cfg, lead = self.cfg, self.lead()
        first_open = self.served + 1
        earliest = max(first_open, self.grid.at_or_after(now + lead))
        asap = cfg.schedule is Schedule.ASAP or (cfg.publish_mode is PublishMode.IMMEDIATE and not self.chunked)
        if asap:
            if self.broker.queued_from(first_open):
                return None
            return Plan(now, first_open)  # at once; its action goes out at the first tick after it lands
        covered = max(self.served, self.broker.last_tick() if len(self.broker) else self.served)
        if self._calibrated and earliest > covered + 1:
            # behind: by the planned step time the first tick without an action is out of reach. A step may
            # still make it (the plan is a high quantile); waiting for the deadline of a later tick would leave
            # that tick empty for certain. It starts at once, or for a single-action policy with an action
            # queued, when that one goes out (a whole period for the step, on a newer frame, and no queue)
            start = now if self.chunked else max(now, self.grid.time(covered))
            return Plan(start, covered + 1)
        threshold = cfg.refill_threshold if self.chunked else 0
        target = max(covered + 1 - threshold, earliest)
        start = self.grid.time(target) - lead
        if frames is not None and cfg.align_to_frames and self._time_indexed():
            start = self._refill_on_a_frame(start, lead, frames, now)
            target = min(target, max(first_open, self.grid.at_or_after(start + lead)))
        return Plan(max(now, start), target)

    def _refill_on_a_frame(self, start: float, lead: float, frames: FramePhase, now: float) -> float:
        """A chunk refill planned to start at ``start``: that start, or one on a frame's arrival at most
        ``REFILL_FRAMES_BACK`` camera periods earlier (never later: the queue's margin stays), whichever acts
        soonest on its frame.

        A refill's first action goes out at the first tick after it lands, so its frame->action latency is the
        frame's age at the start + the step + the wait for that tick. ``start`` lands on a tick; its frame is
        as old as the time since the last arrival. An arrival has a frame ~0 ms old and waits for the tick after
        its landing. Where ticks and frames are locked (the rate a divisor of the camera's) the two are equal,
        ``start`` stays, and the phase alignment (``phase_shift``) moves the ticks onto the frames instead; where
        they are not (100 Hz ticks, a 30 Hz camera) an arrival landing just before a tick is what brings the
        latency down. The driver's ``frame_wait_ms`` covers a frame that comes a little late. Arrivals already
        past (a ms of slack) are not candidates.
        """
        arrival = frames.at_or_before(start)
        best, best_cost = start, start - arrival  # ties: the planned start
        while arrival >= start - REFILL_FRAMES_BACK * frames.period and arrival >= now - 1e-3:
            landing = arrival + lead
            wait = self.grid.time(self.grid.at_or_after(landing)) - landing
            if wait < best_cost - 1e-4:
                best, best_cost = arrival, wait
            arrival -= frames.period
        return best

    def guidance(self, frame_time: float, now: float) -> ActionPrefix | None:
        """``Blend.RTC``, chunk policies: the actions queued for the chunk a step starting ``now`` on a frame of
        ``frame_time`` predicts (row ``i`` for the ``i``-th tick from the frame, as ``on_result`` places it),
        consecutive from the first tick not executed yet, and how many of them will have executed before it
        lands (planned step time). ``None`` when RTC is off or nothing is queued for that tick."""
        if self.cfg.blend is not Blend.RTC or not self.chunked or not self._time_indexed():
            return None
        k0 = self.grid.at_or_after(frame_time)
        first = max(k0, self.served + 1)  # ticks before it are executed already
        rows = []
        while (action := self.broker.peek(first + len(rows))) is not None:
            rows.append(action)
        if not rows:
            return None
        frozen = max(0, self.grid.at_or_after(now + self.lead()) - first)
        return ActionPrefix(np.stack(rows), min(frozen, len(rows)), start=first - k0)

    def started(self, plan: Plan) -> None:
        """The driver started the step of ``plan`` (to count steps that land late)."""
        self._planned = (plan.tick, self.grid.time(plan.tick))

    def grace_until(self, now: float, *, due: float | None = None) -> float | None:
        """Called at a tick before ``on_tick`` (same ``now``, ``due``): when nothing is queued for it but the step
        planned for it (or for an earlier tick) is still running, the time until which the driver waits for that
        step (handing it to ``on_result`` if it lands) before ``on_tick``; ``None``: handle the tick now.

        The wait is ``late_grace_ms`` past the tick's due time, under half a period; ``TICK`` mode only.
        """
        cfg = self.cfg
        grace = min(cfg.late_grace_ms / 1e3, 0.45 * cfg.period)  # a step landing then is nearest to tick k
        if grace <= 0 or self._planned is None or cfg.publish_mode is not PublishMode.TICK:
            return None
        k = self.grid.nearest(now if due is None else due) if self._calibrated else self.served + 1  # as on_tick names it
        if k <= self.served or self._planned[0] > k or self.broker.serves(k, self._missed()):
            return None
        self._graced = k
        until = self.grid.time(k) + grace
        return until if until > now else None

    # ------------------------------------------------------------------ results and ticks
    def on_result(self, actions: np.ndarray, *, frame_time: float, step_s: float, now: float,
                  started: float | None = None) -> np.ndarray | None:
        """A step finished: queue its actions [H, action_dim] (H = 1 for single-action policies).

        ``frame_time``: when the frame it saw arrived; ``step_s``: seconds from the planned start to the
        actions (the driver's wake-up and frame decoding included: what the schedule plans for); ``started``:
        when the step took its frame, or for a step that waited for its frame (``frame_wait_ms``) when it began
        waiting (for ``align_to_frames``: a frame that came after that has a negative age). Chunk row ``i`` serves the ``i``-th tick from the frame's arrival
        (``latency_skip``); rows for ticks already served are skipped, overlaps blended.
        Returns the action to publish at once in ``PublishMode.IMMEDIATE``, else ``None``.
        """
        cfg = self.cfg
        self.timer.add(step_s)
        self.stats.steps += 1
        if started is not None:
            self._ages.append(started - frame_time)
        # ticks not handled yet and not long past (a tick skipped while no episode ran is not reopened)
        first_open = max(self.served + 1, self.grid.nearest(now)) if self._calibrated else self.served + 1
        planned_tick = -1
        if self._planned is not None:
            planned_tick, due = self._planned
            if due < now:
                self.stats.steps_late += 1
                self.stats.ticks_overrun += int((now - due) // cfg.period) + 1
        self._planned = None
        actions = np.asarray(actions, dtype=np.float64).reshape(len(actions), -1)  # [H, action_dim]
        # a step landing early (started at once, behind schedule) serves the tick it was planned for, not one
        # whose action is queued already
        k0 = self.grid.at_or_after(frame_time) if self._time_indexed() else max(first_open, planned_tick)
        if cfg.publish_mode is PublishMode.IMMEDIATE and not self.chunked:
            self.stats.immediate += 1
            self._last_immediate = now
            self.last_action = actions[0]
            return self.last_action
        skipped, overlapped = self.broker.place(actions, k0, first_open=first_open)
        self.placed_from = max(k0, first_open)
        self.stats.actions_skipped += skipped
        self.stats.actions_blended += overlapped
        if cfg.publish_mode is PublishMode.IMMEDIATE:  # a chunk: its action for the coming tick goes now
            k = max(first_open, self.grid.at_or_after(now))
            action = self.broker.pop(k)
            if action is not None:
                self.served = k
                self.stats.immediate += 1
                self._last_immediate = now
                self.last_action = action
            return action
        return None

    def on_tick(self, now: float, *, due: float | None = None) -> TickOutput:
        """The tick due nearest to ``due``: its action, or the fallback. A tick already handled (a repeated
        callback, or a chunk action published immediately for it) publishes nothing.

        ``due``: when the driver's timer scheduled this callback (``None``: ``now``). A callback can run much
        later than that on a loaded machine (a period and more); labelled by ``now`` it would take the next
        tick's place, and the callback that really is the next tick's would find it served. A single-action
        policy's action that missed its tick (a tick spent starting an episode) goes out at this one; so do
        chunk rows executed in order (``latency_skip`` off), each one tick later (``Missed``).
        """
        k = self._advance(now, due)
        if k is None:
            return TickOutput(self.served, None, Source.PUBLISHED)
        self.stats.ticks += 1
        action = self.broker.pop(k, self._missed())
        graced, self._graced = self._graced == k, None
        if action is not None:
            self.last_action = action
            self.stats.ticks_late += graced
            return TickOutput(k, action, Source.QUEUE)
        if self._last_immediate > self.grid.time(k) - self.cfg.period:
            return TickOutput(k, None, Source.PUBLISHED)
        self.stats.fallbacks += 1
        return TickOutput(k, self.fallback_action(), Source.FALLBACK)

    def phase_shift(self) -> float:
        """Seconds by which the driver moves its ticks earlier, from the tick after the next one on (0: none).

        Called after ``on_tick``, before the next step is planned. With ``align_to_frames``, once ``align_window``
        steps have started since the last decision (the first: ``FIRST_ALIGN_STEPS``, so that a chunk policy, which
        steps once per refill, aligns within its first refills): the ``align_quantile`` of the ages their frames had
        when they started, less ``frame_guard_ms``, is how much earlier all but that share of them could have started on the same frame; the phase moves
        by that much (at most half a period), so the next steps take frames about ``frame_guard_ms`` old. The
        rate is unchanged; one interval is shorter (a driver that waits on ``grid``, as the ROS node's control
        thread does, follows at once; one whose next callback is scheduled already runs it at the old time, still
        nearest to its tick, and shortens the interval after it). Where frames and ticks
        are not locked (a camera slower than the control rate, rates that are not multiples) steps keep waiting
        for fresh frames (age ~0) and nothing moves.

        A negative quantile (steps waited for frames that came after their planned start, ``frame_wait_ms``)
        moves the phase later by that much (a negative return; one interval is longer): waiting steps land late
        by their wait, and the moved ticks leave the wait inside the plan. Only a driver whose ticks follow
        ``grid`` (the ROS node's control thread) should wait for frames.
        """
        cfg = self.cfg
        aligns = cfg.align_to_frames and cfg.schedule is Schedule.DEADLINE and cfg.publish_mode is PublishMode.TICK
        window = cfg.align_window if self._align_checked else min(cfg.align_window, FIRST_ALIGN_STEPS)
        if not aligns or len(self._ages) < window:
            return 0.0
        age = float(np.quantile(np.fromiter(self._ages, float), cfg.align_quantile, method="lower"))
        self._ages.clear()
        self._align_checked = True
        if age <= -1e-3:  # frames come after the steps are ready: later ticks
            shift = max(age, -cfg.period / 2)
        else:
            shift = min(age - cfg.frame_guard_ms / 1e3, cfg.period / 2)
            if shift < max(cfg.frame_guard_ms / 1e3, 1e-3):  # already aligned
                return 0.0
        # the grid moves now: plans from here on are for the new phase, and a step in flight is late or not by it
        self.grid.t0 -= shift
        if self._planned is not None:
            self._planned = (self._planned[0], self.grid.time(self._planned[0]))
        self.stats.phase_shifts += 1
        return shift

    def _time_indexed(self) -> bool:
        """Chunk row ``i`` serves the ``i``-th tick from its frame's arrival (latency skipping), not the ``i``-th
        tick callback from the chunk's landing."""
        return self.chunked and self.cfg.latency_skip and self.cfg.schedule is Schedule.DEADLINE

    def _missed(self) -> Missed:
        """What a tick does with actions queued for earlier ticks whose callbacks never ran."""
        if not self.chunked:
            return Missed.NEWEST
        return Missed.DROP if self._time_indexed() else Missed.SHIFT

    def skip_tick(self, now: float, *, due: float | None = None) -> None:
        """A tick the driver lets pass without publishing (starting an episode, inputs too old): it counts as
        handled, so a step that lands later serves the next tick (an action queued for this one is dropped).
        Not counted in ``ticks`` or ``fallbacks``."""
        k = self._advance(now, due)
        if k is not None:
            self.broker.pop(k)

    def _advance(self, now: float, due: float | None) -> int | None:
        """Name the tick of a timer callback (see ``on_tick``) and mark it handled; ``None`` if it was already."""
        t = now if due is None else due
        k = self.grid.nearest(t) if self._calibrated else self.served + 1
        if k <= self.served:
            return None
        if self._calibrated:
            self.stats.ticks_missed += k - self.served - 1
        # the driver's timer defines the phase: a callback runs at or after its tick, never before
        self.grid.t0 = min(self.grid.t0, t - k * self.cfg.period) if self._calibrated else t - k * self.cfg.period
        self._calibrated = True
        self.served = k
        return k

    def fallback_action(self) -> np.ndarray | None:
        """``Fallback.HOLD``: ``None``; ``ZERO``: zeros (``fallback_keep_dims`` from the last action);
        ``REPEAT_LAST``: the last action. ``None`` too when no action was published yet."""
        last, mode = self.last_action, self.cfg.fallback
        if mode is Fallback.HOLD or last is None:
            return None
        if mode is Fallback.REPEAT_LAST:
            return last.copy()
        zero = np.zeros_like(last)
        keep = [d for d in self.cfg.fallback_keep_dims if d < len(last)]
        zero[keep] = last[keep]
        return zero

    def queued(self) -> int:
        """Actions queued for ticks not handled yet."""
        return self.broker.queued_from(self.served + 1)
