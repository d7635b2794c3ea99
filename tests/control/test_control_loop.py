"""``vla_runtime.control`` on a fake clock: every time below is a number the test chooses (no sleeps)."""

import math

import numpy as np
import pytest
from vla_runtime.control import (
    Blend, ChunkBroker, ControlConfig, ControlLoop, Fallback, Missed, PublishMode, Schedule, Source, StepTimer, TickGrid,
    blend,
)

from .loops import P, chunk, make


def test_config_rejects_bad_values_and_parses_strings_once():
    cfg = ControlConfig(schedule="asap", publish_mode="immediate", fallback="repeat_last", blend="adaptive")
    assert (cfg.schedule, cfg.publish_mode, cfg.fallback, cfg.blend) == (
        Schedule.ASAP, PublishMode.IMMEDIATE, Fallback.REPEAT_LAST, Blend.ADAPTIVE)
    with pytest.raises(KeyError, match="`fallback` is 'stop'; expected one of hold, zero, repeat_last"):
        ControlConfig(fallback="stop")
    with pytest.raises(ValueError, match="`step_quantile` must be in"):
        ControlConfig(step_quantile=0.0)
    with pytest.raises(ValueError, match="`refill_threshold` must be >= 0, got -1"):
        ControlConfig(refill_threshold=-1)
    # NaN passes `x < 0`: a NaN blend weight would reach the robot, a NaN margin fail mid-episode
    for name, value in (("temporal_coeff", math.nan), ("margin_ms", math.nan), ("margin_ms", math.inf), ("rate_hz", math.inf)):
        with pytest.raises(ValueError, match=f"`{name}` must be a finite number"):
            ControlConfig(**{name: value})


def test_step_timer_quantile_tracks_the_recent_window():
    timer = StepTimer(quantile=0.95, window=20)
    assert timer.estimate() == 0.0
    for _ in range(19):
        timer.add(0.010)
    timer.add(0.050)
    assert timer.estimate() == pytest.approx(0.050)  # "higher": 1 slow step in 20 is planned for
    for _ in range(20):
        timer.add(0.020)  # the slow one left the window
    assert timer.estimate() == pytest.approx(0.020)


def test_tick_grid():
    grid = TickGrid(1.0, P)
    assert grid.at_or_after(1.0) == 0 and grid.at_or_after(1.2) == 2 and grid.at_or_after(1.2001) == 3
    assert grid.nearest(1.26) == 3 and grid.nearest(1.24) == 2


def test_deadline_plan_starts_late_enough_to_use_the_newest_frame():
    loop = make(margin_ms=5.0)
    plan = loop.plan(0.0)  # no step time measured yet: only the margin is planned for
    assert plan.tick == 1 and plan.start_at == pytest.approx(0.095)
    loop.on_tick(0.0)
    assert loop.on_tick(0.1).source is Source.FALLBACK  # the first step overran its plan (30 ms, not 0)
    loop.on_result(chunk(1), frame_time=0.095, step_s=0.030, now=0.125)
    assert loop.on_tick(0.2).source is Source.QUEUE
    plan = loop.plan(0.201)
    assert plan.tick == 3 and plan.start_at == pytest.approx(0.3 - 0.030 - 0.005)  # finishes 5 ms before tick 3
    # too late for tick 3 by the plan: a step at once may still make it (waiting would leave tick 3 empty)
    plan = loop.plan(0.29)
    assert plan.tick == 3 and plan.start_at == pytest.approx(0.29)
    loop.on_tick(0.3)
    plan = loop.plan(0.301)  # tick 4 can be met: its deadline start, never a start in the past
    assert plan.tick == 4 and plan.start_at == pytest.approx(0.4 - 0.035)


