"""A run's schedule: the learning rate over its steps (``lr_factor``), and its length fitted to a
wall-clock budget (``--time-budget``) instead of a guessed step count (``TimeBudget``).

Measured lengths go wrong on a machine you have not timed (a lent GPU, a loaded runner): a smoke run to
measure the rate costs its own start-up, and a guessed ``max_steps`` either stops early or runs past the
lease. ``TimeBudget`` times a few steps of the real run (after ``skip`` steps of warm-up: allocator,
cuDNN and data-loader start), then says how many steps fit in what is left of the budget; the trainer
lowers ``max_steps`` to that once (the given ``max_steps`` is an upper bound), so the cosine schedule and
the gate's temperature anneal to the step the run will really end at.
"""

from __future__ import annotations

import math
import time
from typing import Callable


def lr_factor(step: int, *, schedule: str, warmup: int, max_steps: int) -> float:
    """Multiplier of the base learning rates at ``step``: linear warm-up, then constant or cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, max_steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class TimeBudget:
    """How many optimizer steps fit in ``minutes`` of training, from the measured rate of steps.

    ``after_step(done, max_steps)`` is called after every optimizer step with the steps done so far in this
    process. It returns the fitted ``max_steps`` (at most ``max_steps``, at least ``done``) after step
    ``skip + measure`` (the rate of steps ``skip .. skip + measure``) and again every ``refit_every`` steps from
    the mean rate since step ``skip`` (a shared machine's rate moves: a run fitted while other jobs ran would
    otherwise end far early or late); ``None`` at every other step, so every rank refits at the same steps.
    """

    def __init__(self, minutes: float, *, skip: int = 2, measure: int = 10, margin: float = 0.97,
                 refit_every: int = 20, clock: Callable[[], float] = time.perf_counter) -> None:
        if not minutes > 0:
            raise ValueError(f"the time budget must be > 0 minutes, got {minutes}")
        self.seconds, self.skip, self.measure, self.margin, self.clock = 60.0 * minutes, skip, measure, margin, clock
        self.refit_every = refit_every
        self.started = clock()
        self._steps = 0
        self._t0: float | None = None
        self.fitted: int | None = None

    def seconds_left(self) -> float:
        """Of the budget, now (what a checkpoint records for a resumed run)."""
        return self.seconds - (self.clock() - self.started)

    def after_step(self, done: int, max_steps: int) -> int | None:
        self._steps += 1
        now = self.clock()
        if self._steps == self.skip:
            self._t0 = now
        first = self.skip + self.measure
        if self._steps < first or (self._steps - first) % self.refit_every:
            return None
        rate = (self._steps - self.skip) / max(now - self._t0, 1e-9)  # steps per second
        left = self.seconds - (now - self.started)
        self.fitted = min(max_steps, max(done, done + int(rate * left * self.margin)))
        return self.fitted
