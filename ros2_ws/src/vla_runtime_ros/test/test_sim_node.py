"""Closed loop over ROS: the policy node (subprocess) drives the simulator node through topics only,
exactly as it would drive a robot."""

import numpy as np
import pytest

pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from ros_harness import Diagnostics, wait_for  # noqa: E402
from ros_nodes import NodeProcess  # noqa: E402
from ros_test_env import INSTRUCTION, TASK, LineReachEnv  # noqa: E402
from ros_test_policy import RosTestPolicyConfig, expected_actions  # noqa: E402
from vla_runtime_ros.sim_node import RESULT_QOS, SimNode  # noqa: E402

pytestmark = pytest.mark.ros

NS = "/loop"


def test_policy_node_drives_the_simulator_through_two_episodes(harness, tmp_path, policy_checkpoints):
    params = dict(
        checkpoint=str(policy_checkpoints["single"]), policy_modules=["ros_test_policy"],
        control_rate_hz=20.0, diagnostics_rate_hz=10.0, use_joint_state=True, joint_names=["x", "progress"],
        joint_state_max_skew_s=0.0,  # the simulator stamps a frame and its state alike
    )
    policy = NodeProcess("policy_node", params, tmp_path, name="vla_policy", namespace=NS)
    policy_diag = Diagnostics(harness, f"{NS}/vla_policy")
    results = harness.subscribe(DiagnosticStatus, f"{NS}/vla_sim/episode_result", RESULT_QOS)
    env = LineReachEnv()
    sim = None
    finished = []
    try:
        policy.wait_active(policy_diag)
        sim = SimNode(
            env, context=harness.context, namespace=NS, on_finished=finished.append,
            parameter_overrides=[Parameter("task", value=TASK), Parameter("episodes", value=2),
                                 Parameter("camera_rate_hz", value=20.0), Parameter("seed", value=7)],
            cli_args=["--ros-args", "-r", "action:=vla_policy/action"],
        )
        harness.add(sim)
        done = results.wait(2, 60, f"two episode results\n{policy.output()}")
        # the run is over: the simulator publishes no frame any more, so the policy stops acting
        wait_for(lambda: finished, what="the end of the run")
        idle = lambda s, v: v["stepping"] == "False" and v["frames_pending"] == "0"  # noqa: E731
        _, settled = policy_diag.wait(idle, after=len(policy_diag.statuses), what="the policy idle")
        _, later = policy_diag.wait(lambda s, v: True, after=len(policy_diag.statuses) + 3, what="three more statuses")
        assert later["steps"] == settled["steps"] and later["frames_received"] == settled["frames_received"]
    finally:
        if sim is not None:
            harness.remove(sim)
        code, _ = policy.interrupt()
        policy.close()
    assert code == 0

    for episode, result in enumerate(done):
        values = {kv.key: kv.value for kv in result.values}
        assert result.level == DiagnosticStatus.OK and values["success"] == "True", result.message
        assert values["episode"] == str(episode) and values["seed"] == str(7 + episode)
        assert 2 <= int(values["steps"]) < env.max_steps
    assert env.resets == [(TASK, 7), (TASK, 8)]
    steps = [int({kv.key: kv.value for kv in r.values}["steps"]) for r in done]
    assert finished == [f"simulation finished: 2 episodes, 2 successes, mean steps {sum(steps) / 2:.1f}"]

    # every executed action is the policy's answer to a frame (and state) the simulator rendered
    cfg = RosTestPolicyConfig()
    answers = [expected_actions(image, state, cfg)[0].astype(np.float32) for image, state in env.frames]
    for action in env.executed:
        assert any(np.allclose(action, a, atol=1e-6) for a in answers), action

    # the second episode repeated the task, so the simulator reset the policy's episode by service
    episodes = {int(kv.value) for s in policy_diag.statuses for kv in s.values if kv.key == "episode"}
    assert max(episodes) == 2, episodes
    assert f"episode 2: '{INSTRUCTION}'" in policy.output()


def test_bad_actions_are_rejected_and_counted_without_stepping(harness):
    from std_msgs.msg import Float32MultiArray

    from vla_runtime_ros import conversions
    from vla_runtime_ros.sim_node import ACTION_QOS

    env = LineReachEnv()
    sim = SimNode(env, context=harness.context, namespace="/simbad", parameter_overrides=[Parameter("task", value=TASK)])
    diag = Diagnostics(harness, "/simbad/vla_sim")
    harness.add(sim)
    try:
        actions = harness.publisher(Float32MultiArray, "/simbad/action", ACTION_QOS)
        bad = [
            (Float32MultiArray(data=[0.1, float("nan")] + [0.0] * 5), "non-finite"),
            (conversions.actions_to_msg(np.zeros((2, 7), np.float32)), "got a chunk of shape (2, 7)"),
            (conversions.actions_to_msg(np.zeros(4, np.float32)), "expects one action of shape [7]"),
        ]
        for count, (msg, message) in enumerate(bad, start=1):
            actions.publish(msg)
            status, values = diag.wait(lambda s, v, n=count: v["rejected_actions"] == str(n), what=f"rejection {count}")
            assert status.level == DiagnosticStatus.ERROR and message in status.message
        assert env.executed == [] and sim.steps == 0
        actions.publish(conversions.actions_to_msg(np.full(7, 0.1, np.float32)))
        wait_for(lambda: sim.steps == 1, 10, "one step")
    finally:
        harness.remove(sim)


def test_the_first_episode_waits_for_its_result_subscribers(harness):
    """``result_subscribers``: a short run must not end before its listener is discovered (the results would
    leave with the node); nothing starts until that many subscribers listen on ~/episode_result."""
    sim = SimNode(
        LineReachEnv(), context=harness.context, namespace="/held",
        parameter_overrides=[Parameter("task", value=TASK), Parameter("result_subscribers", value=1),
                             Parameter("policy_reset_service", value="")],
    )  # fmt: skip
    harness.add(sim)
    try:
        assert sim.episode == -1 and not sim.running  # nobody listens yet
        harness.subscribe(DiagnosticStatus, "/held/vla_sim/episode_result", RESULT_QOS)
        wait_for(lambda: sim.running and sim.episode == 0, what="the first episode once a subscriber listens")
    finally:
        harness.remove(sim)
