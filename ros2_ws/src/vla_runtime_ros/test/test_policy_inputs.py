"""The policy node's input pairing and watchdog (``vla_runtime_ros.inputs``) as functions of a clock: no
DDS, no node, every moment given explicitly."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sensor_msgs")

from sensor_msgs.msg import Image  # noqa: E402
from vla_runtime_ros.inputs import UNPAIRED_GRACE_S, InputLimits, Inputs  # noqa: E402

SKEW = 0.01


def image(stamp: float) -> Image:
    msg = Image()
    msg.header.stamp.sec, msg.header.stamp.nanosec = int(stamp), round((stamp - int(stamp)) * 1e9)
    return msg


def inputs(**limits) -> Inputs:
    cfg = dict(max_image_age_s=0.5, default_instruction="stack the blocks", use_joint_state=True, joint_state_max_skew_s=SKEW)
    return Inputs(InputLimits(**{**cfg, **limits}))


def test_the_watchdog_names_the_first_missing_input_in_order():
    box = inputs(default_instruction="")
    assert box.hold_reason(0.0) == "waiting for an instruction"
    box.set_instruction("open the drawer", 0.0)
    assert box.hold_reason(0.0) == "waiting for an image"
    box.add_frame(image(10.0), 1.0, active=True)
    assert box.hold_reason(1.0) == "waiting for joint states"
    box.reject_state("expected 7 joints, got 3")
    assert box.hold_reason(1.0) == "joint state invalid: expected 7 joints, got 3"
    box.add_state(np.zeros(7), 10.0)
    assert box.hold_reason(1.0) == ""


def test_an_image_too_old_holds_actions_and_counts_as_stale_once():
    box = inputs()
    box.add_state(np.zeros(7), 10.0)
    box.add_frame(image(10.0), 1.0, active=True)
    assert box.usable_frame(1.4) is not None
    assert "newest image is 0.60 s old (max_image_age_s 0.5)" == box.hold_reason(1.6)
    assert box.hold_reason(1.7) and box.frames_stale == 1  # the same frame is not counted twice
    assert box.usable_frame(1.7) is None and not box.pending()


def test_an_instruction_expires_only_when_asked_to():
    box = inputs(use_joint_state=False, max_instruction_age_s=2.0)
    box.set_instruction("open the drawer", 0.0)
    box.add_frame(image(0.0), 2.5, active=True)
    assert box.hold_reason(2.5) == "instruction is 2.50 s old (max_instruction_age_s 2.0)"
    assert inputs(use_joint_state=False, max_instruction_age_s=0.0).current_instruction() == "stack the blocks"


def test_a_frame_waits_for_the_joint_state_of_its_moment():
    box = inputs()
    box.add_state(np.full(7, 1.0), 10.0)
    box.add_frame(image(10.1), 5.0, active=True)  # taken 0.1 s after the newest state
    assert box.usable_frame(5.0) is None  # waits: the state of its moment may still come
    assert box.hold_reason(5.0) == ""  # not an error yet, within the grace period
    reason = box.hold_reason(5.0 + UNPAIRED_GRACE_S + 0.01)
    assert reason == f"newest joint state is 0.100 s older than the image (joint_state_max_skew_s {SKEW})"
    box.add_state(np.full(7, 2.0), 10.1)
    frame = box.usable_frame(5.05)
    assert frame is not None and frame.stamp == pytest.approx(10.1)
    found, state = box.state_at(frame)
    assert found and state[0] == 2.0


def test_the_state_nearest_the_frame_is_chosen_and_a_lost_one_skips_the_frame():
    box = inputs()
    for stamp, value in [(10.00, 1.0), (10.05, 2.0), (10.10, 3.0)]:
        box.add_state(np.full(7, value), stamp)
    found, state = box.state_at(_frame(box, 10.052))
    assert found and state[0] == 2.0  # nearest, though an older one than the newest
    found, _ = box.state_at(_frame(box, 10.03))  # 20 ms from any state: the state of its moment was lost
    assert not found


def _frame(box: Inputs, stamp: float):
    box.add_frame(image(stamp), 0.0, active=True)
    return box.frame


def test_unstamped_messages_get_the_newest_state_and_are_never_held_for_pairing():
    box = inputs()
    box.add_state(np.full(7, 4.0), 0.0)
    box.add_frame(image(0.0), 1.0, active=True)
    frame = box.usable_frame(1.0)
    assert frame is not None and box.state_at(frame)[1][0] == 4.0
    paired_off = inputs(joint_state_max_skew_s=-1.0)  # negative: the newest state, no pairing
    paired_off.add_state(np.full(7, 5.0), 10.0)
    paired_off.add_frame(image(99.0), 1.0, active=True)
    assert paired_off.usable_frame(1.0) is not None


def test_each_frame_is_used_once_and_an_unused_one_replaced_counts_as_dropped():
    box = inputs(use_joint_state=False)
    assert box.add_frame(image(1.0), 0.0, active=True) is False
    assert box.add_frame(image(2.0), 0.1, active=True) is True  # the first was never used
    assert box.add_frame(image(3.0), 0.2, active=False) is False  # an inactive node drops nothing
    frame = box.usable_frame(0.2)
    box.skip_frames_until(frame.seq)
    assert box.usable_frame(0.2) is None and not box.pending()
    assert box.add_frame(image(4.0), 0.3, active=True) is False  # the previous one was used
    assert box.usable_frame(0.3).stamp == pytest.approx(4.0)


def control_over(box: Inputs):
    """``PolicyControl``'s frame wait over ``box``, without a node (its lock and condition only)."""
    from vla_runtime_ros.policy_control import PolicyControl

    control = object.__new__(PolicyControl)
    control._lock = threading.Lock()
    control._frame_arrived = threading.Condition(control._lock)
    control._inputs = box
    return control


def test_a_step_whose_next_frame_is_due_waits_for_it_and_one_that_is_not_does_not(monkeypatch):
    box, period = inputs(use_joint_state=False), 1 / 30
    start = time.monotonic()
    for i in range(6):  # the camera's clock: the last frame arrived a period ago, the next is due now
        box.add_frame(image(float(i)), start - (6 - i) * period, active=True)
    control, waited, holding = control_over(box), [], threading.Event()

    def step(cancel=threading.Event()):
        with control._lock:
            holding.set()
            waited.append(control._await_next_frame(cancel, 60.0))  # a limit no machine reaches: the frame ends it

    worker = threading.Thread(target=step)
    worker.start()
    holding.wait()
    with control._lock:  # only free once the worker waits (the wait releases it)
        arrived = time.monotonic()
        box.add_frame(image(6.0), arrived, active=True)
        control._frame_arrived.notify_all()
    worker.join(timeout=120)
    assert not worker.is_alive() and waited == [True]
    assert box.usable_frame(time.monotonic()).seq == 7  # the frame it waited for is the one it takes
    from vla_runtime_ros import policy_control

    # half a period after that frame (the step's clock, fixed), the next one is half a period off
    monkeypatch.setattr(policy_control, "time", SimpleNamespace(monotonic=lambda: arrived + period / 2))
    waits = []
    control._frame_arrived.wait_for = lambda *args, **kwargs: waits.append(kwargs) or False  # records a wait
    with control._lock:  # not due within 5 ms: no wait at all
        assert control._await_next_frame(threading.Event(), 0.005) is False
    assert waits == []
    with control._lock:  # due within a period: it waits for it, at most that long
        assert control._await_next_frame(threading.Event(), period) is False
    assert waits == [{"timeout": period}]
    assert box.clock.period() == pytest.approx(period, rel=0.2)
