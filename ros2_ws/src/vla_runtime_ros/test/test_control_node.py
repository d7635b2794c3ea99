"""The policy node's control loop (``vla_runtime.control``) over real rclpy: deadline scheduling on the
newest frame, async refill of a slow chunk policy, each fallback, instructions from volatile,
transient-local and incompatible publishers.

Cameras stream from harness timers; counts come from the node's /diagnostics; bounds derive from the
step time the node measures, never from fixed small numbers.
"""

import numpy as np
import pytest

pytest.importorskip("rclpy")

from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from ros_harness import Diagnostics, NodeProcess, resend_until, solid_image, wait_for  # noqa: E402
from ros_test_policy import RosTestPolicyConfig, expected_actions, write_checkpoint  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Float32MultiArray, String  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402
from vla_runtime_ros.instructions import LATCHED_QOS, LIVE_QOS  # noqa: E402

pytestmark = pytest.mark.ros

DIAG_HZ = 10.0


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
        # 3 rows skipped, 1 overlapping the next chunk: each chunk serves chunk - 4 ticks of its own
        assert int(last["ticks"]) - int(first["ticks"]) >= 4 * (chunk - 4) - 2, last
        # each fallback is a step that overran its plan (the schedule plans for its step-time quantile)
        assert int(last["fallbacks"]) - int(first["fallbacks"]) <= int(last["steps_late"]) - int(first["steps_late"]), last
        assert int(last["actions_skipped"]) >= 3 * int(last["steps"]) - 3, last  # rows for ticks past when it landed
        want = expected_actions(image, None, RosTestPolicyConfig(chunk_size=chunk))  # [chunk, 7]: row k = base + 0.01 k
        rows = {int(round((a[0] - want[0, 0]) / 0.01)) for a in action_values(actions)}
        assert rows and min(rows) >= 2 and max(rows) <= chunk - 1, rows  # never a row for a tick already past
    finally:
        camera.close(harness)


@pytest.mark.parametrize("fallback, keep", [("hold", []), ("zero", [6]), ("repeat_last", [])])
def test_each_fallback_when_no_fresh_action_is_due(harness, node_factory, policy_checkpoints, fallback, keep):
    ns = f"/fb_{fallback}"
    params = dict(control_rate_hz=20.0, fallback=fallback)
    if keep:
        params["fallback_keep_dims"] = keep
    proc, diag, actions = node_factory(ns, policy_checkpoints["single"], **params)
    image = solid_image(9)
    want = expected_actions(image, None, RosTestPolicyConfig())[0]
    pub = harness.publisher(Image, f"{ns}/image_raw", qos_profile_sensor_data)
    # one frame (re-sent until acted on): one fresh action; each frame is acted on once, so later ticks fall back
    resend_until(lambda: pub.publish(conversions.array_to_image_msg(image)), lambda: len(actions) > 0, "the fresh action")
    _, before = diag.wait(lambda s, v: True, after=len(diag.statuses), what="a status")
    _, after = diag.wait(lambda s, v: int(v["fallbacks"]) >= int(before["fallbacks"]) + 5, what="five fallback ticks")
    assert after["fallback"] == fallback and int(after["steps"]) == int(before["steps"])
    got = action_values(actions)
    np.testing.assert_allclose(got[0], want, atol=1e-6)
    if fallback == "hold":
        assert len(got) == int(after["steps"]), "hold publishes nothing"
    else:
        wait_for(lambda: len(actions) >= 1 + 5, what="fallback actions")
        expected = want.copy() if fallback == "repeat_last" else np.where(np.arange(7) == 6, want, 0.0)
        for action in action_values(actions, int(after["steps"])):
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
