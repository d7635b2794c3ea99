"""``vla_runtime.control``: ticks that move to meet the camera's frames, and chunk refills started on a fresh frame
(fake clock, no sleeps)."""

import numpy as np
import pytest
from vla_runtime.control import ControlConfig, ControlLoop
from vla_runtime.control.loop import FIRST_ALIGN_STEPS
from vla_runtime.control.timing import FramePhase

from .loops import P, chunk, make

def test_ticks_move_earlier_to_meet_the_cameras_frames():
    loop = make(align_window=3, frame_guard_ms=5.0, margin_ms=0.0)
    loop.timer.add(0.02)  # a step takes 20 ms: each starts 20 ms before its tick
    for k in range(3):  # the newest frame is always 30 ms old when a step takes it (camera phase against the ticks)
        loop.on_tick(k * P, due=k * P)
        start = (k + 1) * P - 0.02
        loop.on_result(np.array([[float(k)]]), frame_time=start - 0.03, step_s=0.02, now=start + 0.02, started=start)
        assert loop.phase_shift() == (pytest.approx(0.025) if k == 2 else 0.0)
    # from tick 4 on the driver's ticks come 25 ms earlier: plans are for that phase at once
    assert loop.grid.t0 == pytest.approx(-0.025) and loop.plan(0.29).start_at == pytest.approx(0.4 - 0.025 - 0.02)
    # tick 3's callback was scheduled already (old phase, 25 ms after the new one): still tick 3, and on time
    loop.on_result(np.array([[3.0]]), frame_time=0.25, step_s=0.02, now=0.29, started=0.28)
    out = loop.on_tick(0.3, due=0.3)
    assert (out.tick, out.action[0]) == (3, 3.0) and loop.stats.steps_late == 0
    out = loop.on_tick(0.375, due=0.375)
    assert out.tick == 4 and loop.grid.t0 == pytest.approx(-0.025) and loop.stats.phase_shifts == 1


def test_ticks_move_later_when_steps_wait_for_frames_that_come_after_their_start():
    """``frame_wait_ms``: a step ready at its planned start waits for a frame that arrives 4 ms later (its age is
    negative); the ticks move 4 ms later, so the next steps' plans hold the wait instead of landing late."""
    loop = make(align_window=3, frame_guard_ms=0.0, align_quantile=0.5, margin_ms=0.0)
    loop.timer.add(0.02)
    for k in range(3):
        loop.on_tick(k * P, due=k * P)
        ready = (k + 1) * P - 0.02
        loop.on_result(np.array([[float(k)]]), frame_time=ready + 0.004, step_s=0.02, now=ready + 0.024, started=ready)
        assert loop.phase_shift() == (pytest.approx(-0.004) if k == 2 else 0.0)
    assert loop.grid.t0 == pytest.approx(0.004) and loop.stats.phase_shifts == 1
    assert loop.plan(0.29).start_at == pytest.approx(0.4 + 0.004 - 0.02)  # tick 4 (3 has its action) is due at 0.404
    out = loop.on_tick(0.304, due=0.304)  # the driver's tick at the moved time is tick 3, and the phase stays
    assert (out.tick, out.action[0]) == (3, 2.0) and loop.grid.t0 == pytest.approx(0.004)
    # a wait under a millisecond (or none) moves nothing
    still = make(align_window=1, frame_guard_ms=0.0, align_quantile=0.5)
    still.on_tick(0.0, due=0.0)
    still.on_result(np.array([[0.0]]), frame_time=0.0805, step_s=0.01, now=0.09, started=0.08)
    assert still.phase_shift() == 0.0


def test_a_step_in_flight_during_a_phase_move_is_late_by_the_moved_tick():
    loop = make(align_window=1, frame_guard_ms=5.0, margin_ms=0.0)
    loop.timer.add(0.02)
    loop.on_tick(0.0, due=0.0)
    loop.on_result(np.array([[0.0]]), frame_time=0.05, step_s=0.02, now=0.1, started=0.08)
    loop.on_tick(0.1, due=0.1)
    loop.started(loop.plan(0.1))  # tick 2's step, planned on the old grid (tick 2 at 0.2)
    assert loop.phase_shift() == pytest.approx(0.025)  # tick 2 is due at 0.175 now
    loop.on_result(np.array([[2.0]]), frame_time=0.17, step_s=0.02, now=0.19, started=0.17)
    assert loop.stats.steps_late == 1  # landed after the moved tick (it would be on time for the old one)


def test_no_phase_move_while_some_step_waits_for_its_frame_or_off():
    loop = make(align_window=3)
    ages = [0.030, 0.001, 0.030]  # one step had to wait for a frame: it arrived just as the step started
    for k, age in enumerate(ages):
        loop.on_tick(k * P, due=k * P)
        loop.on_result(np.array([[0.0]]), frame_time=k * P + 0.08 - age, step_s=0.01, now=k * P + 0.09, started=k * P + 0.08)
    assert loop.phase_shift() == 0.0
    for kw in ({"align_to_frames": False}, {"schedule": "asap"}, {"publish_mode": "immediate"}):
        off = make(align_window=1, **kw)
        off.on_tick(0.0)
        off.on_result(np.array([[0.0]]), frame_time=0.0, step_s=0.01, now=0.09, started=0.08)
        assert off.phase_shift() == 0.0, kw


