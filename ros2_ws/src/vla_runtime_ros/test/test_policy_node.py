"""The policy node over real rclpy + Fast DDS, in a subprocess started the way a user starts it:
``python -m vla_runtime_ros.policy_node --ros-args --params-file ...``.

One node serves the whole module (starting one costs a few seconds); tests run in file order and
the last one stops it with SIGINT.
"""

import math

import numpy as np
import pytest

pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from geometry_msgs.msg import TwistStamped  # noqa: E402
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue  # noqa: E402
from rcl_interfaces.srv import SetParameters  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from ros_harness import Diagnostics, NodeProcess, camera_clock, raw_image_msg, solid_image, string_cdr, wait_for  # noqa: E402
from ros_test_policy import BYTES_PER_TOKEN, RosTestPolicyConfig, expected_actions  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import Float32, Float32MultiArray, String  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402
from vla_runtime_ros.policy_node import INSTRUCTION_QOS  # noqa: E402

pytestmark = pytest.mark.ros

NS = "/pn"
NODE = f"{NS}/vla_policy"
RATE_HZ = 20.0
JOINTS = ["j0", "j1", "j2"]
STATE = np.array([0.1, 0.2, 0.3])
LOW, HIGH = -0.3, 0.3  # clips some dimensions of the test policy's actions
POLICY = RosTestPolicyConfig()
MAX_PIXELS = 640 * 480
ERROR = DiagnosticStatus.ERROR


def expected(image: np.ndarray, state: np.ndarray = STATE) -> np.ndarray:
    return np.clip(expected_actions(image, state, POLICY)[0], LOW, HIGH).astype(np.float32)


class Rig:
    """The node process and the harness endpoints talking to it."""

    def __init__(self, harness, tmp, checkpoint):
        self.harness = harness
        self.diag = Diagnostics(harness, NODE)
        self.actions = harness.subscribe(Float32MultiArray, f"{NODE}/action")
        self.twists = harness.subscribe(TwistStamped, f"{NODE}/twist")
        self.grippers = harness.subscribe(Float32, f"{NODE}/gripper")
        params = dict(
            checkpoint=str(checkpoint), policy_modules=["ros_test_policy"], history="history",
            control_rate_hz=RATE_HZ, diagnostics_rate_hz=5.0, max_image_age_s=1.0, max_image_pixels=MAX_PIXELS,
            use_joint_state=True, joint_names=JOINTS, publish_twist=True,
            action_low=[LOW] * 7, action_high=[HIGH] * 7,
        )
        self.proc = NodeProcess("policy_node", params, tmp, name="vla_policy", namespace=NS)
        self.diag.wait(lambda s, v: v.get("state") == "active", timeout=60, what=f"{NODE} active\n{self.proc.output()}")
        self.images = harness.publisher(Image, f"{NS}/image_raw", qos_profile_sensor_data)
        self.joints = harness.publisher(JointState, f"{NS}/joint_states", qos_profile_sensor_data)
        self.instructions = harness.publisher(String, f"{NS}/instruction", INSTRUCTION_QOS)

    def send_state(self, state: np.ndarray = STATE) -> None:
        self.joints.publish(JointState(name=JOINTS, position=[float(v) for v in state]))

    def act(self, msg: Image, want: np.ndarray, timeout: float = 10.0) -> np.ndarray:
        """Publish one frame and wait for the action computed from it."""
        start = len(self.actions)
        self.images.publish(msg)

        def arrived():
            for action in self.actions.since(start):
                values = conversions.msg_to_actions(action)
                if np.allclose(values, want, atol=1e-6):
                    return (values,)
            return None

        return wait_for(arrived, timeout, f"the action {want} ({len(self.actions) - start} other actions arrived)")[0]

    def values(self) -> dict[str, str]:
        return self.diag.latest()


@pytest.fixture(scope="module")
def rig(harness, tmp_path_factory, policy_checkpoints):
    rig = Rig(harness, tmp_path_factory.mktemp("policy_node"), policy_checkpoints["single"])
    rig.instructions.publish(String(data="pick up the cup"))
    rig.send_state()
    rig.diag.wait(lambda s, v: v["episode"] == "1", what="episode 1")
    yield rig
    rig.proc.close()


