"""Step-time estimate, the camera's frame clock and the tick grid the control loop plans on.

Times are seconds on one monotonic clock (``time.monotonic()`` in a node, a fake clock in tests).
Tick ``k`` is at ``t0 + k * period``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

EPS = 1e-9  # a time exactly on a tick belongs to that tick


class StepTimer:
    """A running quantile of the last ``window`` step durations (seconds)."""

    def __init__(self, quantile: float, window: int) -> None:
        self.quantile = quantile
        self._times: deque[float] = deque(maxlen=window)
        self._estimate: float | None = 0.0  # None: a step time came in since it was computed

    def add(self, seconds: float) -> None:
        self._times.append(seconds)
        self._estimate = None

    def estimate(self) -> float:
        """The ``quantile`` of recent step times; 0.0 before the first step (the first one starts at once).

        Computed once per new step time: a node asks at every tick and frame, and in a ROS node each call holds
        the GIL its worker needs."""
        if self._estimate is None:
            self._estimate = float(np.quantile(np.fromiter(self._times, float), self.quantile, method="higher"))
        return self._estimate

    def __len__(self) -> int:
        return len(self._times)


class TickGrid:
    """The ticks ``t0 + k * period`` (k >= 0)."""

    def __init__(self, t0: float, period: float) -> None:
        if not period > 0:
            raise ValueError(f"tick period must be > 0, got {period}")
        self.t0 = t0
        self.period = period

    def time(self, k: int) -> float:
        """When tick ``k`` is due."""
        return self.t0 + k * self.period

    def at_or_after(self, t: float) -> int:
        """The first tick due at or after ``t``."""
        return max(0, math.ceil((t - self.t0) / self.period - EPS))

    def nearest(self, t: float) -> int:
        """The tick nearest to ``t`` (a timer callback that fired at ``t`` runs this tick)."""
        return max(0, round((t - self.t0) / self.period))


@dataclass(frozen=True)
class FramePhase:
    """When a steady camera's frames arrive: ``last + n * period`` (a snapshot of ``FrameClock``)."""

    last: float
    period: float

    def at_or_before(self, t: float) -> float:
        """The latest arrival at or before ``t`` (``t`` may lie before ``last``)."""
        return self.last + math.floor((t - self.last) / self.period + EPS) * self.period


class FrameClock:
    """The camera's period, from the receipt times of its last ``window`` frames (the median interval), and when
    its next frame is due. A driver feeds every frame's receipt; ``wait_for_next`` says whether a step starting
    now should wait for that frame (``ControlConfig.frame_wait_ms``)."""

    def __init__(self, window: int = 16) -> None:
        self._last: float | None = None
        self._intervals: deque[float] = deque(maxlen=window)

    def add(self, received: float) -> None:
        if self._last is not None and received > self._last:
            self._intervals.append(received - self._last)
        self._last = received

    def period(self) -> float | None:
        """The median interval between frames; ``None`` before four intervals."""
        if len(self._intervals) < 4:
            return None
        return float(np.median(np.fromiter(self._intervals, float)))

    def phase(self) -> FramePhase | None:
        """The camera's arrival times as of now (``None`` before ``period`` is known)."""
        period = self.period()
        return None if period is None else FramePhase(self._last, period)

    def wait_for_next(self, now: float, limit_s: float) -> float:
        """Seconds a step starting at ``now`` waits for the camera's next frame: ``limit_s`` when that frame is
        due within ``limit_s`` either way (about to come, or a little late), else 0 (no estimate yet, or the next
        frame is further off). The wait ends early when a frame comes."""
        period = self.period()
        if period is None or limit_s <= 0:
            return 0.0
        return limit_s if abs(self._last + period - now) <= limit_s else 0.0