def test_the_frame_just_before_a_tick_is_acted_on_at_that_tick():
    loop = make(margin_ms=2.0)
    for _ in range(5):
        loop.timer.add(0.020)
    loop.served = 4
    plan = loop.plan(0.41)  # tick 5 at 0.5: start at 0.478
    assert plan.tick == 5 and plan.start_at == pytest.approx(0.478)
    loop.started(plan)
    action = np.array([0.7, -0.7])
    loop.on_result(action[None], frame_time=0.477, step_s=0.020, now=0.498)
    out = loop.on_tick(0.5003)  # the timer fires a little late
    assert out.tick == 5 and out.source is Source.QUEUE
    np.testing.assert_array_equal(out.action, action)
    assert loop.stats.steps_late == 0 and loop.stats.fallbacks == 0


def test_a_step_that_overruns_by_two_periods_counts_the_ticks_it_could_have_left_empty():
    loop = make(margin_ms=0.0)
    for _ in range(5):
        loop.timer.add(0.020)
    loop.served = 4
    plan = loop.plan(0.41)  # tick 5 at 0.5
    loop.started(plan)
    for now in (0.5, 0.6, 0.7):  # the process stalled: the step lands at 0.75, after ticks 5, 6 and 7
        assert loop.on_tick(now).source is Source.FALLBACK
    loop.on_result(np.array([[0.1, 0.2]]), frame_time=0.47, step_s=0.27, now=0.75)
    assert (loop.stats.steps_late, loop.stats.ticks_overrun, loop.stats.fallbacks) == (1, 3, 3)
    plan = loop.plan(0.76)
    loop.started(plan)
    loop.on_result(np.array([[0.1, 0.2]]), frame_time=0.75, step_s=0.02, now=0.78)  # on time: nothing added
    assert (loop.stats.steps_late, loop.stats.ticks_overrun) == (1, 3)


def _overrunning(**kw) -> ControlLoop:
    """Step time 20 ms, tick 5 at 0.5 served from 0.4 on, its step started at 0.48: in flight at the tick."""
    loop = make(margin_ms=0.0, **kw)
    for _ in range(5):
        loop.timer.add(0.020)
    loop.served = 4
    plan = loop.plan(0.41)
    assert plan.tick == 5 and plan.start_at == pytest.approx(0.41 if kw.get("publish_mode") == "immediate" else 0.48)
    loop.started(plan)
    return loop


def test_a_tick_whose_step_overran_it_waits_the_grace_and_publishes_it_late():
    loop = _overrunning(late_grace_ms=8.0)
    until = loop.grace_until(0.5001, due=0.5)
    assert until == pytest.approx(0.508)  # tick 5's due time + the grace
    loop.on_result(np.array([[0.3, 0.4]]), frame_time=0.479, step_s=0.026, now=0.506)  # 6 ms late
    out = loop.on_tick(0.506, due=0.5)
    assert out.tick == 5 and out.source is Source.QUEUE and out.action.tolist() == [0.3, 0.4]
    assert (loop.stats.ticks_late, loop.stats.fallbacks, loop.stats.steps_late) == (1, 0, 1)
    assert loop.on_tick(0.6).source is Source.FALLBACK  # the late action served tick 5, not tick 6 as well
    assert loop.stats.ticks_late == 1


def test_a_step_later_than_the_grace_leaves_its_tick_to_the_fallback_and_serves_the_next():
    loop = _overrunning(late_grace_ms=8.0, fallback="repeat_last")
    loop.last_action = np.array([9.0, 9.0])
    assert loop.grace_until(0.5001, due=0.5) == pytest.approx(0.508)
    out = loop.on_tick(0.508, due=0.5)  # the wait ran out
    assert out.source is Source.FALLBACK and out.action.tolist() == [9.0, 9.0]
    loop.on_result(np.array([[0.3, 0.4]]), frame_time=0.479, step_s=0.040, now=0.520)
    assert loop.on_tick(0.6).action.tolist() == [0.3, 0.4]  # a single action that missed its tick: the next one
    assert (loop.stats.ticks_late, loop.stats.fallbacks) == (0, 1)