def test_actions_arrive_with_the_right_values_near_the_control_rate(rig):
    image = solid_image(1)
    msg = conversions.array_to_image_msg(image)
    want = expected(image)
    start = len(rig.actions)
    for _ in camera_clock(30.0, 75):  # a 30 Hz camera for 2.5 s
        rig.images.publish(msg)
    received = rig.actions.items[start:]
    assert len(received) > 10, rig.proc.output()
    for r in received:
        assert [(d.label, d.size) for d in r.msg.layout.dim] == [("action", 7)]
        np.testing.assert_allclose(conversions.msg_to_actions(r.msg), want, atol=1e-6)
    assert np.any(expected_actions(image, STATE, POLICY)[0] < LOW)  # the bounds clipped something
    times = [r.t for r in received[2:]]  # the first ones include start-up of the stream
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 0.6 * RATE_HZ < rate < 1.15 * RATE_HZ, f"{rate:.1f} Hz for a {RATE_HZ} Hz control rate"
    values = rig.values()
    assert 0.5 * RATE_HZ < float(values["action_rate_hz"]) < 1.2 * RATE_HZ
    assert int(values["frames_received"]) >= 60 and int(values["frames_dropped"]) > 0  # 30 Hz in, 20 Hz used
    assert float(values["step_ms_p95"]) >= float(values["step_ms_p50"]) > 0
    assert int(values["values_clipped"]) >= len(received)
    # the twist carries the same action as a velocity (delta x control rate), the gripper its last value
    twist = rig.twists.wait(1, 5, "twists")[-1].twist
    assert (twist.linear.x, twist.angular.z) == pytest.approx((want[0] * RATE_HZ, want[5] * RATE_HZ), abs=1e-4)
    assert rig.grippers.wait(1, 5, "gripper commands")[-1].data == pytest.approx(want[6])


@pytest.mark.parametrize(
    "encoding, make",
    [
        ("bgr8", lambda img: raw_image_msg(img[..., ::-1].copy(), "bgr8", pad=5)),
        ("rgba8", lambda img: raw_image_msg(np.dstack([img, np.zeros(img.shape[:2], np.uint8)]), "rgba8", pad=4)),
        ("bgra8", lambda img: raw_image_msg(np.dstack([img[..., ::-1], np.zeros(img.shape[:2], np.uint8)]), "bgra8")),
        ("rgb16-big-endian", lambda img: raw_image_msg(img.astype(np.uint16) << 8, "rgb16", bigendian=True, pad=2)),
    ],
)
def test_every_encoding_reaches_the_policy_as_rgb(rig, encoding, make):
    image = solid_image(sum(map(ord, encoding)))
    rig.act(make(image), expected(image))


def test_vga_frames_cross_processes_best_effort_with_the_shipped_fast_dds_profile(rig):
    """0.9 MB best-effort frames are lost between processes with Fast DDS defaults (see fastdds_large_frames.xml)."""
    image = np.repeat(np.repeat(solid_image(8), 10, axis=0), 10, axis=1)  # [480, 640, 3]
    rig.act(conversions.array_to_image_msg(image), expected(image))


def test_mono_frames_become_grey_rgb(rig):
    grey = solid_image(7)[..., 0]
    rig.act(raw_image_msg(grey[..., None].copy(), "mono8", pad=3), expected(np.repeat(grey[..., None], 3, axis=2)))


def test_diagnostics_report_history_kv_growth_and_reset_starts_a_new_episode(rig):
    for seed in range(20, 23):
        image = solid_image(seed)
        rig.act(conversions.array_to_image_msg(image), expected(image))
    before = rig.values()
    steps = int(before["steps"])
    assert int(before["kv_tokens_seen"]) > POLICY.prompt_tokens + POLICY.tokens_per_step * 3  # whole episode held
    assert int(before["kv_bytes"]) == int(before["kv_tokens_seen"]) * BYTES_PER_TOKEN
    episode = int(before["episode"])

    response = rig.harness.call(Trigger, f"{NODE}/reset", Trigger.Request())
    assert response.success, response.message
    assert f"episode {episode + 1} started" in response.message

    image = solid_image(30)
    mark = len(rig.diag.statuses)
    rig.act(conversions.array_to_image_msg(image), expected(image))
    _, after = rig.diag.wait(lambda s, v: int(v["steps"]) > steps and v["episode"] == str(episode + 1), after=mark,
                             what="a step of the new episode")
    assert int(after["kv_tokens_seen"]) == POLICY.prompt_tokens + POLICY.tokens_per_step  # one step's worth again


def test_a_different_instruction_starts_a_new_episode_and_the_same_one_does_not(rig):
    episode = int(rig.values()["episode"])
    rig.instructions.publish(String(data="pick up the cup"))  # the current one again: same episode
    rig.instructions.publish(String(data="close the drawer"))
    rig.diag.wait(lambda s, v: v["episode"] == str(episode + 1), what="the next episode")
    image = solid_image(31)
    mark = len(rig.diag.statuses)
    rig.act(conversions.array_to_image_msg(image), expected(image))
    _, values = rig.diag.wait(lambda s, v: int(v["steps"]) > 0 and v["kv_tokens_seen"] != "0", after=mark, what="the step's KV")
    assert int(values["kv_tokens_seen"]) == POLICY.prompt_tokens + POLICY.tokens_per_step
    assert values["episode"] == str(episode + 1)  # not + 2: repeating the current instruction changed nothing


