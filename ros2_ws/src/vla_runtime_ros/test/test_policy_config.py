"""Configure-time validation, driven in-process with ``trigger_configure()``: every bad parameter
leaves the node unconfigured with a message naming the parameter; a good one walks every transition."""

import contextlib
import re
import time

import numpy as np
import pytest

pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from ros_harness import Diagnostics, resend_until  # noqa: E402
from ros_messages import solid_image  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Float32MultiArray, String  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402
from vla_runtime_ros.policy_node import INSTRUCTION_QOS  # noqa: E402

from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from vla_runtime_ros.policy_node import PolicyNode  # noqa: E402

pytestmark = pytest.mark.ros

SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE


def make_node(harness, ckpt, **overrides):
    params = {"checkpoint": str(ckpt), "policy_modules": ["ros_test_policy"]}
    params.update(overrides)
    return PolicyNode(
        "vla_policy_config_test", context=harness.context, namespace="/cfg",
        parameter_overrides=[Parameter(k, value=v) for k, v in params.items()],
    )


@contextlib.contextmanager
def running(harness, ckpt, **overrides):
    """An active in-process node spun by the harness executor, with its /diagnostics statuses."""
    node = make_node(harness, ckpt, diagnostics_rate_hz=20.0, control_rate_hz=20.0, **overrides)
    diag = Diagnostics(harness, "/cfg/vla_policy_config_test")
    try:
        assert node.trigger_configure() == SUCCESS
        assert node.trigger_activate() == SUCCESS
        harness.add(node)
        yield node, diag
    finally:
        harness.remove(node)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"checkpoint": ""}, "parameter `checkpoint` is empty"),
        ({"history": "everything"}, "`history` is 'everything'; expected one of single, history"),
        ({"control_rate_hz": 0.0}, "parameter `control_rate_hz` must be a finite number > 0 (Hz), got 0.0"),
        ({"control_rate_hz": float("inf")}, "parameter `control_rate_hz` must be a finite number > 0 (Hz), got inf"),
        ({"diagnostics_rate_hz": float("inf")}, "parameter `diagnostics_rate_hz` must be a finite number > 0 (Hz), got inf"),
        ({"schedule_margin_ms": -1.0}, "parameter `schedule_margin_ms` must be a finite number >= 0, got -1.0"),
        ({"action_low": [float("nan")] * 7, "action_high": [1.0] * 7}, "`action_low` / `action_high` hold NaN"),
        ({"joint_state_max_skew_s": float("nan")}, "parameter `joint_state_max_skew_s` is NaN"),
        ({"fallback_keep_dims": [7]}, "parameter `fallback_keep_dims` names dimension(s) [7]; the policy's actions have 7"),
        ({"policy_modules": ["ros_test_broken_module"]}, "configure failed: AttributeError: a plug-in's bug"),
        ({"control_rate_hz": "fast"}, "parameter `control_rate_hz` is 'fast' (str); expected float"),
        ({"image_transport": "h264"}, "`image_transport` is 'h264'; expected one of raw, compressed"),
        ({"image_reliability": "sometimes"}, "`image_reliability` is 'sometimes'; expected one of best_effort, reliable"),
        ({"device": "tpu"}, "parameter `device` is 'tpu'"),
        ({"kv.mode": "paged"}, "`mode` is 'paged'; expected one of full, sink_window, chunked"),
        ({"action_low": [-1.0] * 3, "action_high": [1.0] * 3}, "have 3 values; the policy's actions have 7"),
        ({"action_low": [-1.0] * 7}, "`action_low` has 7 values and `action_high` 0"),
        ({"action_low": [1.0] * 7, "action_high": [-1.0] * 7}, "`action_low` > `action_high` at dimensions [0, 1, 2, 3, 4, 5, 6]"),
        ({"policy_modules": ["no_such_policy_module"]}, "No module named 'no_such_policy_module'"),
        ({"late_grace_ms": -1.0}, "`late_grace_ms` must be >= 0, got -1.0"),
        ({"control_thread_priority": 100}, "`control_thread_priority` must be 0 (normal scheduling) or 1-99 (SCHED_FIFO), got 100"),
        ({"prepack": True}, "parameter `prepack` applies to the families whose loader takes the speed options"),
        ({"fuse": True}, "parameter `fuse` applies to the families whose loader takes the speed options"),
        ({"quantize": "int5"}, "parameter `quantize` is 'int5'; expected one of none, int8, int4"),
    ],
)
def test_bad_parameters_fail_configure_naming_the_parameter(harness, policy_checkpoints, capfd, overrides, message):
    node = make_node(harness, policy_checkpoints["single"], **overrides)  # overrides may replace the checkpoint
    try:
        assert node.trigger_configure() == FAILURE
    finally:
        node.destroy_node()
    assert message in capfd.readouterr().err


