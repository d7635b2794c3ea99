"""Closed loop over ROS with a policy that needs the robot state: the Meta-World sim node publishes its
state on joint_states, the policy node (tiny random HybridVLA, use_joint_state) turns it into the
proprio token ([x, y, z, gripper] -> upstream's 7-D layout) every step."""

import importlib.util

import pytest

pytest.importorskip("rclpy")
# find_spec, not importorskip: importing metaworld would load mujoco before the simulator picks its GL backend
if importlib.util.find_spec("metaworld") is None:
    pytest.skip("metaworld is not installed", allow_module_level=True)

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from ros_harness import Diagnostics  # noqa: E402
from ros_nodes import NodeProcess, node_logs  # noqa: E402
from vla_runtime_ros.sim_node import RESULT_QOS  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.sim]

NS = "/hv"
STEPS = 6


@pytest.fixture(scope="module")
def hybridvla_checkpoint(tmp_path_factory):
    from vla_runtime.checkpoints.tiny_prismatic import make_tiny_hybridvla

    return make_tiny_hybridvla(tmp_path_factory.mktemp("hybridvla") / "tiny-hybridvla", seed=0)


def test_hybridvla_drives_metaworld_with_the_simulators_state(harness, tmp_path, hybridvla_checkpoint):
    results = harness.subscribe(DiagnosticStatus, f"{NS}/vla_sim/episode_result", RESULT_QOS)
    policy_diag = Diagnostics(harness, f"{NS}/vla_policy")
    policy = NodeProcess(
        "policy_node",
        dict(checkpoint=str(hybridvla_checkpoint), device="cpu", torch_threads=1, control_rate_hz=10.0, use_joint_state=True),
        tmp_path, name="vla_policy", namespace=NS,
    )
    sim = NodeProcess(
        "sim_node",
        dict(task="button-press-v3", seed=1, episodes=1, max_steps=STEPS, camera="corner2", resolution=[64, 64],
             result_subscribers=1),  # this test's results subscription: the run is short
        tmp_path, name="vla_sim", namespace=NS, extra_args=("-r", "action:=vla_policy/action"),
    )
    try:
        result = results.wait(1, 180, "the episode result", explain=node_logs(sim, policy, diag=policy_diag))[0]
        _, policy_values = policy_diag.wait(lambda s, v: int(v["steps"]) >= STEPS, what="the policy's steps")
    finally:
        sim_code, _ = sim.interrupt()
        policy_code, _ = policy.interrupt()
        sim.close()
        policy.close()
    values = {kv.key: kv.value for kv in result.values}
    assert (values["task"], values["steps"]) == ("button-press-v3", str(STEPS))
    assert policy_values["bad_inputs"] == "0" and policy_values["inference_errors"] == "0"  # every state was accepted
    assert (sim_code, policy_code) == (0, 0)
