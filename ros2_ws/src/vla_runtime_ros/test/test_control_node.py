"""The policy node's control loop (``vla_runtime.control``) over real rclpy: deadline scheduling on the
newest frame, async refill of a slow chunk policy, each fallback, instructions from volatile,
transient-local and incompatible publishers.

Cameras stream from harness timers; counts come from the node's /diagnostics; bounds derive from the
step time the node measures, never from fixed small numbers.
"""

import math
import time

import numpy as np
import pytest

pytest.importorskip("rclpy")

from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from ros_harness import Diagnostics, resend_until, wait_for  # noqa: E402
from ros_messages import solid_image  # noqa: E402
from ros_nodes import NodeProcess  # noqa: E402
from ros_test_policy import PREFIX_MARK, RosTestPolicyConfig, expected_actions, write_checkpoint  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Float32MultiArray, String  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402
from vla_runtime_ros.instructions import LATCHED_QOS, LIVE_QOS  # noqa: E402

pytestmark = pytest.mark.ros

DIAG_HZ = 10.0
RELIABLE_CAMERA = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE)  # with image_reliability: reliable


def start(harness, tmp, ns, checkpoint, **params):
    params = dict(checkpoint=str(checkpoint), policy_modules=["ros_test_policy"], diagnostics_rate_hz=DIAG_HZ,
                  max_image_age_s=60.0, default_instruction="stack the blocks", **params)
    proc = NodeProcess("policy_node", params, tmp, name="vla_policy", namespace=ns)
    diag = Diagnostics(harness, f"{ns}/vla_policy")
    proc.wait_active(diag)
    diag.wait(lambda s, v: v.get("action_subscribers") == "1" and v["episode"] == "1", what=f"{ns} ready\n{proc.output()}")
    return proc, diag


def action_values(collector, start=0):
    return [conversions.msg_to_actions(m) for m in collector.since(start)]


def first_action(image):
    """What the single-action test policy does with ``image``: [7]."""
    return expected_actions(image, None, RosTestPolicyConfig())[0]


def idle(diag, what):
    """The next status after which the node has nothing left to do: no frame waits, no step runs, no action queued."""
    return diag.wait(lambda s, v: v["frames_pending"] == "0" and v["stepping"] == "False" and v["queue_len"] == "0",
                     after=len(diag.statuses), what=what)[1]


@pytest.fixture()
def node_factory(harness, tmp_path):
    made = []

    def make(ns, checkpoint, **params):
        actions = harness.subscribe(Float32MultiArray, f"{ns}/vla_policy/action")
        proc, diag = start(harness, tmp_path, ns, checkpoint, **params)
        made.append(proc)
        return proc, diag, actions

    yield make
    for proc in made:
        proc.close()


def test_slow_chunk_policy_publishes_on_every_tick_with_async_refill(harness, node_factory, tmp_path):
    rate, chunk = 10.0, 10
    step_ms = 3 * 1e3 / rate  # a step takes three control periods
    ckpt = write_checkpoint(tmp_path / "slow-chunk", chunk_size=chunk, step_ms=step_ms)
    proc, diag, actions = node_factory("/refill", ckpt, control_rate_hz=rate, refill_threshold=1, fallback="hold")
    image = solid_image(5)
    camera = harness.stream(Image, "/refill/image_raw", qos_profile_sensor_data, 30.0, conversions.array_to_image_msg(image))
    try:
        # the first chunk lands after ticks it could not serve; from then on every tick has an action
        _, first = diag.wait(lambda s, v: int(v["steps"]) >= 2, what="two chunks")
        mark = len(diag.statuses)
        _, last = diag.wait(lambda s, v: int(v["steps"]) >= int(first["steps"]) + 4, after=mark, what="four more chunks")
        # 3 rows skipped, 1 overlapping the next chunk: each chunk serves chunk - 4 ticks of its own (ticks on the
        # grid: those served and those a stalled process never ran, ``ticks_missed``)
        grid_ticks = lambda v: int(v["ticks"]) + int(v["ticks_missed"])  # noqa: E731
        assert grid_ticks(last) - grid_ticks(first) >= 4 * (chunk - 4) - 2, last
        # each fallback is a tick a step overran its plan by (the schedule plans for its step-time quantile; a
        # loaded machine stalls a step past a period or more, and every tick it overran may go empty)
        overrun = int(last["ticks_overrun"]) - int(first["ticks_overrun"])
        assert int(last["fallbacks"]) - int(first["fallbacks"]) <= overrun, last
        assert int(last["actions_skipped"]) >= 3 * int(last["steps"]) - 3, last  # rows for ticks past when it landed
        want = expected_actions(image, None, RosTestPolicyConfig(chunk_size=chunk))  # [chunk, 7]: row k = base + 0.01 k
        rows = {int(round((a[0] - want[0, 0]) / 0.01)) for a in action_values(actions)}
        assert rows and min(rows) >= 2 and max(rows) <= chunk - 1, rows  # never a row for a tick already past
    finally:
        camera.close(harness)


