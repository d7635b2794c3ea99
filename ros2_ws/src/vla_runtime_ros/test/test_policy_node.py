"""The policy node over real rclpy + Fast DDS with a tiny random OpenVLA checkpoint, in a subprocess
started the way a user starts it: ``python -m vla_runtime_ros.policy_node --ros-args --params-file ...``.

The node runs OpenVLA in history mode (one KV cache per episode). Values are checked against the
runtime API in this process: the first step of a fresh episode on the same frame must give the
action the node published (the node is reset before each such check). One node serves the whole
module (starting one costs seconds); tests run in file order and the last one stops it with SIGINT.

The rig feeds the node as a robot does: joint states stream at 50 Hz from a harness timer, frames are
re-sent at a camera's pace until the node acts on them, and the rig starts only once every output
topic reports a matched subscriber, so no test depends on the first message after discovery.
"""

import math
import time

import numpy as np
import pytest

pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from geometry_msgs.msg import TwistStamped  # noqa: E402
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue  # noqa: E402
from rcl_interfaces.srv import SetParameters  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from ros_harness import Diagnostics, camera_clock, resend_until, wait_for  # noqa: E402
from ros_messages import raw_image_msg, solid_image, string_cdr  # noqa: E402
from ros_nodes import NodeProcess  # noqa: E402
import torch  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import Float32, Float32MultiArray, String  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from vla_runtime.api import Observation, load_policy  # noqa: E402
from vla_runtime.config import SessionConfig  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402
from vla_runtime_ros.policy_node import INSTRUCTION_QOS  # noqa: E402

pytestmark = pytest.mark.ros

NS = "/pn"
NODE = f"{NS}/vla_policy"
RATE_HZ = 5.0
JOINTS = ["j0", "j1", "j2"]
STATE = np.array([0.1, 0.2, 0.3])
LOW, HIGH = -0.5, 0.5
MAX_PIXELS = 640 * 480
INSTRUCTION = "pick up the cup"
ERROR = DiagnosticStatus.ERROR
JOINT_STATE_HZ = 50.0
CAMERA_HZ = 10.0  # how often a frame is re-sent until the node acts on it


def joint_state(position=STATE, stamp_s: int = 0) -> JointState:
    """A JointState of ``position``; ``stamp_s`` 0 leaves it unstamped (the node then does not pair by stamp)."""
    from builtin_interfaces.msg import Time

    msg = JointState(name=JOINTS, position=[float(v) for v in position])
    msg.header.stamp = Time(sec=stamp_s)
    return msg