@pytest.mark.parametrize("case", ["grace 0", "queued", "no step", "step for a later tick", "past the grace", "immediate"])
def test_no_wait_when_the_tick_has_its_action_or_nothing_runs_for_it(case):
    loop = _overrunning(late_grace_ms=0.0 if case == "grace 0" else 8.0,
                        publish_mode="immediate" if case == "immediate" else "tick")
    if case == "queued":
        loop.on_result(np.array([[0.3, 0.4]]), frame_time=0.479, step_s=0.019, now=0.499)
    if case == "no step":
        loop.reset()
    if case == "step for a later tick":
        loop._planned = (6, 0.6)
    now = 0.5091 if case == "past the grace" else 0.5001
    assert loop.grace_until(now, due=0.5) is None


def test_the_grace_stays_under_half_a_period():
    loop = _overrunning(late_grace_ms=1000.0)
    assert loop.grace_until(0.5001, due=0.5) == pytest.approx(0.5 + 0.45 * P)
    with pytest.raises(ValueError, match="`late_grace_ms` must be >= 0"):
        ControlConfig(late_grace_ms=-1.0)


def test_a_chunk_skips_rows_for_ticks_already_past_and_refills_before_running_dry():
    loop = make(chunked=True, refill_threshold=1, margin_ms=0.0)
    loop.timer.add(0.3)  # a step takes 3 periods
    loop.served = 9
    # frame arrived at 0.95: row 0 serves tick 10 (1.0), the chunk lands at 1.25, after ticks 10-12 were served
    for now in (1.0, 1.1, 1.2):
        assert loop.on_tick(now).source is Source.FALLBACK
    loop.on_result(chunk(8), frame_time=0.95, step_s=0.3, now=1.25)
    assert loop.stats.actions_skipped == 3  # rows 0-2 (ticks 10-12) are in the past
    assert loop.on_tick(1.3).action[0] == 3.0  # tick 13 gets row 3
    # rows 3..7 cover ticks 13..17; threshold 1: the next chunk lands before tick 17, while 1 row is still queued
    plan = loop.plan(1.31)
    assert plan.tick == 17 and plan.start_at == pytest.approx(1.7 - 0.3)
    for now in (1.4, 1.5, 1.6):
        loop.on_tick(now)
    loop.on_result(chunk(8, base=100.0), frame_time=plan.start_at, step_s=0.3, now=1.69)
    assert loop.stats.actions_blended == 1  # tick 17 has a row of each chunk
    assert loop.on_tick(1.7).action[0] == 100.0 + 3  # Blend.NONE: the newest wins; frame at 1.4 -> row 3 for tick 17
    assert loop.on_tick(1.8).action[0] == 104.0
    assert loop.stats.fallbacks == 3  # only the ticks before the first chunk


def test_asap_schedule_is_the_old_loop_step_when_empty_and_act_at_the_next_tick():
    loop = make(chunked=True, schedule="asap")
    loop.timer.add(0.3)
    assert loop.plan(0.05).start_at == 0.05
    for t in (0.1, 0.2, 0.3):  # ticks while the step runs
        assert loop.on_tick(t).source is Source.FALLBACK
    loop.on_result(chunk(4), frame_time=0.0, step_s=0.3, now=0.35)
    assert loop.stats.actions_skipped == 0
    assert loop.plan(0.36) is None  # queue not empty
    assert [loop.on_tick(t).action[0] for t in (0.0 + 0.4, 0.5, 0.6, 0.7)] == [0.0, 1.0, 2.0, 3.0]
    assert loop.plan(0.71).start_at == 0.71


@pytest.mark.parametrize("mode, want", [
    (Fallback.HOLD, None), (Fallback.ZERO, [0.0, 0.0, 0.9]), (Fallback.REPEAT_LAST, [0.4, -0.2, 0.9])])
