"""``timing.FrameClock``: the camera's period from frame receipts, and when a step should wait for the next frame
(``ControlConfig.frame_wait_ms``); on a fake clock."""

import pytest
from vla_runtime.control import ControlConfig
from vla_runtime.control.timing import FrameClock

CAMERA = 1 / 30


def clock_with(receipts) -> FrameClock:
    clock = FrameClock()
    for t in receipts:
        clock.add(t)
    return clock


def test_the_period_is_the_median_interval_once_four_are_known():
    assert clock_with([0.0, 0.033, 0.066, 0.1]).period() is None  # three intervals
    jittered = [0.0, 0.034, 0.066, 0.101, 0.133, 0.166, 0.2]
    assert clock_with(jittered).period() == pytest.approx(0.0335, abs=1e-4)
    assert clock_with([0.0, 0.033, 0.033, 0.066, 0.1, 0.133]).period() == pytest.approx(0.033, abs=1e-9)  # a repeat adds nothing


def test_a_step_waits_only_for_a_frame_due_within_the_limit_either_way():
    clock = clock_with([i * CAMERA for i in range(10)])  # the last arrived at 0.3, the next is due at 0.3333
    assert clock.wait_for_next(0.330, limit_s=0.005) == 0.005  # due in 3.3 ms: wait (at most 5 ms)
    assert clock.wait_for_next(0.337, limit_s=0.005) == 0.005  # 3.7 ms late: still coming
    assert clock.wait_for_next(0.310, limit_s=0.005) == 0.0  # due in 23 ms: take the newest now
    assert clock.wait_for_next(0.345, limit_s=0.005) == 0.0  # 12 ms late: the camera may have stopped
    assert clock.wait_for_next(0.330, limit_s=0.0) == 0.0  # off
    assert FrameClock().wait_for_next(0.0, limit_s=0.005) == 0.0  # no estimate yet


def test_frame_wait_is_off_by_default_and_must_not_be_negative():
    assert ControlConfig().frame_wait_ms == 0.0
    with pytest.raises(ValueError, match=r"`frame_wait_ms` must be a finite number >= 0, got -1\.0"):
        ControlConfig(frame_wait_ms=-1.0)