def _image(seed, **fields):
    msg = conversions.array_to_image_msg(solid_image(seed))
    for key, value in fields.items():
        setattr(msg, key, value)
    return msg


BAD_INPUTS = {
    "wrong-encoding": ("images", lambda: _image(40, encoding="yuv422"), "unsupported image encoding 'yuv422'"),
    "step-mismatch": ("images", lambda: _image(41, step=64 * 3 - 1), "step 191 is smaller than one row"),
    "size-mismatch": ("images", lambda: _image(42, data=bytes(48 * 64 * 3 - 10)), "image data has 9206 bytes; expected step x height"),
    "empty-data": ("images", lambda: _image(43, data=b""), "image data is empty"),
    "zero-size": ("images", lambda: _image(44, width=0, height=0, step=0, data=b""), "image is 0x0"),
    "huge-image": ("images", lambda: conversions.array_to_image_msg(np.zeros((600, 800, 3), np.uint8)), "800x600 = 480000 pixels"),
    "huge-header": ("images", lambda: _image(45, width=100_000, height=100_000), "the limit (max_image_pixels) is 307200"),
    "empty-instruction": ("instructions", lambda: String(data="   "), "instruction is empty"),
    "non-utf8-instruction": ("instructions", lambda: string_cdr(b"\xff\xfe open \xc3"), "not valid UTF-8"),
    "nan-joint-state": ("joints", lambda: JointState(name=JOINTS, position=[0.1, math.nan, 0.3]), "non-finite positions for ['j1']"),
    "missing-joint": ("joints", lambda: JointState(name=["j0", "j2"], position=[0.1, 0.3]), "lacks joints ['j1']"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_reported_counted_and_never_acted_on(rig, case):
    topic, make, message = BAD_INPUTS[case]
    before = rig.values()
    after_diag, after_actions = len(rig.diag.statuses), len(rig.actions)

    getattr(rig, topic).publish(make())

    status, values = rig.diag.wait(
        lambda s, v: s.level == ERROR and int(v["bad_inputs"]) == int(before["bad_inputs"]) + 1,
        after=after_diag, what=f"an ERROR status for {case}",
    )
    assert message in status.message and message in values["last_error"]
    assert values["episode"] == before["episode"]  # a bad instruction starts no episode
    if topic == "joints":  # the state is unknown now: frames must not be acted on until a valid one arrives
        rig.images.publish(conversions.array_to_image_msg(solid_image(46)))
        rig.diag.wait(lambda s, v: "joint state invalid" in s.message and int(v["frames_received"]) > int(values["frames_received"]),
                      what="a WARN naming the invalid joint state")
    rig.diag.wait(lambda s, v: True, after=len(rig.diag.statuses) + 1, what="two more status messages")
    assert len(rig.actions) == after_actions, f"an action was published after {case}"
    if topic == "joints":
        rig.send_state()
    assert rig.proc.alive()
    image = solid_image(47)
    rig.act(conversions.array_to_image_msg(image), expected(image))  # still running, still right


def _set_parameter(rig, name, value: ParameterValue):
    request = SetParameters.Request(parameters=[Parameter(name=name, value=value)])
    return rig.harness.call(SetParameters, f"{NODE}/set_parameters", request).results[0]


def test_dry_run_can_be_switched_at_run_time_and_publishes_nothing(rig):
    result = _set_parameter(rig, "dry_run", ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=True))
    assert result.successful, result.reason
    before = rig.values()
    start = len(rig.actions)
    rig.images.publish(conversions.array_to_image_msg(solid_image(50)))
    rig.diag.wait(lambda s, v: int(v["actions_suppressed"]) == int(before["actions_suppressed"]) + 1, what="a suppressed action")
    rig.diag.wait(lambda s, v: True, after=len(rig.diag.statuses) + 1, what="two more status messages")
    assert len(rig.actions) == start
    result = _set_parameter(rig, "dry_run", ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=False))
    assert result.successful
    image = solid_image(51)
    rig.act(conversions.array_to_image_msg(image), expected(image))


def test_configure_time_parameters_are_refused_while_configured(rig):
    result = _set_parameter(rig, "control_rate_hz", ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=50.0))
    assert not result.successful and "read at configure" in result.reason


def test_sigint_exits_cleanly_within_a_few_seconds(rig):
    code, seconds = rig.proc.interrupt(timeout=10)
    assert code == 0, rig.proc.output()
    assert seconds < 5
    assert "Traceback" not in rig.proc.output()