def test_each_fallback(mode, want):
    loop = make(fallback=mode, fallback_keep_dims=(2,))
    assert loop.on_tick(0.0).action is None  # nothing was published yet: nothing to repeat
    loop.on_result(np.array([[0.4, -0.2, 0.9]]), frame_time=0.0, step_s=0.01, now=0.05)
    assert loop.on_tick(0.1).source is Source.QUEUE
    out = loop.on_tick(0.2)
    assert out.source is Source.FALLBACK and loop.stats.fallbacks == 2
    assert (out.action is None) if want is None else np.allclose(out.action, want)


def test_immediate_mode_publishes_at_once_and_the_tick_of_that_period_stays_quiet():
    loop = make(publish_mode="immediate")
    assert loop.plan(0.03).start_at == 0.03
    action = loop.on_result(np.array([[1.0, 2.0]]), frame_time=0.02, step_s=0.01, now=0.04)
    np.testing.assert_array_equal(action, [1.0, 2.0])
    assert loop.on_tick(0.1).source is Source.PUBLISHED
    assert loop.on_tick(0.2).source is Source.FALLBACK  # a whole period without an action


def test_immediate_mode_for_a_chunk_publishes_the_coming_ticks_row_and_queues_the_rest():
    loop = make(chunked=True, publish_mode="immediate")
    loop.on_tick(0.0)
    action = loop.on_result(chunk(4), frame_time=0.1, step_s=0.02, now=0.12)  # row 0 is tick 1 (0.1): past
    assert action[0] == 1.0  # row 1 serves tick 2, published now
    assert loop.on_tick(0.2).source is Source.PUBLISHED
    assert loop.on_tick(0.3).action[0] == 2.0


def test_blend_modes():
    old, new = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    np.testing.assert_array_equal(blend([old, new], Blend.NONE, temporal_coeff=0.01, adaptive_alpha=0.1), new)
    w = np.exp(-0.5 * np.arange(2))
    np.testing.assert_allclose(blend([old, new], Blend.TEMPORAL, temporal_coeff=0.5, adaptive_alpha=0.1),
                               (w[0] * old + w[1] * new) / w.sum())
    # adaptive: cos(old, new) = 0, cos(new, new) = 1 -> weights e^0, e^alpha
    w = np.exp(np.array([0.0, 2.0]))
    np.testing.assert_allclose(blend([old, new], Blend.ADAPTIVE, temporal_coeff=0.01, adaptive_alpha=2.0),
                               (w[0] * old + w[1] * new) / w.sum())


def test_broker_blends_overlaps_and_drops_served_ticks():
    broker = ChunkBroker(Blend.TEMPORAL, temporal_coeff=0.0)
    assert broker.place(chunk(3), 5, first_open=6) == (1, 0)
    assert broker.place(chunk(3, base=10.0), 6, first_open=6) == (0, 2)
    assert broker.queued_from(6) == 3 and broker.last_tick() == 8
    assert broker.pop(7)[0] == pytest.approx((2.0 + 11.0) / 2)  # tick 6 is dropped with it
    assert broker.queued_from(0) == 1 and broker.pop(7) is None


def test_reset_forgets_the_queue_and_the_last_action():
    loop = make(chunked=True, fallback="repeat_last")
    loop.on_result(chunk(4), frame_time=0.0, step_s=0.01, now=0.01)
    loop.on_tick(0.0)
    loop.reset()
    assert loop.queued() == 0 and loop.on_tick(0.1).action is None


def test_the_tick_phase_follows_the_drivers_timer_callbacks():
    loop = make(t0=0.0)  # the driver's guess; its timer really fires at 0.05 + k * P, a little late
    assert loop.on_tick(0.051).tick == 0 and loop.grid.t0 == pytest.approx(0.051)
    assert loop.on_tick(0.1515).tick == 1 and loop.grid.t0 == pytest.approx(0.051)
    assert loop.on_tick(0.2502).tick == 2 and loop.grid.t0 == pytest.approx(0.0502)  # the earliest callback wins
    assert loop.on_tick(0.4503).tick == 4  # a missed callback: tick 3 is gone, not served late
    loop.timer.add(0.02)
    assert loop.plan(0.46).start_at == pytest.approx(0.5502 - 0.023)


