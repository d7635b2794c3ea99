"""The simulator node runs a memory task like any other: the episode's own instruction, the camera its cues are
made for, and an episode driven over the action topic to the task's judged success."""

import importlib.util

import numpy as np
import pytest

pytest.importorskip("rclpy")
# find_spec, not importorskip: importing metaworld here would load mujoco before the simulator picks its GL backend
if importlib.util.find_spec("metaworld") is None:
    pytest.skip("metaworld is not installed", allow_module_level=True)

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from ros_harness import wait_for  # noqa: E402
from std_msgs.msg import Float32MultiArray, String  # noqa: E402
from vla_runtime.sim import MEMORY_TASKS, MetaWorldConfig, MetaWorldEnv  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402
from vla_runtime_ros.sim_node import ACTION_QOS, LATCHED_QOS, RESULT_QOS, SimNode  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.sim]

NS = "/memory"
TASK, SEED = "memory-counting", 4


def expert_actions() -> list[np.ndarray]:
    """The expert's episode, recorded in a state-only simulator: the node's simulator replays it exactly."""
    with MetaWorldEnv(MetaWorldConfig(cameras=())) as env:
        env.reset(TASK, SEED)
        actions, done, success = [], False, False
        while not done:
            actions.append(env.expert_action().astype(np.float32))
            _, done, success, _ = env.step(actions[-1])
    assert success
    return actions


def test_sim_node_runs_a_memory_episode(harness):
    actions = expert_actions()
    instructions = harness.subscribe(String, f"{NS}/instruction", LATCHED_QOS)
    results = harness.subscribe(DiagnosticStatus, f"{NS}/vla_sim/episode_result", RESULT_QOS)
    sim = SimNode(
        context=harness.context, namespace=NS,
        parameter_overrides=[Parameter("task", value=TASK), Parameter("seed", value=SEED), Parameter("resolution", value=[32, 32]),
                             Parameter("policy_reset_service", value="")],
    )  # fmt: skip
    harness.executor.add_node(sim)
    try:
        assert sim.env.cameras == ["corner"]  # the memory tasks' camera when none is set
        (msg,) = instructions.wait(1, 20, "the instruction")
        assert msg.data == MEMORY_TASKS[TASK].sample(SEED).instruction()
        publisher = harness.publisher(Float32MultiArray, f"{NS}/action", ACTION_QOS)
        for i, action in enumerate(actions, start=1):
            publisher.publish(conversions.actions_to_msg(action))
            wait_for(lambda i=i: sim.steps >= i or not sim.running, 20, f"step {i}")
        (result,) = results.wait(1, 20, "the episode result")
    finally:
        harness.executor.remove_node(sim)
        sim.env.close()
        sim.destroy_node()
    values = {kv.key: kv.value for kv in result.values}
    assert result.level == DiagnosticStatus.OK and values["success"] == "True" and values["steps"] == str(len(actions))
