"""Lifecycle transitions driven over the lifecycle services, a chunk-predicting policy on compressed
frames, the staleness watchdog, and a configure that fails on a bad checkpoint.

Each frame here must be acted on exactly once, so the camera is reliable (``image_reliability:
reliable``): a frame sent once arrives once, after the publisher matched the node's subscription."""

import numpy as np
import pytest

pytest.importorskip("rclpy")

from lifecycle_msgs.msg import State, Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue  # noqa: E402
from rcl_interfaces.srv import SetParameters  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from ros_harness import Diagnostics  # noqa: E402
from ros_messages import solid_image  # noqa: E402
from ros_nodes import NodeProcess  # noqa: E402
from ros_test_policy import RosTestPolicyConfig, expected_actions  # noqa: E402
from sensor_msgs.msg import CompressedImage  # noqa: E402
from std_msgs.msg import Float32MultiArray  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402

pytestmark = pytest.mark.ros

NS = "/lc"
NODE = f"{NS}/vla_policy"
CHUNK = RosTestPolicyConfig(chunk_size=4)
HORIZON = 3  # actions executed from each 4-action chunk
RELIABLE_CAMERA = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE)


class Lifecycle:
    def __init__(self, harness):
        self.harness = harness
        # a new client's first request may go unanswered on a loaded machine (see Harness.call): a label that no
        # transition has is a request without effect, re-sent until answered; the transitions then go out once
        warm_up = ChangeState.Request(transition=Transition(label="no such transition"))
        assert not harness.call(ChangeState, f"{NODE}/change_state", warm_up, idempotent=True).success

    def state(self) -> int:
        return self.harness.call(GetState, f"{NODE}/get_state", GetState.Request(), idempotent=True).current_state.id

    def change(self, transition: int) -> bool:
        request = ChangeState.Request(transition=Transition(id=transition))
        return self.harness.call(ChangeState, f"{NODE}/change_state", request).success


@pytest.fixture(scope="module")
def node(harness, tmp_path_factory, policy_checkpoints):
    params = dict(
        checkpoint=str(policy_checkpoints["chunk"]), policy_modules=["ros_test_policy"], autostart=False,
        execution_horizon=HORIZON, image_transport="compressed", image_reliability="reliable",
        control_rate_hz=20.0, diagnostics_rate_hz=10.0,
        # counted below: every executed action of one chunk; latency skipping (a tick that passes during the step
        # drops that tick's row) is tested in test_control_node.py
        latency_skip=False,
        # a frame goes stale only on a machine far slower than any step here (the watchdog part below sets 0.15 s)
        max_image_age_s=60.0,
        default_instruction="stack the blocks",
    )
    proc = NodeProcess("policy_node", params, tmp_path_factory.mktemp("lifecycle"), name="vla_policy", namespace=NS)
    yield proc
    proc.close()


def _param(name, value):
    kind = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
            float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING}[type(value)]
    field = {bool: "bool_value", int: "integer_value", float: "double_value", str: "string_value"}[type(value)]
    return Parameter(name=name, value=ParameterValue(type=kind, **{field: value}))