def test_a_result_never_goes_to_a_tick_the_driver_let_pass():
    loop = make()
    loop.on_tick(0.0)
    # ticks 1 and 2 passed without on_tick (the driver was starting an episode); a step lands at 0.21
    loop.on_result(np.array([[5.0]]), frame_time=0.2, step_s=0.01, now=0.21)
    assert loop.placed_from == 2  # tick 2 (0.2) is only 10 ms late: its callback may still come
    out = loop.on_tick(0.212)
    assert out.tick == 2 and out.action[0] == 5.0
    loop.on_result(np.array([[6.0]]), frame_time=0.2, step_s=0.01, now=0.47)
    assert loop.placed_from == 5 and loop.on_tick(0.5).action[0] == 6.0


def test_a_late_callback_serves_the_tick_it_was_due_for_not_the_next():
    loop = make()
    loop.on_tick(0.0, due=0.0)
    loop.on_result(np.array([[1.0]]), frame_time=0.05, step_s=0.01, now=0.09)  # for tick 1
    # tick 1's callback runs 80 ms late (nearer to tick 2 than to tick 1), then tick 2's on time
    out = loop.on_tick(0.18, due=0.1)
    assert (out.tick, out.source, out.action[0]) == (1, Source.QUEUE, 1.0)
    loop.on_result(np.array([[2.0]]), frame_time=0.15, step_s=0.01, now=0.19)
    out = loop.on_tick(0.2, due=0.2)
    assert (out.tick, out.source, out.action[0]) == (2, Source.QUEUE, 2.0)
    assert loop.grid.t0 == pytest.approx(0.0) and loop.stats.fallbacks == 1  # tick 0 only


def test_ticks_whose_callbacks_never_ran_are_counted_missed():
    loop = make()
    loop.on_tick(0.0)
    loop.on_tick(0.1)
    assert loop.stats.ticks_missed == 0
    loop.on_tick(0.4)  # the callbacks of ticks 2 and 3 never ran
    loop.skip_tick(0.6)  # a tick let pass on purpose is not missed; tick 5's callback never ran
    assert (loop.stats.ticks, loop.stats.ticks_missed) == (3, 3)


def test_a_single_action_that_missed_its_tick_goes_out_at_the_next_and_a_chunk_row_does_not():
    single = make()
    single.on_tick(0.0)
    # tick 1's callback went to starting an episode (no on_tick); the first step lands 10 ms before it ran
    single.on_result(np.array([[7.0]]), frame_time=0.05, step_s=0.04, now=0.095)
    assert single.placed_from == 1
    out = single.on_tick(0.2)
    assert (out.tick, out.source, out.action[0]) == (2, Source.QUEUE, 7.0)
    chunked = make(chunked=True)
    chunked.on_tick(0.0)
    chunked.on_result(chunk(2), frame_time=0.0, step_s=0.04, now=0.095)  # rows for ticks 0 (served) and 1
    assert chunked.on_tick(0.2).source is Source.FALLBACK  # row 1 was for tick 1: too old for tick 2


def test_chunk_rows_executed_in_order_survive_missed_tick_callbacks():
    loop = make(chunked=True, latency_skip=False)
    loop.on_tick(0.0)
    loop.on_result(chunk(3), frame_time=0.0, step_s=0.04, now=0.05)  # rows for ticks 1, 2, 3
    # the callbacks of ticks 1 and 2 never ran (an executor starved for two periods)
    assert [loop.on_tick(t).action[0] for t in (0.3, 0.4, 0.5)] == [0.0, 1.0, 2.0]
    assert loop.on_tick(0.6).source is Source.FALLBACK


