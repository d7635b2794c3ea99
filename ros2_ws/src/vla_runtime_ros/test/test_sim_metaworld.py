"""Closed loop with the real simulator: the Meta-World sim node and the policy node (tiny random
OpenVLA) as two processes, connected by topics only, as on a robot. The simulator's run of two
episodes ends by itself: it logs its summary and exits 0."""

import importlib.util

import pytest

pytest.importorskip("rclpy")
# find_spec, not importorskip: importing metaworld here would load mujoco before the simulator
# picks its headless GL backend (MUJOCO_GL is read once, at mujoco's import)
if importlib.util.find_spec("metaworld") is None:
    pytest.skip("metaworld is not installed", allow_module_level=True)

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from ros_harness import Diagnostics  # noqa: E402
from ros_nodes import NodeProcess, node_logs  # noqa: E402
from vla_runtime_ros.sim_node import RESULT_QOS  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.sim]

NS = "/mw"
STEPS = 4
EPISODES = 2


def test_openvla_drives_metaworld_through_a_run_that_ends(harness, tmp_path, openvla_checkpoint):
    results = harness.subscribe(DiagnosticStatus, f"{NS}/vla_sim/episode_result", RESULT_QOS)
    policy_diag = Diagnostics(harness, f"{NS}/vla_policy")
    policy = NodeProcess(
        "policy_node",
        dict(checkpoint=str(openvla_checkpoint), device="cpu", torch_threads=1, control_rate_hz=10.0, use_joint_state=True),
        tmp_path, name="vla_policy", namespace=NS,
    )
    sim = NodeProcess(
        "sim_node",
        dict(task="reach-v3", seed=3, episodes=EPISODES, max_steps=STEPS, camera="corner2", resolution=[96, 96],
             result_subscribers=1),  # this test's results subscription: a 2 x 4-step run ends in about a second
        tmp_path, name="vla_sim", namespace=NS, extra_args=("-r", "action:=vla_policy/action"),
    )
    try:
        done = results.wait(EPISODES, 180, "the episode results", explain=node_logs(sim, policy, diag=policy_diag))
        _, policy_values = policy_diag.wait(lambda s, v: int(v["steps"]) >= EPISODES * STEPS, what="the policy's steps")
        sim_code = sim.wait_exit()
    finally:
        policy_code, _ = policy.interrupt()
        sim.close()
        policy.close()
    for episode, result in enumerate(done):
        values = {kv.key: kv.value for kv in result.values}
        assert values["task"] == "reach-v3" and values["seed"] == str(3 + episode)
        # a random tiny policy does not reach the goal in 4 steps: the episode ends by the step limit
        assert (values["success"], values["truncated"], values["steps"]) == ("False", "True", str(STEPS))
        assert result.level == DiagnosticStatus.WARN
    assert f"simulation finished: {EPISODES} episodes, 0 successes, mean steps {STEPS:.1f}" in sim.output()
    assert "action rejected" not in sim.output()  # every 7-D OpenVLA action mapped onto Meta-World's 4-D space
    assert policy_values["bad_inputs"] == "0" and policy_values["inference_errors"] == "0"
    assert int(policy_values["frames_received"]) >= STEPS
    assert (sim_code, policy_code) == (0, 0)