def test_rtc_hands_the_queued_actions_to_the_chunk_policys_next_steps(harness, node_factory, tmp_path):
    rate, chunk = 10.0, 10
    ckpt = write_checkpoint(tmp_path / "rtc-chunk", chunk_size=chunk, step_ms=2 * 1e3 / rate)
    proc, diag, actions = node_factory("/rtc", ckpt, control_rate_hz=rate, refill_threshold=2, blend="rtc")
    camera = harness.stream(Image, "/rtc/image_raw", qos_profile_sensor_data, 30.0, conversions.array_to_image_msg(solid_image(5)))
    try:
        _, status = diag.wait(lambda s, v: int(v["steps"]) >= 6, what="six chunks")
        last = [a[-1] for a in action_values(actions)]
        base = expected_actions(solid_image(5), None, RosTestPolicyConfig(chunk_size=chunk))[0, -1]
        # the first chunk had nothing queued before it; later steps were handed the queue (the mark), and
        # their rows replaced the first chunk's on the ticks after they landed
        marked = [v > base + PREFIX_MARK / 2 for v in last]  # rows are base + 0.01 k (+ the mark)
        assert not marked[0] and any(marked), last
    finally:
        camera.close(harness)


def test_an_openvla_oft_checkpoint_drives_the_node_with_its_chunks(harness, node_factory, tmp_path):
    """The node loads any family through load_policy: a tiny OFT (LIBERO sizes, 7-D, no proprio) publishes its
    chunks, rows in tick order, at the control rate."""
    import torch
    from vla_runtime.api import Observation, load_policy
    from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft

    ckpt = make_tiny_openvla_oft(tmp_path / "oft", proprio=False, dtype=torch.float32)
    image = solid_image(7, shape=(56, 56))
    chunk = load_policy(ckpt, device="cpu").new_session("stack the blocks").step(Observation(images={"primary": image})).actions
    proc, diag, actions = node_factory("/oft", ckpt, control_rate_hz=10.0, device="cpu", torch_threads=1, latency_skip=False)
    camera = harness.stream(Image, "/oft/image_raw", qos_profile_sensor_data, 30.0, conversions.array_to_image_msg(image))
    try:
        diag.wait(lambda s, v: int(v["steps"]) >= 2, what="two OFT chunks")
        got = np.array(action_values(actions))  # [n, 7]
        assert got.shape[1] == 7 and chunk.shape == (8, 7)
        rows = [int(np.argmin(np.abs(chunk - a).max(axis=1))) for a in got]  # which row of the chunk each action is
        assert np.allclose(got, chunk[rows], atol=1e-5) and rows[:3] == [0, 1, 2], rows
    finally:
        camera.close(harness)