def test_broker_missed_ticks():
    def broker():
        b = ChunkBroker()
        b.place(chunk(3), 1, first_open=1)  # ticks 1, 2, 3: rows 0, 1, 2
        return b

    assert broker().pop(3, Missed.DROP)[0] == 2.0
    b = broker()
    assert b.pop(5, Missed.NEWEST)[0] == 2.0 and len(b) == 0
    b = broker()
    assert b.pop(3, Missed.SHIFT)[0] == 0.0 and b.pop(4)[0] == 1.0 and b.pop(5)[0] == 2.0


def test_behind_schedule_a_step_starts_at_once_for_the_first_tick_without_an_action():
    loop = make(margin_ms=0.0)
    loop.timer.add(0.15)  # the plan says a step takes 1.5 periods (a loaded machine's quantile)
    loop.on_tick(0.0)
    plan = loop.plan(0.01)  # tick 1 is out of reach by the plan: try now rather than leave it empty for sure
    assert (plan.start_at, plan.tick) == (0.01, 1)
    loop.on_result(np.array([[1.0]]), frame_time=0.0, step_s=0.02, now=0.03)  # most steps are quick
    assert loop.on_tick(0.1).action[0] == 1.0


def test_a_step_that_lands_early_serves_the_tick_it_was_planned_for():
    loop = make(margin_ms=0.0)
    loop.timer.add(0.15)
    loop.on_tick(0.0)
    loop.started(loop.plan(0.0))  # behind: at once, for tick 1
    loop.on_result(np.array([[1.0]]), frame_time=0.0, step_s=0.02, now=0.02)
    plan = loop.plan(0.02)
    assert plan.tick == 2  # behind again: tick 2, at once
    loop.started(plan)
    loop.on_result(np.array([[2.0]]), frame_time=0.02, step_s=0.02, now=0.04)  # lands before tick 1 is served
    assert [loop.on_tick(t).action[0] for t in (0.1, 0.2)] == [1.0, 2.0]  # tick 1's action is not replaced


def test_a_skipped_tick_is_not_waited_for():
    loop = make()
    loop.on_tick(0.0)
    loop.skip_tick(0.1)  # the driver spent tick 1 starting an episode
    assert loop.served == 1 and loop.stats.ticks == 1 and loop.stats.fallbacks == 1  # tick 0 only
    loop.on_result(np.array([[1.0]]), frame_time=0.1, step_s=0.02, now=0.12)
    assert loop.placed_from == 2 and loop.on_tick(0.2).action[0] == 1.0


def test_rtc_guidance_hands_a_step_the_rows_queued_for_its_chunk():
    loop = make(chunked=True, refill_threshold=2, margin_ms=0.0, blend="rtc")
    loop.timer.add(0.2)  # a step takes 2 periods
    loop.served = 9
    for now in (1.0, 1.1, 1.2):
        loop.on_tick(now)
    loop.on_result(chunk(8), frame_time=0.95, step_s=0.3, now=1.25)  # rows 3..7 queued for ticks 13..17
    loop.on_tick(1.3)  # tick 13 executes row 3
    # a step starting at 1.35 on a frame of 1.32: its row 0 is tick 14; planned with the step-time quantile (the
    # 0.3 s step), it lands at 1.65, after ticks 14-16 went out
    prefix = loop.guidance(1.32, 1.35)
    assert prefix.start == 0 and prefix.frozen == 3
    assert prefix.actions[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    # a frame from before tick 13: its row 0 (tick 13) is executed already, so the prefix starts at row 1
    late = loop.guidance(1.22, 1.35)
    assert late.start == 1 and late.actions[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert make(chunked=True, blend="temporal").guidance(0.0, 0.0) is None  # only for Blend.RTC
    assert make(chunked=True, blend="rtc").guidance(0.0, 0.0) is None  # nothing queued
    assert blend([np.ones(2), np.zeros(2)], Blend.RTC, temporal_coeff=0.01, adaptive_alpha=0.1).tolist() == [0.0, 0.0]