class Reference:
    """The same checkpoint through the runtime API in this process: what a fresh episode's first step gives."""

    def __init__(self, checkpoint):
        self.policy = load_policy(checkpoint, device="cpu")

    def first_step(self, image: np.ndarray, instruction: str = INSTRUCTION, *, steps: int = 1):
        """The action of a fresh episode's first step on ``image``, and the KV after its first ``steps`` steps
        (every one on ``image``)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the node (torch_threads: 1): identical float32 arithmetic
        try:
            session = self.policy.new_session(instruction, SessionConfig(history="history"))
            obs = Observation(images={"primary": image}, state=STATE.astype(np.float32))
            result = session.step(obs)
            first = result
            for _ in range(steps - 1):
                result = session.step(obs)
        finally:
            torch.set_num_threads(threads)
        return np.clip(first.actions[0], LOW, HIGH).astype(np.float32), result.kv


class Rig:
    """The node process and the harness endpoints talking to it."""

    def __init__(self, harness, tmp, checkpoint):
        self.harness = harness
        self.reference = Reference(checkpoint)
        self.diag = Diagnostics(harness, NODE)
        self.actions = harness.subscribe(Float32MultiArray, f"{NODE}/action")
        self.twists = harness.subscribe(TwistStamped, f"{NODE}/twist")
        self.grippers = harness.subscribe(Float32, f"{NODE}/gripper")
        params = dict(
            checkpoint=str(checkpoint), device="cpu", torch_threads=1, history="history",
            control_rate_hz=RATE_HZ, diagnostics_rate_hz=10.0, max_image_pixels=MAX_PIXELS,
            # a frame goes stale only on a machine far slower than any step here: on a loaded one a first step may
            # take over a second, and its action must not be withheld (test_policy_lifecycle tests the watchdog)
            max_image_age_s=60.0,
            use_joint_state=True, joint_names=JOINTS, publish_twist=True,
            action_low=[LOW] * 7, action_high=[HIGH] * 7,
        )
        self.proc = NodeProcess("policy_node", params, tmp, name="vla_policy", namespace=NS)
        self.proc.wait_active(self.diag)
        # every output has its subscriber on the node's side too: nothing the node publishes from now on is lost
        self.diag.wait(lambda s, v: all(v.get(f"{t}_subscribers", "0") != "0" for t in ("action", "twist", "gripper")),
                       what="the node's outputs matched to the harness")
        self.images = harness.publisher(Image, f"{NS}/image_raw", qos_profile_sensor_data)
        self.instructions = harness.publisher(String, f"{NS}/instruction", INSTRUCTION_QOS)  # reliable, latched
        self.joints = harness.stream(JointState, f"{NS}/joint_states", qos_profile_sensor_data, JOINT_STATE_HZ, joint_state())

        self.frames_sent = 0
        self.images_last: Image | None = None
        self.last_stamp = ""  # header.stamp of the newest frame sent, as the node reports it

    def publish(self, msg: Image) -> None:
        """Publish ``msg`` as a new frame: its own stamp (the sent second, a nanosecond per frame ever sent)."""
        self.frames_sent += 1
        msg.header.stamp.nanosec = self.frames_sent
        self.last_stamp = f"{msg.header.stamp.sec}.{msg.header.stamp.nanosec:09d}"
        self.images_last = msg
        self.images.publish(msg)

    def send(self, msg: Image, done, what: str):
        """Re-send ``msg`` at a camera's pace until ``done()`` (a best-effort frame may be lost)."""
        return resend_until(lambda: self.publish(msg), done, what, hz=CAMERA_HZ)

    def settle(self) -> dict[str, str]:
        """Wait until the node is done with every frame sent and every action it published arrived.

        Done: the newest image it received is the last one sent (one writer's best-effort samples arrive in
        order, so no earlier one can still come), no frame waits, no step runs, the queue is empty. Returns
        that status's values. A lost last frame is re-sent (a new frame, which the node then acts on too).
        """
        mark = len(self.diag.statuses)
        msg = self.images_last
        idle = lambda: self.diag.find(lambda s, v: v["frame_stamp"] == self.last_stamp and v["frames_pending"] == "0"  # noqa: E731
                                      and v["stepping"] == "False" and v["queue_len"] == "0", after=mark)
        _, values = resend_until(lambda: self.publish(msg), idle, "the node done with every frame", hz=1.0, first=False)
        self.actions.wait(int(values["actions_published"]), what="every action the node published")
        return values

    def reset(self) -> int:
        """Start a new episode; returns its number once the node applied it."""
        response = self.harness.call(Trigger, f"{NODE}/reset", Trigger.Request())
        assert response.success, response.message
        return int(response.message.split()[1])

    def act(self, msg: Image, want: np.ndarray, start: int | None = None) -> np.ndarray:
        """Send a frame (re-sent until acted on) and wait for the action ``want`` computed from it, among the
        actions received from index ``start`` on (default: those arriving from now on)."""
        start = len(self.actions) if start is None else start

        def arrived():
            for action in self.actions.since(start):
                values = conversions.msg_to_actions(action)
                if np.allclose(values, want, atol=1e-5):
                    return (values,)
            return None

        try:
            return self.send(msg, arrived, f"the action {want.tolist()}")[0]
        except TimeoutError as e:
            got = [conversions.msg_to_actions(a).tolist() for a in self.actions.since(start)]
            raise AssertionError(f"{e}; got {got}\n{self.values()}") from None

    def first_step(self, msg: Image, image: np.ndarray) -> np.ndarray:
        """Reset, send ``msg`` (which shows ``image``), expect the reference's first action for ``image``.

        Counted from before the reset: a frame of ``image`` still on its way may become the new episode's first
        step, and on a loaded machine its action can arrive before the reset service's reply does.
        """
        start = len(self.actions)
        self.reset()
        return self.act(msg, self.reference.first_step(image)[0], start=start)

    def values(self) -> dict[str, str]:
        return self.diag.latest()