@pytest.mark.parametrize("fallback, keep", [("hold", []), ("zero", [6]), ("repeat_last", [])])
def test_each_fallback_when_no_fresh_action_is_due(harness, node_factory, policy_checkpoints, fallback, keep):
    ns = f"/fb_{fallback}"
    params = dict(control_rate_hz=20.0, fallback=fallback)
    if keep:
        params["fallback_keep_dims"] = keep
    proc, diag, actions = node_factory(ns, policy_checkpoints["single"], image_reliability="reliable", **params)
    image = solid_image(9)
    want = first_action(image)
    pub = harness.publisher(Image, f"{ns}/image_raw", RELIABLE_CAMERA)
    # one frame (reliable: it arrives once): one fresh action; each frame is acted on once, so later ticks fall back
    pub.publish(conversions.array_to_image_msg(image))
    actions.wait(1, what="the fresh action")
    _, before = diag.wait(lambda s, v: v["steps"] == "1", what="the step counted")
    _, after = diag.wait(lambda s, v: int(v["fallbacks"]) >= int(before["fallbacks"]) + 5, what="five fallback ticks")
    assert after["fallback"] == fallback and after["steps"] == "1", after
    got = action_values(actions)
    np.testing.assert_allclose(got[0], want, atol=1e-6)
    if fallback == "hold":
        idle(diag, "the node idle")
        assert len(actions) == 1, "hold publishes nothing"
    else:
        wait_for(lambda: len(actions) >= 1 + 5, what="fallback actions")
        expected = want.copy() if fallback == "repeat_last" else np.where(np.arange(7) == 6, want, 0.0)
        for action in action_values(actions, 1):
            np.testing.assert_allclose(action, expected, atol=1e-6)


@pytest.mark.parametrize("qos", ["volatile", "transient_local"])
def test_instructions_from_volatile_and_transient_local_publishers_arrive(harness, node_factory, policy_checkpoints, qos):
    ns = f"/instr_{qos}"
    proc, diag, _ = node_factory(ns, policy_checkpoints["single"], control_rate_hz=5.0)
    profile = LIVE_QOS if qos == "volatile" else LATCHED_QOS
    pub = harness.publisher(String, f"{ns}/instruction", profile)
    # volatile: what `ros2 topic pub` does without flags; re-sent until the node's episode changed
    resend_until(lambda: pub.publish(String(data=f"open the drawer ({qos})")),
                 lambda: diag.find(lambda s, v: v["episode"] == "2", after=0), "the new episode")
    assert f"instruction: 'open the drawer ({qos})'" in wait_for(
        lambda: proc.output() if "open the drawer" in proc.output() else "", what="the log line")


def test_an_incompatible_instruction_publisher_is_reported(harness, node_factory, policy_checkpoints):
    ns = "/instr_bad"
    proc, diag, _ = node_factory(ns, policy_checkpoints["single"], control_rate_hz=5.0)
    harness.node.create_publisher(String, f"{ns}/instruction", QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT))
    status, values = diag.wait(lambda s, v: "instruction publisher's QoS is incompatible" in v["last_error"], what="the report")
    assert int(values["setup_errors"]) >= 1 and "RELIABILITY" in values["last_error"]
    assert "instruction publisher's QoS is incompatible" in proc.output()


