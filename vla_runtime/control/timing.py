"""Step-time estimate and the tick grid the control loop plans on.

Times are seconds on one monotonic clock (``time.monotonic()`` in a node, a fake clock in tests).
Tick ``k`` is at ``t0 + k * period``.
"""

from __future__ import annotations

import math
from collections import deque

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