@pytest.fixture(scope="module")
def rig(harness, tmp_path_factory, openvla_checkpoint):
    rig = Rig(harness, tmp_path_factory.mktemp("policy_node"), openvla_checkpoint)
    rig.instructions.publish(String(data=INSTRUCTION))
    rig.diag.wait(lambda s, v: v["episode"] == "1", what="episode 1")
    yield rig
    rig.joints.close(harness)
    rig.proc.close()


def test_actions_arrive_with_the_right_shape_near_the_control_rate(rig):
    image = solid_image(1)
    msg = conversions.array_to_image_msg(image)
    rig.reset()
    start = len(rig.actions)
    before = rig.values()
    ticks_before, published_before, t_before = int(before["ticks"]), int(before["actions_published"]), time.monotonic()
    # a 30 Hz camera for at least 3 s and until 12 actions came (a loaded machine warms up slowly)
    for frame in camera_clock(30.0, 1200):
        rig.publish(msg)
        if frame >= 90 and len(rig.actions.items) - start >= 12:
            break
    received = rig.actions.items[start:]
    assert len(received) >= 12, f"{rig.values()}\n{rig.proc.output()}"
    for r in received:
        assert [(d.label, d.size) for d in r.msg.layout.dim] == [("action", 7)]
        action = conversions.msg_to_actions(r.msg)
        assert np.all(np.isfinite(action)) and np.all(action >= LOW) and np.all(action <= HIGH)
    # the episode's first action is the runtime API's first step on this frame (later ones see the history)
    np.testing.assert_allclose(conversions.msg_to_actions(received[0].msg), rig.reference.first_step(image)[0], atol=1e-5)
    times = [r.t for r in received[2:]]  # the first ones include the stream's start-up
    rate = (len(times) - 1) / (times[-1] - times[0])
    values = rig.values()
    # never above the control rate: at most one action per tick (counted by the node, so a burst of late deliveries
    # to this process cannot blur it); at least what this machine allowed: a step starts once the previous
    # action left the queue and its action goes out on a tick, so an action per ceil(step/period)+1 ticks, of
    # the ticks the node ran (a process the machine stalls for a second runs no ticks meanwhile: the timer
    # skips them, and the node's tick count shows it)
    ticks = int(values["ticks"]) - ticks_before
    assert int(values["actions_published"]) - published_before <= ticks, values
    period = 1.0 / RATE_HZ
    tick_share = min(1.0, ticks / ((time.monotonic() - t_before) * RATE_HZ))
    reachable = tick_share / (period * (math.ceil(float(values["step_ms_p95"]) / 1e3 / period) + 1))
    assert 0.7 * reachable < rate, f"{rate:.2f} Hz for a {RATE_HZ} Hz control rate: {values}"
    assert 0.5 * reachable < float(values["action_rate_hz"]), values
    # more frames came than were used (30 Hz in, 5 Hz out): the unused ones count as dropped
    assert int(values["frames_received"]) > int(values["steps"]) and int(values["frames_dropped"]) > 0, values
    assert float(values["step_ms_p95"]) >= float(values["step_ms_p50"]) > 0
    assert float(values["latency_ms_p50"]) >= float(values["step_ms_p50"])
    # each twist carries an action as a velocity (delta x control rate), the gripper its last value
    actions = [conversions.msg_to_actions(m) for m in rig.actions.since(start)]
    twists = [t.twist for t in rig.twists.wait(len(actions), 5, "twists")[-len(actions):]]
    grippers = [g.data for g in rig.grippers.wait(len(actions), 5, "gripper commands")[-len(actions):]]
    for action, twist, gripper in zip(actions, twists, grippers):
        assert (twist.linear.x, twist.linear.z, twist.angular.y) == pytest.approx(tuple(action[[0, 2, 4]] * RATE_HZ), abs=1e-4)
        assert gripper == pytest.approx(action[6])


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
    rig.first_step(make(image), image)