def test_transitions_gate_the_control_loop(harness, node, policy_checkpoints):
    lifecycle = Lifecycle(harness)
    diag = Diagnostics(harness, NODE)
    actions = harness.subscribe(Float32MultiArray, f"{NODE}/action")
    chunks = harness.subscribe(Float32MultiArray, f"{NODE}/action_chunk")
    image = solid_image(3)
    frame = conversions.array_to_compressed_msg(image, fmt="png")

    assert lifecycle.state() == State.PRIMARY_STATE_UNCONFIGURED, node.output()
    assert lifecycle.change(Transition.TRANSITION_CONFIGURE), node.output()
    assert lifecycle.state() == State.PRIMARY_STATE_INACTIVE
    frames = harness.publisher(CompressedImage, f"{NS}/image_raw/compressed", RELIABLE_CAMERA)
    # the node's outputs (created by configure) matched to the harness: nothing it publishes is lost
    diag.wait(lambda s, v: v.get("action_subscribers") == "1" and v.get("chunk_subscribers") == "1", what="outputs matched")

    # inactive: frames arrive, nothing is computed or published
    frames.publish(frame)
    diag.wait(lambda s, v: v["state"] == "inactive" and v["frames_received"] == "1", what="the frame, inactive")
    diag.wait(lambda s, v: True, after=len(diag.statuses) + 2, what="more status messages")
    assert len(actions) == 0 and len(chunks) == 0

    # active: one frame -> one 4-action chunk, of which the first 3 go out one per control tick
    assert lifecycle.change(Transition.TRANSITION_ACTIVATE)
    assert lifecycle.state() == State.PRIMARY_STATE_ACTIVE
    diag.wait(lambda s, v: v["state"] == "active" and v["episode"] == "1", what="episode 1")
    frames.publish(frame)
    want = expected_actions(image, None, CHUNK).astype(np.float32)  # [4, 7]
    chunk = chunks.wait(1, 10, "chunks")[0]
    assert [(d.label, d.size) for d in chunk.layout.dim] == [("horizon", 4), ("action", 7)]
    np.testing.assert_allclose(conversions.msg_to_actions(chunk), want, atol=1e-6)
    executed = [conversions.msg_to_actions(m) for m in actions.wait(HORIZON, 10, "actions")]
    np.testing.assert_allclose(np.stack(executed), want[:HORIZON], atol=1e-6)
    diag.wait(lambda s, v: v["queue_len"] == "0", after=len(diag.statuses) + 2, what="an empty queue")
    assert len(actions) == HORIZON  # the 4th action of the chunk is not executed; no new frame, no new step

    # inactive again: nothing more
    assert lifecycle.change(Transition.TRANSITION_DEACTIVATE)
    frames.publish(conversions.array_to_compressed_msg(solid_image(4), fmt="png"))
    diag.wait(lambda s, v: v["state"] == "inactive", after=len(diag.statuses), what="inactive")
    diag.wait(lambda s, v: True, after=len(diag.statuses) + 2, what="more status messages")
    assert len(actions) == HORIZON

    # cleanup releases the policy; configure-time parameters may change now
    assert lifecycle.change(Transition.TRANSITION_CLEANUP)
    assert lifecycle.state() == State.PRIMARY_STATE_UNCONFIGURED
    request = SetParameters.Request(parameters=[
        _param("checkpoint", str(policy_checkpoints["slow"])),  # 300 ms per step
        _param("max_image_age_s", 0.15),
        _param("execution_horizon", 0),
    ])
    assert all(r.successful for r in harness.call(SetParameters, f"{NODE}/set_parameters", request, idempotent=True).results)

    # the watchdog: a step slower than max_image_age_s finishes with a stale frame -> withheld, WARN
    assert lifecycle.change(Transition.TRANSITION_CONFIGURE), node.output()
    assert lifecycle.change(Transition.TRANSITION_ACTIVATE)
    diag.wait(lambda s, v: v["state"] == "active" and v["episode"] == "1", after=len(diag.statuses), what="reconfigured")
    frames.publish(conversions.array_to_compressed_msg(solid_image(5), fmt="png"))
    status, values = diag.wait(lambda s, v: v["actions_withheld"] == "1", what="a withheld action")
    assert "old (max_image_age_s 0.15)" in status.message
    assert len(actions) == HORIZON

    assert lifecycle.change(Transition.TRANSITION_ACTIVE_SHUTDOWN)
    assert lifecycle.state() == State.PRIMARY_STATE_FINALIZED
    code, _ = node.interrupt()
    assert code == 0, node.output()


def test_configure_fails_cleanly_on_a_bad_checkpoint(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    proc = NodeProcess("policy_node", {"checkpoint": str(missing)}, tmp_path, name="vla_policy", namespace="/bad")
    try:
        assert proc.wait_exit(timeout=60) == 1
        out = proc.output()
        # the reason is on the process's last FATAL line, which launch_support repeats when it stops the launch
        fatal = [line for line in out.splitlines() if "[FATAL]" in line]
        assert fatal and fatal[-1].endswith(f"could not start: configure failed: checkpoint directory {missing} does not exist"), out
        assert "Traceback" not in out
    finally:
        proc.close()

