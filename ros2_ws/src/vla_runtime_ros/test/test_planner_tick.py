"""The planner node's tick (``PlannerNode._on_tick``) without DDS: the node's state on a stub, a planner whose
plans the test releases, publishers that record."""

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("std_srvs")

from std_srvs.srv import Trigger  # noqa: E402
from vla_runtime.memory import EmbodiedMemory, SentenceEncoder  # noqa: E402
from vla_runtime.memory.messages import SubtaskTracker, UpdateLimits, parse_memory_update  # noqa: E402
from vla_runtime_ros.planner_node import PlannerNode  # noqa: E402


class Recorder:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def publish(self, msg) -> None:
        self.sent.append(msg.data)


class HeldPlanner:
    """Plans "step for <goal>" once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def next_subtask(self, goal: str, done: list[str]):
        assert self.release.wait(timeout=120), "the test never released the plan"
        return SimpleNamespace(instruction=f"step for {goal}", ttft_ms=1.0, total_ms=1.0, retrieved=(),
                               prefill=SimpleNamespace(recompute_share=0.0))  # fmt: skip


@pytest.fixture
def node():
    """``PlannerNode``'s methods over the state they read, no rclpy node."""
    stub = SimpleNamespace(
        memory=EmbodiedMemory(SentenceEncoder()), planner=HeldPlanner(), tracker=SubtaskTracker(), issued=[], goal="",
        _dirty=False, _future=None, last_plan=None, last_error="", _lock=threading.Lock(), _pending=deque(),
        _new_goal=None, _worker=ThreadPoolExecutor(max_workers=1), _instruction_pub=Recorder(), _plan_pub=Recorder(),
        limits=UpdateLimits(), rejected=[], counts={"plans": 0, "published": 0, "updates_applied": 0, "updates_rejected": 0},
        get_logger=lambda: SimpleNamespace(info=lambda *a, **k: None),
    )  # fmt: skip
    for name in ("_on_tick", "_finish_plan", "_on_reset", "_on_goal"):
        setattr(stub, name, getattr(PlannerNode, name).__get__(stub))
    stub._reject = lambda message, update=False: stub.rejected.append(message)
    stub.memory.add("obj:Mug", "The mug is in the sink.")
    yield stub
    stub.planner.release.set()
    stub._worker.shutdown()


def test_a_plan_for_a_goal_reset_while_it_ran_is_not_published(node):
    node._new_goal = "make coffee"
    node._on_tick()  # the plan starts
    node._on_reset(Trigger.Request(), Trigger.Response())
    node.planner.release.set()
    node._future.result(timeout=120)
    node._on_tick()
    assert node.goal == "" and node._instruction_pub.sent == []  # nothing for the forgotten goal
    node._new_goal = "make tea"
    node._on_tick()
    node._future.result(timeout=120)
    node._on_tick()
    assert node._instruction_pub.sent == ["step for make tea"]


def test_an_update_that_fails_while_it_applies_is_reported_and_the_node_goes_on(node, monkeypatch):
    update = parse_memory_update('{"updates": [{"id": "obj:Apple", "text": "The apple is on the table."}]}')
    monkeypatch.setattr(node.memory, "upsert", lambda *a: (_ for _ in ()).throw(RuntimeError("encoder failed")))
    node._pending.append(update)
    node._on_tick()  # no exception leaves the timer callback (the runner would end the node)
    assert node.rejected == ["memory update failed: RuntimeError: encoder failed"]


def test_a_goal_published_again_starts_its_plan_over(node):
    """The simulator in a bringup publishes its task as the goal at every episode; a repeat of the same goal (the
    next episode of one task) must not inherit the last episode's finished subtasks."""
    node._on_goal(SimpleNamespace(data="make coffee"))
    node._on_tick()
    node.planner.release.set()
    node._future.result(timeout=120)
    node._on_tick()
    assert node._instruction_pub.sent == ["step for make coffee"] and node.issued == ["step for make coffee"]
    node._on_goal(SimpleNamespace(data="make coffee"))  # the next episode
    node._on_tick()
    assert node.issued == [] and node.tracker.current is None  # forgotten before the new plan
    node._future.result(timeout=120)
    node._on_tick()
    assert node._instruction_pub.sent == ["step for make coffee"] * 2  # published again for the new episode