def test_vga_frames_cross_processes_best_effort_with_the_shipped_fast_dds_profile(rig):
    """0.9 MB best-effort frames are lost between processes with Fast DDS defaults (see fastdds_large_frames.xml)."""
    image = np.repeat(np.repeat(solid_image(8), 10, axis=0), 10, axis=1)  # [480, 640, 3]
    rig.first_step(conversions.array_to_image_msg(image), image)


def test_mono_frames_become_grey_rgb(rig):
    grey = solid_image(7)[..., 0]
    rig.first_step(raw_image_msg(grey[..., None].copy(), "mono8", pad=3), np.repeat(grey[..., None], 3, axis=2))


def test_history_kv_grows_and_reset_starts_a_new_episode(rig):
    image = solid_image(20)
    _, first_kv = rig.reference.first_step(image)
    rig.settle()  # no earlier frame still on its way to become the new episode's first step
    start = len(rig.actions)
    episode = rig.reset()
    rig.act(conversions.array_to_image_msg(image), rig.reference.first_step(image)[0], start=start)
    for seed in range(21, 24):  # three more steps of the same episode
        start = len(rig.actions)
        rig.send(conversions.array_to_image_msg(solid_image(seed)), lambda: len(rig.actions) > start, "an action")
    _, before = rig.diag.wait(lambda s, v: v["steps"] != "0" and int(v["kv_tokens_seen"]) > first_kv.tokens_seen * 2,
                              after=len(rig.diag.statuses), what="the episode's KV growing")
    assert before["episode"] == str(episode)
    assert int(before["kv_bytes"]) > first_kv.bytes * 2  # the whole episode is held (history mode, full cache)

    settled = rig.settle()
    start = len(rig.actions)
    assert rig.reset() == episode + 1
    mark = len(rig.diag.statuses)
    rig.act(conversions.array_to_image_msg(image), rig.reference.first_step(image)[0], start=start)  # as a fresh episode
    _, after = rig.diag.wait(lambda s, v: v["episode"] == str(episode + 1) and v["kv_tokens_seen"] != "0", after=mark,
                             what="a step of the new episode")
    # the frame is re-sent until its action arrives, so on a loaded machine the node may have acted on it more
    # than once before this status (a stress run saw two steps): the new episode holds exactly its own steps of
    # the frame, nothing of the old episode (which would add its tokens)
    steps = int(after["steps"]) - int(settled["steps"])
    assert steps >= 1
    _, want = rig.reference.first_step(image, steps=steps)
    assert (int(after["kv_tokens_seen"]), int(after["kv_bytes"])) == (want.tokens_seen, want.bytes)  # dropped


def test_a_different_instruction_starts_a_new_episode_and_the_same_one_does_not(rig):
    rig.settle()  # no earlier frame or action still on its way
    start = len(rig.actions)
    episode = int(rig.values()["episode"])
    rig.instructions.publish(String(data=INSTRUCTION))  # the current one again: same episode
    rig.instructions.publish(String(data="close the drawer"))
    rig.diag.wait(lambda s, v: v["episode"] == str(episode + 1), what="the next episode")
    image = solid_image(31)
    mark = len(rig.diag.statuses)
    rig.act(conversions.array_to_image_msg(image), rig.reference.first_step(image, "close the drawer")[0], start=start)
    _, values = rig.diag.wait(lambda s, v: v["kv_tokens_seen"] != "0", after=mark, what="the step's KV")
    assert values["episode"] == str(episode + 1)  # not + 2: repeating the current instruction changed nothing
    rig.instructions.publish(String(data=INSTRUCTION))
    rig.diag.wait(lambda s, v: v["episode"] == str(episode + 2), what="back to the first instruction")


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
    before = rig.settle()
    after_diag, after_actions = len(rig.diag.statuses), len(rig.actions)
    bad = make()

    def reported():
        return rig.diag.find(lambda s, v: s.level == ERROR and int(v["bad_inputs"]) > int(before["bad_inputs"])
                             and message in s.message, after=after_diag)

    if topic == "instructions":  # reliable and latched: sent once
        rig.instructions.publish(bad)
        status, values = wait_for(reported, what=f"an ERROR status for {case}")
    elif topic == "images":  # best effort: re-sent until the node reports it
        status, values = rig.send(bad, reported, f"an ERROR status for {case}")
    else:  # the joint-state driver sends the bad reading until it is reported, then goes quiet
        rig.joints.set(bad)
        status, values = wait_for(reported, what=f"an ERROR status for {case}")
        rig.joints.set(None)
    assert message in values["last_error"]
    assert values["episode"] == before["episode"]  # a bad instruction starts no episode
    if topic == "joints":  # the state is unknown now: frames must not be acted on until a valid one arrives
        rig.send(conversions.array_to_image_msg(solid_image(46)), lambda: rig.diag.find(
            lambda s, v: "joint state invalid" in s.message and int(v["frames_received"]) > int(values["frames_received"]),
            after=after_diag), "a WARN naming the invalid joint state")
    _, now = rig.diag.wait(lambda s, v: True, after=len(rig.diag.statuses) + 1, what="two more status messages")
    assert now["actions_published"] == before["actions_published"], f"an action was published after {case}"
    assert len(rig.actions) == after_actions, f"an action arrived after {case}"
    if topic == "joints":
        rig.joints.set(joint_state())
    assert rig.proc.alive()
    image = solid_image(47)
    rig.first_step(conversions.array_to_image_msg(image), image)  # still running, still right