def test_a_parameter_of_the_wrong_type_is_refused_by_name(harness, policy_checkpoints):
    with pytest.raises(ValueError, match="parameter `torch_threads` has the wrong type .*; expected an integer"):
        make_node(harness, policy_checkpoints["single"], torch_threads="abc")


def test_the_speed_parameters_become_load_options(openvla_checkpoint):
    from vla_runtime.models.quantize import QuantMode
    from vla_runtime_ros.params import PolicyNodeConfig

    plain = PolicyNodeConfig(checkpoint=str(openvla_checkpoint), dtype="float32")
    assert plain.load_options("cpu") == {"device": "cpu", "dtype": "float32"}
    packed = PolicyNodeConfig(checkpoint=str(openvla_checkpoint), prepack=True, adapter="run")
    assert packed.load_options("cpu") == {"device": "cpu", "adapter": "run", "prepack": True}
    every = PolicyNodeConfig(checkpoint=str(openvla_checkpoint), quantize="int8", fuse=True, prepack=True)
    assert every.quantize is QuantMode.INT8
    assert every.load_options("cpu") == {"device": "cpu", "quantize": QuantMode.INT8, "fuse": True, "prepack": True}


def test_twist_output_needs_six_dimensional_actions(harness, tmp_path, capfd):
    from ros_test_policy import write_checkpoint

    node = make_node(harness, write_checkpoint(tmp_path / "four", action_dim=4), publish_twist=True)
    try:
        assert node.trigger_configure() == FAILURE
    finally:
        node.destroy_node()
    assert "publish_twist needs actions of >= 6 values" in capfd.readouterr().err


def test_every_transition_succeeds_in_process(harness, policy_checkpoints):
    node = make_node(harness, policy_checkpoints["chunk"], default_instruction="stack the blocks", **{"kv.mode": "full"})
    try:
        assert node.trigger_configure() == SUCCESS
        assert node._runner is not None and node._runner.policy.chunk_size == 4
        assert node.trigger_activate() == SUCCESS
        assert node.trigger_deactivate() == SUCCESS
        assert node.trigger_activate() == SUCCESS
        assert node.trigger_deactivate() == SUCCESS
        assert node.trigger_cleanup() == SUCCESS
        assert node._runner is None and node._worker is None
        assert node.trigger_configure() == SUCCESS
        assert node.trigger_shutdown() == SUCCESS
    finally:
        node.destroy_node()


def test_a_best_effort_camera_against_a_reliable_subscription_is_reported(harness, policy_checkpoints):
    with running(harness, policy_checkpoints["single"], image_reliability="reliable") as (node, diag):
        camera = harness.node.create_publisher(Image, "/cfg/image_raw", qos_profile_sensor_data)
        try:
            status, values = diag.wait(lambda s, v: s.level == DiagnosticStatus.ERROR, what="an ERROR about the camera's QoS")
        finally:
            harness.destroy_publisher(camera)
    assert "QoS is incompatible with this subscription (RELIABILITY)" in status.message
    assert values["setup_errors"] == "1" and values["bad_inputs"] == "0"


@pytest.mark.parametrize(
    "fault, message",
    [("raise", "inference failed: RuntimeError: test policy fault: CUDA out of memory"), ("nan", "non-finite actions")],
)
def test_a_failing_policy_is_reported_and_publishes_nothing(harness, tmp_path, fault, message):
    from ros_test_policy import write_checkpoint

    with running(harness, write_checkpoint(tmp_path / fault, fault=fault), default_instruction="stack the blocks") as (node, diag):
        actions = harness.subscribe(Float32MultiArray, "/cfg/vla_policy_config_test/action")
        camera = harness.publisher(Image, "/cfg/image_raw", qos_profile_sensor_data)
        errors = 0
        for seed in range(3):  # every frame fails the same way; the node keeps going
            mark = len(diag.statuses)
            # wait for the ERROR status of a new error, not any status with a higher count: a frame re-sent while the
            # previous round waited fails after it, and its ERROR status may come before `mark` (or be lost from the
            # publisher's 10-deep history on a stalled machine), leaving only later OK statuses with its count
            status, values = resend_until(
                lambda seed=seed: camera.publish(conversions.array_to_image_msg(solid_image(seed))),
                lambda n=errors: diag.find(lambda s, v: s.level == DiagnosticStatus.ERROR and int(v["inference_errors"]) > n,
                                           after=mark),
                f"error {seed + 1}",
            )
            errors = int(values["inference_errors"])
            assert status.level == DiagnosticStatus.ERROR and message in status.message
        diag.wait(lambda s, v: True, after=len(diag.statuses) + 2, what="more status messages")
        assert len(actions) == 0 and values["bad_inputs"] == "0"