@pytest.mark.parametrize("schedule", ["deadline", "asap"])
def test_the_frame_published_just_before_a_tick_is_the_one_acted_on(harness, node_factory, policy_checkpoints, schedule):
    """Each round: frame A just after a tick, frame B halfway to the step's deadline start. Deadline scheduling
    starts the step ``step_plan_ms`` before the next tick on the newest frame: B, and A is never acted on. The old
    loop (asap) stepped on A at once and published it at that tick (B a tick later). The ticks keep their phase
    (``align_to_frames`` off), which the test reads off the actions it received."""
    rate = 1.0
    period = 1.0 / rate
    ns = f"/newest_{schedule}"
    proc, diag, actions = node_factory(ns, policy_checkpoints["single"], control_rate_hz=rate, schedule=schedule,
                                       image_reliability="reliable", align_to_frames=False)
    pub = harness.publisher(Image, f"{ns}/image_raw", RELIABLE_CAMERA)
    pub.publish(conversions.array_to_image_msg(solid_image(60)))
    actions.wait(1, what="a first action")

    def after_next_tick(fraction):
        """Sleep until ``fraction`` of a period after the next tick (the node's ticks: ``reference + n * period``,
        each action published at one; its receipt here is later by the delivery, so the least late receipt so far
        is the best estimate of the phase)."""
        first = actions.items[0].t
        reference = first + min((r.t - first + period / 2) % period - period / 2 for r in actions.items)
        now = time.monotonic()
        time.sleep(reference + (math.floor((now - reference) / period) + 1 + fraction) * period - now)

    for round_ in range(3 if schedule == "deadline" else 1):
        values = idle(diag, "the node idle")
        lead = float(values["step_plan_ms"]) / 1e3  # the schedule's planned step time (quantile + margin)
        assert lead < 0.4 * period, f"a step planned at {lead * 1e3:.0f} ms leaves no room between A and B: {values}"
        start = len(actions)
        a, b = solid_image(61 + 2 * round_), solid_image(62 + 2 * round_)
        after_next_tick(0.05)
        pub.publish(conversions.array_to_image_msg(a))
        time.sleep(max(0.0, (0.95 - lead) * period / 2))  # halfway to the deadline start (period - lead)
        pub.publish(conversions.array_to_image_msg(b))
        want = [b] if schedule == "deadline" else [a, b]
        actions.wait(start + len(want), what=f"round {round_}'s actions")
        idle(diag, "the node done with A and B")
        got = action_values(actions, start)
        assert len(got) == len(want), f"{len(got)} actions for {len(want)}"
        for action, image in zip(got, want):
            np.testing.assert_allclose(action, first_action(image), atol=1e-6)
    if schedule == "deadline":
        _, values = diag.wait(lambda s, v: True, after=len(diag.statuses), what="a status")
        assert int(values["frames_dropped"]) >= 3, values  # every A was replaced before a step could take it


def test_frames_later_than_the_wait_are_waited_for_and_the_ticks_move_to_them(harness, node_factory, tmp_path):
    """Frames arrive after the steps' planned starts, past ``frame_wait_ms`` (5 ms) but before their ticks: each step
    waits for its frame (``steps_without_frame``), lands late, and counts the frame's age as negative; the phase
    alignment then moves the ticks that much later and the steps land on time. (A step that gave up instead would
    start again on the frame's arrival, see an age of 0 and leave every tick late.) A punctual plan, so that few
    steps land late once aligned."""
    rate = 10.0
    period = 1.0 / rate
    ckpt = write_checkpoint(tmp_path / "quick", step_ms=10.0)
    ns = "/late_camera"
    proc, diag, actions = node_factory(ns, ckpt, control_rate_hz=rate, image_reliability="reliable", step_quantile=0.95,
                                       schedule_margin_ms=3.0, frame_wait_ms=5.0)
    pub = harness.publisher(Image, f"{ns}/image_raw", RELIABLE_CAMERA)
    msg = conversions.array_to_image_msg(solid_image(80))
    for _ in range(10):  # step times settle, the node learns the camera's period and the ticks their phase
        pub.publish(msg)
        time.sleep(period)
    values = idle(diag, "the node idle after the warm-up")
    lead = float(values["step_plan_ms"]) / 1e3
    assert lead > 0.009, f"a step planned at {lead * 1e3:.1f} ms leaves no room between the wait and the tick: {values}"
    late = (0.005 + lead) / 2  # past the 5-ms wait, before the tick
    ticks = np.array([r.t for r in actions.items[-5:]])  # published at the node's ticks (a punctual plan is on time)
    phase = float(np.median(ticks % period))

    def publish_late(frames):
        """One frame per tick, ``late`` after the planned start of the step for the next tick (the old phase)."""
        for _ in range(frames):
            now = time.monotonic()
            due = (math.floor((now - phase) / period) + 1) * period + phase - lead + late
            due += period if due < now + 0.005 else 0.0
            time.sleep(due - time.monotonic())
            pub.publish(msg)

    publish_late(25)  # the first 20 decide the move
    _, moved = diag.wait(lambda s, v: True, after=len(diag.statuses), what="a status")
    waited = int(moved["steps_without_frame"]) - int(values["steps_without_frame"])
    assert waited >= 1 and int(moved["phase_shifts"]) > int(values["phase_shifts"]), moved  # frames within the wait: no count
    # that the moved ticks then land on time is the loop's (``tests/control/test_frame_alignment.py``, on a fake
    # clock); how often, on this machine, is ``benchmarks/bench_ros.py``'s