def test_a_frame_waits_for_the_joint_state_of_its_moment(rig):
    from builtin_interfaces.msg import Time

    rig.settle()  # no action of an earlier frame is still on its way
    rig.reset()
    # the joint-state stream lags: its newest reading is stamped 100 s (a state the reference never sees)
    rig.joints.set(joint_state([0.4, -0.2, 0.0], stamp_s=100))
    mark = len(rig.diag.statuses)
    _, before = rig.diag.wait(lambda s, v: v["joint_state_stamp"] == "100.000", after=mark, what="the stamped state")
    start = len(rig.actions)
    image = solid_image(48)
    frame = conversions.array_to_image_msg(image, stamp=Time(sec=101))  # 1 s after the newest state
    rig.send(frame, lambda: rig.diag.find(
        lambda s, v: "older than the image" in s.message and int(v["frames_received"]) > int(before["frames_received"]),
        after=mark), "a WARN that the joint state lags the image")
    assert len(rig.actions) == start, "a frame was acted on with an earlier moment's joint state"
    rig.joints.set(joint_state(STATE, stamp_s=101))  # the state of the frame's moment arrives: the frame goes now
    want = rig.reference.first_step(image)[0]
    wait_for(lambda: any(np.allclose(conversions.msg_to_actions(a), want, atol=1e-5) for a in rig.actions.since(start)),
             what="the action for the frame and its state")
    rig.joints.set(joint_state())  # unstamped again, as the other tests send


def _set_parameter(rig, name, value: ParameterValue):
    request = SetParameters.Request(parameters=[Parameter(name=name, value=value)])
    return rig.harness.call(SetParameters, f"{NODE}/set_parameters", request).results[0]


def test_dry_run_can_be_switched_at_run_time_and_publishes_nothing(rig):
    result = _set_parameter(rig, "dry_run", ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=True))
    assert result.successful, result.reason
    before = rig.settle()
    start, mark = len(rig.actions), len(rig.diag.statuses)
    rig.send(conversions.array_to_image_msg(solid_image(50)), lambda: rig.diag.find(
        lambda s, v: int(v["actions_suppressed"]) > int(before["actions_suppressed"]), after=mark), "a suppressed action")
    rig.diag.wait(lambda s, v: True, after=len(rig.diag.statuses) + 1, what="two more status messages")
    assert len(rig.actions) == start
    result = _set_parameter(rig, "dry_run", ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=False))
    assert result.successful
    image = solid_image(51)
    rig.first_step(conversions.array_to_image_msg(image), image)


def test_configure_time_parameters_are_refused_while_configured(rig):
    result = _set_parameter(rig, "control_rate_hz", ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=50.0))
    assert not result.successful and "read at configure" in result.reason


def test_sigint_exits_cleanly_within_a_few_seconds(rig):
    code, seconds = rig.proc.interrupt()  # bounded by PATIENCE: it raises if the node hangs
    assert code == 0, rig.proc.output()
    assert "Traceback" not in rig.proc.output()
