"""``DeadlineTicker``: ticks at their due times (never early), late ticks named by the latest due, wakes
between ticks that never overlap a tick, and errors reported without stopping the thread.

A fake clock decides what is due; the waits are real but every test waits on events (no sleeps)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from vla_runtime.control import ControlConfig, ControlLoop, DeadlineTicker

PATIENCE_S = 120.0  # how long a test waits for the thread before failing (never reached unless broken)


class Grid:
    """A caller's tick grid: tick k due at ``k * period``; ``served`` advances as ticks run."""

    def __init__(self, period: float) -> None:
        self.period, self.served, self.dues = period, -1, []
        self.changed = threading.Condition()

    def next_due(self) -> float:
        return (self.served + 1) * self.period

    def tick(self, due: float) -> None:
        with self.changed:
            self.dues.append(due)
            self.served = round(due / self.period)
            self.changed.notify_all()

    def wait_for(self, predicate) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=PATIENCE_S)


def thread_clock():
    """Monotonic seconds since this clock's first call, which the ticker's thread makes once it runs: however
    late a loaded machine starts the thread, tick 0 is due when it first looks."""
    start: list[float] = []

    def clock() -> float:
        now = time.monotonic()
        if not start:
            start.append(now)
        return now - start[0]

    return clock


def raise_error(e: BaseException) -> None:
    raise AssertionError(f"unexpected error from a ticker callback: {e!r}")


def test_ticks_run_at_their_due_times_on_the_real_clock_never_early():
    period = 0.02
    clock = thread_clock()
    grid = Grid(period)
    seen: list[tuple[float, float]] = []

    def tick(due: float) -> None:
        seen.append((due, clock()))
        grid.tick(due)

    ticker = DeadlineTicker(next_due=grid.next_due, period=period, on_tick=tick, on_wake=lambda: None,
                            on_error=raise_error, clock=clock)
    ticker.start()
    grid.wait_for(lambda: len(grid.dues) >= 5)
    ticker.stop()
    assert not ticker.running
    for due, ran in seen:
        assert ran >= due  # never before its due time
    dues = [round(due / period) for due, _ in seen]
    assert dues == sorted(set(dues)) and dues[0] == 0  # each tick once, in order, named by its due time


def test_a_tick_more_than_a_period_late_names_the_latest_tick_due():
    grid = Grid(0.1)
    now = [0.35]  # the thread first looks at 0.35: ticks 0..3 are due, 0..2 more than a period ago
    ticker = DeadlineTicker(next_due=grid.next_due, period=0.1, on_tick=grid.tick, on_wake=lambda: None,
                            on_error=raise_error, clock=lambda: now[0])
    ticker.start()
    grid.wait_for(lambda: grid.dues)
    ticker.stop()
    assert grid.dues == [pytest.approx(0.3)]  # the caller counts ticks 0..2 as missed (ControlLoop.ticks_missed)


def test_a_caller_that_does_not_advance_gets_the_next_tick_a_period_later_not_a_busy_loop():
    calls = threading.Semaphore(0)
    dues: list[float] = []

    def next_due() -> float:
        calls.release()
        return 0.0  # never advances

    ticker = DeadlineTicker(next_due=next_due, period=0.1, on_tick=dues.append, on_wake=lambda: None,
                            on_error=raise_error, clock=lambda: 0.05)
    ticker.start()
    for _ in range(3):  # three passes of the loop: a busy loop would have ticked in the first two
        assert calls.acquire(timeout=PATIENCE_S)
    ticker.stop()
    assert dues == [0.0]


def test_wakes_run_between_ticks_and_never_overlap_one():
    grid = Grid(0.01)
    running, overlaps, wakes = threading.Lock(), [], threading.Semaphore(0)
    t0 = time.monotonic()

    def guarded(fn):
        def run(*args):
            if not running.acquire(blocking=False):
                overlaps.append(fn)
                return
            try:
                fn(*args)
            finally:
                running.release()
        return run

    ticker = DeadlineTicker(next_due=grid.next_due, period=0.01, on_tick=guarded(grid.tick),
                            on_wake=guarded(wakes.release), on_error=raise_error, clock=lambda: time.monotonic() - t0)
    ticker.start()
    for _ in range(20):
        ticker.wake()
        assert wakes.acquire(timeout=PATIENCE_S)  # every wake is served (after the tick running, if any)
    grid.wait_for(lambda: len(grid.dues) >= 3)
    ticker.stop()
    assert not overlaps and ticker.wakes == 20 and ticker.ticks >= 3


