"""The KEEP planner node over real rclpy: memory updates (good and bad) and a goal in, the next
subtask out on `instruction` only when it changes. A tiny random LLaMA with a word-level tokenizer
stands in for the planner LLM (the real SmolLM2 path is tested in tests/memory)."""

import json

import pytest

pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from ros_harness import Diagnostics, wait_for  # noqa: E402
from ros_test_planner import MEMORY, write_tiny_planner  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from vla_runtime_ros.planner_node import LATCHED_QOS, UPDATE_QOS, PlannerNode  # noqa: E402

pytestmark = pytest.mark.ros

NS = "/keep"


def test_planner_node_plans_from_goal_and_memory_and_rejects_bad_updates(harness, tmp_path):
    model = write_tiny_planner(tmp_path / "tiny-planner")
    node = PlannerNode(
        context=harness.context, namespace=NS,
        parameter_overrides=[Parameter("model", value=str(model)), Parameter("tick_hz", value=20.0),
                             Parameter("diagnostics_rate_hz", value=10.0), Parameter("torch_threads", value=1),
                             Parameter("max_new_tokens", value=6), Parameter("max_update_bytes", value=4096)],
    )  # fmt: skip
    diag = Diagnostics(harness, f"{NS}/vla_planner")
    instructions = harness.subscribe(String, f"{NS}/instruction", LATCHED_QOS)
    plans = harness.subscribe(String, f"{NS}/vla_planner/plan", 10)
    harness.add(node)
    try:
        updates = harness.publisher(String, f"{NS}/memory_update", UPDATE_QOS)
        goals = harness.publisher(String, f"{NS}/goal", LATCHED_QOS)
        updates.publish(String(data=json.dumps({"updates": [{"id": k, "text": v} for k, v in MEMORY.items()]})))
        diag.wait(lambda s, v: v["updates_applied"] == "1" and v["memory_segments"] == "3", 60, what="the memory")

        bad = [
            ("{not json", "not valid JSON"),
            ('{"updates": [{"id": "obj:Mug"}]}', "exactly the keys id and text"),
            (json.dumps({"updates": [{"id": "x", "text": "y" * 5000}]}), "bytes; the limit is 4096"),
            (json.dumps({"deletes": ["obj:Nope"]}), "no such segments"),  # valid schema, fails when applied
        ]
        for count, (raw, message) in enumerate(bad, start=1):
            updates.publish(String(data=raw))
            status, _ = diag.wait(lambda s, v, n=count: v["updates_rejected"] == str(n), 30, what=f"rejection {count}")
            assert status.level == DiagnosticStatus.ERROR and message in status.message, status.message
        assert len(node.memory) == 3  # nothing of the bad updates was applied

        goal = "put the apple on the table"
        goals.publish(String(data=goal))
        first = instructions.wait(1, 60, "the first subtask")[0].data
        plan = json.loads(plans.wait(1, 10, "the plan report")[0].data)
        assert plan["instruction"] == first and plan["changed"] is True
        assert set(plan["retrieved"]) == set(MEMORY)

        # the node plans exactly what the library planner plans on the same memory
        from vla_runtime.memory.planner import Planner, PlannerConfig

        expected = Planner(node.planner.llm, node.memory, PlannerConfig(max_new_tokens=6)).next_subtask(goal)
        assert first == expected.instruction

        # memory changes re-plan; an instruction goes out only for a changed subtask
        for i in range(3):
            updates.publish(String(data=json.dumps({"updates": [{"id": "obj:Apple", "text": MEMORY["obj:Apple"].replace("none", f"state{i}")}], "advance": 1})))
            plans.wait(2 + i, 60, f"plan {2 + i}")
        reports = [json.loads(m.data) for m in plans.wait(4, 1)]
        published = [m.data for m in instructions.wait(1, 1)]
        wait_for(lambda: len(instructions) == sum(r["changed"] for r in reports), 5, "every changed plan published")
        published = [r.msg.data for r in instructions.items]
        assert published == [r["instruction"] for r in reports if r["changed"]]
        assert all(a.lower() != b.lower() for a, b in zip(published, published[1:]))
        _, values = diag.wait(lambda s, v: v["plans"] == "4", 10, what="four plans")
        assert values["published"] == str(len(published)) and values["goal"] == goal
    finally:
        harness.remove(node)
