"""Two arms side by side: the nodes ``vla_bringup.launch.py`` starts for ``namespace:=left`` and for
``namespace:=right``, each started as a process with the name, namespace, remappings and process
arguments the launch file gives it (evaluated without the launch system, see ``launch_shim``).

Each planner's subtask for its own goal becomes its own policy's episode, and only that one: the
graph connects each namespace's planner to that namespace's policy, and no instruction crosses over.
"""

from pathlib import Path

import pytest

pytest.importorskip("rclpy")

from launch_shim import evaluate  # noqa: E402
from ros_harness import Diagnostics, wait_for  # noqa: E402
from ros_nodes import NodeProcess  # noqa: E402
from ros_test_planner import write_tiny_planner  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from vla_runtime_ros.planner_node import LATCHED_QOS  # noqa: E402

pytestmark = pytest.mark.ros

BRINGUP = Path(__file__).resolve().parents[4] / "launch" / "vla_bringup.launch.py"
GOALS = {"left": "put the apple on the table", "right": "open the fridge"}


def bringup(monkeypatch, tmp: Path, arm: str, params: dict[str, dict]) -> dict[str, NodeProcess]:
    """The processes of one arm's bringup (sim:=false), keyed by executable; ``params`` per executable."""
    run = evaluate(BRINGUP, monkeypatch, namespace=arm)
    procs = {}
    for node in run.nodes:
        executable = node.kwargs["executable"]
        remaps = [arg for source, target in run.value(node.kwargs.get("remappings") or []) for arg in ("-r", f"{source}:={target}")]
        procs[executable] = NodeProcess(
            executable, params[executable], tmp / arm, name=run.value(node.kwargs["name"]),
            namespace="/" + run.value(node.kwargs["namespace"]), extra_args=tuple(remaps),
            process_args=tuple(node.kwargs["arguments"]),
        )
    return procs


def endpoints(infos) -> set[str]:
    """Fully qualified names of the nodes behind topic endpoints, the harness left out."""
    names = {f"{i.node_namespace.rstrip('/')}/{i.node_name}" for i in infos}
    return names - {"/test_harness"}


def test_two_namespaced_bringups_do_not_cross_talk(harness, tmp_path, monkeypatch, policy_checkpoints):
    model = write_tiny_planner(tmp_path / "tiny-planner")
    params = {
        "planner_node": dict(model=str(model), device="cpu", torch_threads=1, max_new_tokens=6, tick_hz=20.0),
        "policy_node": dict(checkpoint=str(policy_checkpoints["single"]), policy_modules=["ros_test_policy"],
                            control_rate_hz=20.0, diagnostics_rate_hz=10.0),
    }
    for arm in GOALS:
        (tmp_path / arm).mkdir()
    arms = {arm: bringup(monkeypatch, tmp_path, arm, params) for arm in GOALS}
    instructions = {arm: harness.subscribe(String, f"/{arm}/instruction", LATCHED_QOS) for arm in GOALS}
    subtasks = {}
    try:
        for arm, procs in arms.items():
            assert set(procs) == {"planner_node", "policy_node"}
            procs["policy_node"].wait_active(Diagnostics(harness, f"/{arm}/vla_policy"))
        for arm, goal in GOALS.items():  # latched: the planner gets its goal whenever it subscribes
            harness.publisher(String, f"/{arm}/goal", LATCHED_QOS).publish(String(data=goal))
        for arm, procs in arms.items():
            subtasks[arm] = instructions[arm].wait(1, what=f"{arm}'s subtask\n{procs['planner_node'].output()}")[0].data
            policy = procs["policy_node"]
            wait_for(lambda: f"episode 1: {subtasks[arm]!r}" in policy.output(), what=f"{arm}'s episode\n{policy.output()}")
        for arm in GOALS:  # the graph: each namespace's planner feeds that namespace's policy only
            wait_for(lambda: endpoints(harness.node.get_publishers_info_by_topic(f"/{arm}/instruction")) == {f"/{arm}/vla_planner"},
                     what=f"/{arm}/instruction published by /{arm}/vla_planner only")
            wait_for(lambda: endpoints(harness.node.get_subscriptions_info_by_topic(f"/{arm}/instruction")) == {f"/{arm}/vla_policy"},
                     what=f"/{arm}/instruction read by /{arm}/vla_policy only")
            assert endpoints(harness.node.get_subscriptions_info_by_topic(f"/{arm}/goal")) == {f"/{arm}/vla_planner"}
    finally:
        codes = {(arm, exe): proc.interrupt()[0] for arm, procs in arms.items() for exe, proc in procs.items()}
        for procs in arms.values():
            for proc in procs.values():
                proc.close()
    for arm, procs in arms.items():
        # one goal, one plan, one subtask: each policy received exactly its own planner's instruction
        received = [line for line in procs["policy_node"].output().splitlines() if "]: instruction: " in line]
        assert len(received) == 1 and received[0].endswith(f"instruction: {subtasks[arm]!r}"), received
    assert set(codes.values()) == {0}, codes