def test_an_error_in_a_tick_is_reported_and_the_ticks_go_on():
    grid = Grid(0.01)
    errors: list[BaseException] = []
    ran: list[float] = []

    def tick(due: float) -> None:  # the second tick that runs fails (a loaded machine may skip tick 1 itself)
        grid.tick(due)
        ran.append(due)
        if len(ran) == 2:
            raise ValueError("bad tick")

    ticker = DeadlineTicker(next_due=grid.next_due, period=0.01, on_tick=tick, on_wake=lambda: None,
                            on_error=errors.append, clock=thread_clock())
    ticker.start()
    grid.wait_for(lambda: len(ran) >= 4)
    ticker.stop()
    assert [str(e) for e in errors] == ["bad tick"]


def test_an_on_error_that_raises_too_is_logged_and_the_ticks_go_on(caplog):
    grid = Grid(0.01)
    ran: list[float] = []

    def tick(due: float) -> None:
        grid.tick(due)
        ran.append(due)
        if len(ran) == 2:
            raise ValueError("bad tick")

    def broken_report(error: BaseException) -> None:
        raise RuntimeError("the report failed")

    ticker = DeadlineTicker(next_due=grid.next_due, period=0.01, on_tick=tick, on_wake=lambda: None,
                            on_error=broken_report, clock=thread_clock())
    ticker.start()
    grid.wait_for(lambda: len(ran) >= 4)  # the thread outlived both exceptions
    ticker.stop()
    assert "on_error raised RuntimeError('the report failed') while reporting ValueError('bad tick')" in caplog.text


def test_a_control_loop_driven_by_the_ticker_follows_a_phase_move_at_once():
    """The loop's grid is the ticker's: after ``phase_shift`` the next tick is due ``shift`` earlier."""
    cfg = ControlConfig(rate_hz=10, align_window=1)
    now = [0.0]
    loop = ControlLoop(cfg, t0=0.0, chunked=False)
    dues: list[float] = []
    moved = threading.Event()

    def tick(due: float) -> None:
        loop.on_tick(now[0], due=due)
        dues.append(due)
        if loop.served == 0:  # one step landed on a frame 40 ms old when it started: the phase moves 35 ms
            loop.on_result([[0.0]], frame_time=0.01, step_s=0.01, now=0.06, started=0.05)
            assert loop.phase_shift() == pytest.approx(0.035)
            now[0] = 0.07  # tick 1 is due at 0.065 now
        elif loop.served == 1:
            moved.set()

    ticker = DeadlineTicker(next_due=lambda: loop.grid.time(loop.served + 1), period=cfg.period, on_tick=tick,
                            on_wake=lambda: None, on_error=raise_error, clock=lambda: now[0])
    ticker.start()
    assert moved.wait(PATIENCE_S)
    ticker.stop()
    assert dues == [0.0, pytest.approx(0.065)]


def test_bad_period_is_refused():
    with pytest.raises(ValueError, match="period must be > 0"):
        DeadlineTicker(next_due=lambda: 0.0, period=0.0, on_tick=lambda d: None, on_wake=lambda: None, on_error=raise_error)


def test_a_priority_runs_the_thread_sched_fifo_or_says_why_not():
    grid = Grid(0.01)
    t0 = time.monotonic()
    ticker = DeadlineTicker(next_due=grid.next_due, period=0.01, on_tick=grid.tick, on_wake=lambda: None,
                            on_error=raise_error, clock=lambda: time.monotonic() - t0)
    refused = ticker.start(priority=7)
    try:
        policy = os.sched_getscheduler(ticker._thread.native_id)
        if refused:  # no CAP_SYS_NICE / rtprio limit here: normal scheduling, and the reason names the priority
            assert "SCHED_FIFO priority 7 not set" in refused and policy == os.SCHED_OTHER
        else:
            assert policy == os.SCHED_FIFO and os.sched_getparam(ticker._thread.native_id).sched_priority == 7
        grid.wait_for(lambda: len(grid.dues) >= 2)  # it ticks either way
    finally:
        ticker.stop()
    with pytest.raises(ValueError, match="priority must be 0 .* or 1-99"):
        DeadlineTicker(next_due=grid.next_due, period=0.01, on_tick=grid.tick, on_wake=lambda: None,
                       on_error=raise_error).start(priority=100)