# the defaults plan a step at its median turnaround and wait for the camera's next frame (low latency: about half
# the steps land a little after their tick and are served late); "punctual" plans at the 95 % quantile
PLANS = {"defaults": {}, "punctual": {"step_quantile": 0.95, "schedule_margin_ms": 3.0, "frame_wait_ms": 0.0,
                                      "frame_guard_ms": 5.0, "align_quantile": 0.1}}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_no_empty_ticks_when_the_step_is_far_under_the_period(harness, node_factory, tmp_path, plan):
    rate = 10.0
    period = 1.0 / rate
    ckpt = write_checkpoint(tmp_path / "quick", step_ms=0.1 * 1e3 * period)  # a step takes a tenth of a period
    ns = f"/steady_{plan}"  # a namespace per case (sharing one, the second node was not seen ready within 30 s)
    proc, diag, actions = node_factory(ns, ckpt, control_rate_hz=rate, fallback="hold", **PLANS[plan])
    camera = harness.stream(Image, f"{ns}/image_raw", qos_profile_sensor_data, 30.0,
                            conversions.array_to_image_msg(solid_image(70)))
    try:
        _, first = diag.wait(lambda s, v: int(v["steps"]) >= 10, what="ten steps (step times measured)")
        start, t0, mark = len(actions), time.monotonic(), len(diag.statuses)
        # statuses from before the first tick have no loop counters: only later ones are read
        _, last = diag.wait(lambda s, v: int(v["ticks"]) >= int(first["ticks"]) + 5 * rate, after=mark,
                            what="five seconds of ticks")
        t1 = time.monotonic()
    finally:
        camera.close(harness)
    ticks = int(last["ticks"]) - int(first["ticks"])
    empty = int(last["fallbacks"]) - int(first["fallbacks"])
    late = int(last["steps_late"]) - int(first["steps_late"])
    overrun = int(last["ticks_overrun"]) - int(first["ticks_overrun"])
    served_late = int(last["ticks_late"]) - int(first["ticks_late"])  # overrun by less than late_grace_ms: waited for
    # the harness's camera is a timer in this process: on a loaded machine it can miss a period, and each frame is
    # acted on once; a tick that came more than half a period after the last frame may have nothing new to act on
    sent = [t for t in camera.times if t0 - period <= t <= t1]
    starved = sum(math.ceil((b - a) / period) for a, b in zip(sent, sent[1:]) if b - a > period / 2)
    # otherwise a tick is empty only when a step overran its plan into it (a step far above the quantile the
    # schedule plans with: a loaded machine, where one stall can overrun several ticks); on an idle machine none
    detail = (f"{empty} empty, {late} late steps overrunning {overrun} ticks ({served_late} of them served late), "
              f"{starved} camera gaps in {ticks} ticks: {last}")
    assert empty + served_late <= overrun + starved, detail  # (how few steps land late: benchmarks/bench_ros.py)
    published = len(actions) - start
    assert published >= ticks - empty - 2, f"{published} actions; {detail}"