def test_an_instruction_older_than_its_max_age_withholds_actions(harness, policy_checkpoints):
    with running(harness, policy_checkpoints["single"], max_instruction_age_s=0.3) as (node, diag):
        actions = harness.subscribe(Float32MultiArray, "/cfg/vla_policy_config_test/action")
        camera = harness.publisher(Image, "/cfg/image_raw", qos_profile_sensor_data)
        instructions = harness.publisher(String, "/cfg/instruction", INSTRUCTION_QOS)

        def act_while_fresh(image_value: int, count: int) -> None:
            """Refresh the instruction and send a frame until an action comes (a loaded machine's first step
            can take longer than the 0.3 s max age, then that action is rightly withheld)."""

            def send() -> None:
                instruction_sent[0] = time.time()
                instructions.publish(String(data="stack the blocks"))
                camera.publish(conversions.array_to_image_msg(solid_image(image_value)))

            resend_until(send, lambda: len(actions) > count, "an action while the instruction is fresh", hz=4.0)

        def last_instruction_stale() -> DiagnosticStatus | None:
            """A status naming the *last* instruction sent as stale: the one it names was received (stamp - age)
            after that was sent. A slow first step can let an earlier one go stale between two refreshes above,
            and a status saying so may arrive late; after the last one goes stale it stays stale."""
            for status, stamp in zip(diag.statuses[:], diag.stamps[:]):
                age = re.search(r"instruction is ([0-9.]+) s old", status.message)
                if age and stamp - float(age.group(1)) >= instruction_sent[0] - 0.01:  # (the age is rounded)
                    return status
            return None

        instruction_sent = [0.0]  # time.time() of the last instruction published
        act_while_fresh(1, 0)
        # frames keep coming (the node reports a stale image before a stale instruction, and the image's max age is
        # 0.5 s: a status published more than 0.5 s after the last frame would only ever name the image)
        status = resend_until(lambda: camera.publish(conversions.array_to_image_msg(solid_image(1))),
                              last_instruction_stale, "the instruction going stale")
        assert status.level == DiagnosticStatus.WARN and "(max_instruction_age_s 0.3)" in status.message
        # two statuses on, one that shows no step running, no frame waiting and every published action received (a
        # frame sent just before the instruction went stale may still be stepping on a loaded machine)
        diag.wait(lambda s, v: v["stepping"] == "False" and v["frames_pending"] == "0"
                  and int(v["actions_published"]) == len(actions), after=len(diag.statuses) + 2, what="steps in flight to finish")
        count, received = len(actions), int(diag.latest()["frames_received"])
        mark = len(diag.statuses)
        resend_until(lambda: camera.publish(conversions.array_to_image_msg(solid_image(2))),
                     lambda: diag.find(lambda s, v: int(v["frames_received"]) > received, after=mark), "the stale-instruction frame")
        diag.wait(lambda s, v: True, after=len(diag.statuses) + 3, what="more status messages")
        assert len(actions) == count
        act_while_fresh(3, count)  # refreshed: acting again, same episode
        assert np.all(np.isfinite(conversions.msg_to_actions(actions.since(count)[0])))


def test_an_episode_that_failed_to_start_is_said_and_the_same_instruction_starts_it_again(harness, tmp_path):
    """Starts fail twice. The node says so on /diagnostics until an episode starts, and the same instruction published
    again tries again. (An earlier test's latched instruction on this topic may reach the node first and use up one
    failure: whichever failed last, the WARN stays until a start succeeds, and re-sending retries until one does.)"""
    from ros_test_policy import write_checkpoint

    with running(harness, write_checkpoint(tmp_path / "flaky", fault="start_twice")) as (node, diag):
        actions = harness.subscribe(Float32MultiArray, "/cfg/vla_policy_config_test/action")
        camera = harness.publisher(Image, "/cfg/image_raw", qos_profile_sensor_data)
        instructions = harness.publisher(String, "/cfg/instruction", INSTRUCTION_QOS)
        instructions.publish(String(data="stack the blocks"))
        status, _ = diag.wait(lambda s, v: s.message.startswith("no episode: could not start episode"),
                              what="a failed start on /diagnostics")  # fmt: skip
        assert status.level == DiagnosticStatus.WARN and "out of memory at the episode start" in status.message

        def send() -> None:  # the same text again (a new message) and frames: the start is tried again
            instructions.publish(String(data="stack the blocks"))
            camera.publish(conversions.array_to_image_msg(solid_image(2)))

        resend_until(send, lambda: len(actions) > 0, "an action after a start succeeded", hz=2.0)
        diag.wait(lambda s, v: s.level == DiagnosticStatus.OK, after=len(diag.statuses), what="an OK status again")