def test_a_chunk_refill_starts_on_a_frame_that_lands_just_before_a_tick_when_ticks_and_frames_are_not_locked():
    """100 Hz ticks, a 30 Hz camera: the refill planned to land on tick 20 (start 0.1685) would take a frame 30 ms
    old; the arrival at 0.13833 lands 0.2 ms before tick 17 and starts the refill on a fresh frame instead."""
    loop = ControlLoop(ControlConfig(rate_hz=100, refill_threshold=1, margin_ms=0.0), t0=0.0, chunked=True)
    loop.timer.add(0.0315)
    loop.on_tick(0.0, due=0.0)
    loop.on_result(chunk(21), frame_time=0.0, step_s=0.0315, now=0.0)  # rows for ticks 0..20
    camera = FramePhase(last=0.005, period=1 / 30)  # arrivals at 0.005 + n / 30
    assert loop.plan(0.01).start_at == pytest.approx(0.2 - 0.0315)  # no camera phase: the deadline plan
    plan = loop.plan(0.01, frames=camera)
    assert plan.start_at == pytest.approx(0.005 + 4 / 30) and plan.tick == 17  # lands at 0.16983, before tick 17
    # the refill's frame is fresh and its first action waits 0.2 ms for its tick: 31.7 ms from frame to action,
    # against 30.2 + 31.5 (+0 wait) on the deadline plan's newest frame
    for k in range(1, 17):
        loop.on_tick(k * 0.01, due=k * 0.01)
    loop.on_result(chunk(16, base=100.0), frame_time=plan.start_at, step_s=0.0315, now=plan.start_at + 0.0315)
    out = loop.on_tick(0.17, due=0.17)
    assert out.tick == 17 and out.action[0] == 100.0 + 3  # frame at tick 13.8 -> row 0 serves tick 14, row 3 tick 17
    assert out.tick * 0.01 - plan.start_at == pytest.approx(0.0317, abs=1e-4)


def test_a_chunk_refill_keeps_its_deadline_start_where_ticks_and_frames_are_locked_or_no_arrival_is_ahead():
    loop = ControlLoop(ControlConfig(rate_hz=10, refill_threshold=1, margin_ms=0.0), t0=0.0, chunked=True)
    loop.timer.add(0.3)
    loop.on_tick(0.0, due=0.0)
    loop.on_result(chunk(21), frame_time=0.0, step_s=0.3, now=0.0)  # rows for ticks 0..20
    # 10 Hz ticks, 30 Hz camera: every arrival's landing waits as long as the planned start's frame is old (the
    # phase alignment moves the ticks instead)
    assert loop.plan(0.01, frames=FramePhase(last=0.012, period=1 / 30)).start_at == pytest.approx(2.0 - 0.3)
    # the arrivals before the planned start are past already
    fast = ControlLoop(ControlConfig(rate_hz=100, refill_threshold=1, margin_ms=0.0), t0=0.0, chunked=True)
    fast.timer.add(0.0315)
    fast.on_tick(0.0, due=0.0)
    fast.on_result(chunk(3), frame_time=0.0, step_s=0.0315, now=0.0)  # rows for ticks 0..2: the refill is due now
    assert fast.plan(0.0, frames=FramePhase(last=-0.03, period=1 / 30)).start_at == 0.0
    # off without align_to_frames
    off = ControlLoop(ControlConfig(rate_hz=100, refill_threshold=1, margin_ms=0.0, align_to_frames=False), t0=0.0,
                      chunked=True)
    off.timer.add(0.0315)
    off.on_tick(0.0, due=0.0)
    off.on_result(chunk(21), frame_time=0.0, step_s=0.0315, now=0.0)
    assert off.plan(0.01, frames=FramePhase(last=0.005, period=1 / 30)).start_at == pytest.approx(0.2 - 0.0315)


def test_the_first_phase_move_needs_only_a_few_steps_and_later_ones_the_whole_window():
    """A chunk policy steps once per refill: at 5 Hz, 20 steps are a minute; the first move comes after
    ``FIRST_ALIGN_STEPS``."""
    loop = make(align_window=20, frame_guard_ms=0.0, align_quantile=0.5, margin_ms=0.0)
    loop.timer.add(0.02)
    shifts = []
    for k in range(FIRST_ALIGN_STEPS + 20):
        loop.on_tick(k * P + loop.grid.t0, due=k * P + loop.grid.t0)
        start = loop.grid.time(k + 1) - 0.02
        loop.on_result(np.array([[0.0]]), frame_time=start - 0.03, step_s=0.02, now=start + 0.02, started=start)
        shifts.append(loop.phase_shift())
    moved = [i for i, shift in enumerate(shifts) if shift]
    assert moved == [FIRST_ALIGN_STEPS - 1, FIRST_ALIGN_STEPS + 19]
