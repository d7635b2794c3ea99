"""A thread that runs control ticks at absolute deadlines, as ros2_control's update loop does.

An executor's timer runs a tick when the executor gets to it: on a loaded machine rclpy's spin thread
rebuilds its wait set in Python for every callback, runs the callback late, and rcl drops a callback
that is more than a period late (nothing goes out for that tick). ``DeadlineTicker`` owns one thread
that sleeps until the next tick's due time (read from the caller's tick grid, so a phase move applies at
once) or until ``wake()``; it calls ``on_tick(due)`` once per tick, labelled by the time it was due, and
``on_wake()`` for a wake between ticks (a frame arrived, a worker job ended). The two never overlap.

    ticker = DeadlineTicker(next_due=lambda: loop.grid.time(loop.served + 1), period=loop.cfg.period,
                            on_tick=tick, on_wake=frame_ready, on_error=report)
    ticker.start(); ...; ticker.wake(); ...; ticker.stop()

A tick that runs more than a period late names the latest tick due; the ones in between are the loop's
``ticks_missed``. An exception in a callback goes to ``on_error`` and the thread goes on (a robot's
control loop does not stop on one bad tick).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class DeadlineTicker:
    """Runs ``on_tick(due)`` at each due time ``next_due()`` names and ``on_wake()`` when woken in between.

    Args:
        next_due: when the next tick is due (seconds on ``clock``); asked before every wait. A due time not
            after the last tick run is taken as that tick plus ``period`` (the caller did not advance).
        period: seconds between ticks.
        on_tick: runs the tick due at its argument (called at or after that time).
        on_wake: runs the work a ``wake()`` asked for (never during ``on_tick``).
        on_error: gets an exception raised by either callback; the thread then goes on (if ``on_error`` raises
            too, both are logged).
        name: the thread's name.
        clock: monotonic seconds (``time.monotonic``; the waits are on it too).
    """

    def __init__(self, *, next_due: Callable[[], float], period: float, on_tick: Callable[[float], None],
                 on_wake: Callable[[], None], on_error: Callable[[BaseException], None], name: str = "control_ticks",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not period > 0:
            raise ValueError(f"tick period must be > 0, got {period}")
        self._next_due, self._period, self._clock = next_due, period, clock
        self._on_tick, self._on_wake, self._on_error = on_tick, on_wake, on_error
        self._woken = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._last_due = -math.inf
        self.ticks = 0  # ticks run
        self.wakes = 0  # on_wake calls

    def start(self, *, priority: int = 0) -> str:
        """Start the thread; ``priority`` 1-99: run it ``SCHED_FIFO`` at that priority (as ros2_control's update
        loop), so the kernel runs it the moment a tick is due, ahead of every normal thread (the GIL it then
        needs is another matter). Returns ``""``, or why the priority could not be set (no ``CAP_SYS_NICE`` or
        rtprio limit, not Linux): the thread then runs with normal scheduling."""
        if not 0 <= priority <= 99:
            raise ValueError(f"control thread priority must be 0 (normal scheduling) or 1-99 (SCHED_FIFO), got {priority}")
        self._thread.start()
        if not priority:
            return ""
        try:
            os.sched_setscheduler(self._thread.native_id, os.SCHED_FIFO, os.sched_param(priority))
        except (OSError, AttributeError) as e:
            return f"SCHED_FIFO priority {priority} not set ({e}); normal scheduling"
        return ""

    def wake(self) -> None:
        """Ask for ``on_wake`` as soon as the thread is free (calls before it runs merge into one)."""
        self._woken.set()

    def stop(self) -> None:
        """Let the callback running finish, end the thread and wait for it (not from the thread itself)."""
        self._stopping.set()
        self._woken.set()
        if self._thread.ident is not None:
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            due = self._due()
            now = self._clock()
            if now < due:
                if self._woken.wait(due - now) and not self._stopping.is_set():
                    self._woken.clear()
                    self.wakes += 1
                    self._call(self._on_wake)
                continue
            if now - due >= self._period:  # more than a period late: the latest tick due runs, those before are missed
                due += math.floor((now - due) / self._period) * self._period
            self._last_due = due
            self.ticks += 1
            self._call(self._on_tick, due)

    def _due(self) -> float:
        try:
            due = self._next_due()
        except Exception as e:  # noqa: BLE001 - reported; the ticks go on on the last grid
            self._report(e)
            due = -math.inf
        if due > self._last_due:
            return due
        return self._last_due + self._period if math.isfinite(self._last_due) else self._clock()

    def _call(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported through on_error, never lost; the loop goes on
            self._report(e)

    def _report(self, error: BaseException) -> None:
        """``on_error(error)``; should that raise too, both are logged and the ticks still go on."""
        try:
            self._on_error(error)
        except Exception as failed:  # noqa: BLE001 - the last resort: the log
            log.error("%s: on_error raised %r while reporting %r", self._thread.name, failed, error, exc_info=failed)
