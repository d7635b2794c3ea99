"""``vla_planner_node``: the KEEP planner (goal + memory -> next subtask) behind ROS topics.

Interfaces (relative names; in one namespace with ``vla_policy`` its ``instruction`` output is the
policy node's ``instruction`` input):

====  ===============  ==============================  ================================================
dir   name             type                            notes
====  ===============  ==============================  ================================================
in    goal             std_msgs/String                 reliable + transient local; a goal (new, or the
                                                       same again) starts a new plan (the subtasks issued
                                                       so far are forgotten)
in    memory_update    std_msgs/String                 reliable, depth 100; JSON (schema below); a bad
                                                       one is rejected whole with an ERROR diagnostic
out   instruction      std_msgs/String                 reliable + transient local; the next subtask,
                                                       published only when it changes
out   ~/plan           std_msgs/String                 JSON of every plan (instruction, changed, ttft_ms,
                                                       total_ms, recompute_share, retrieved, step)
out   /diagnostics     diagnostic_msgs/DiagnosticArray  ``diagnostics_rate_hz``, and at once on a rejection
srv   ~/reset          std_srvs/Trigger                forget the goal and the subtasks issued
====  ===============  ==============================  ================================================

Memory update (see ``vla_runtime.memory.messages``)::

    {"updates": [{"id": "obj:Apple", "text": "{'object': 'Apple', ...}"}], "deletes": ["obj:Mug"], "advance": 1}

Threads: subscription callbacks only validate and queue. A timer (its own callback group) applies
queued updates and starts a plan on a one-thread worker when the goal or the memory changed and no
plan is running; the memory is touched only by that timer while the worker is idle, and by the
worker while it plans. Each plan lists the subtasks issued since the goal as done (LoTA-style
history), so the plan moves on once the policy's current subtask is replaced.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a program: set the process up for the pip ROS wheels before rclpy loads
    from vla_runtime_ros._env import ensure

    ensure()

import json  # noqa: E402
import threading  # noqa: E402
from collections import deque  # noqa: E402
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402
from typing import NoReturn  # noqa: E402

import torch  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue  # noqa: E402
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from vla_runtime.checkpoints.causal_lm import load_causal_lm  # noqa: E402
from vla_runtime.device import resolve_device  # noqa: E402
from vla_runtime.memory import EmbodiedMemory, MemoryConfig, PrefillConfig, SentenceEncoder  # noqa: E402
from vla_runtime.memory.messages import (  # noqa: E402
    MemoryUpdate,
    MemoryUpdateError,
    SubtaskTracker,
    UpdateLimits,
    apply_memory_update,
    parse_memory_update,
)
from vla_runtime.memory.planner import Planner, PlannerConfig, PlanStep  # noqa: E402

from . import conversions  # noqa: E402
from .param_specs import declare_config, read_config  # noqa: E402
from .params import PlannerNodeConfig  # noqa: E402
from .runner import run_node  # noqa: E402

LATCHED_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
UPDATE_QOS = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)


class PlannerNode(Node):
    """Plans the next subtask whenever the goal or the memory changes; publishes it when it changes."""

    def __init__(self, node_name: str = "vla_planner", **kwargs) -> None:
        self._worker: ThreadPoolExecutor | None = None  # destroy_node runs even when __init__ failed
        super().__init__(node_name, **kwargs)
        declare_config(self, PlannerNodeConfig)
        self.cfg = read_config(self, PlannerNodeConfig)
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        device = resolve_device(None if self.cfg.device == "auto" else self.cfg.device)
        llm = load_causal_lm(self.cfg.model, device=device, dtype=torch.float32)
        encoder = SentenceEncoder(self.cfg.encoder or None, device=device)
        self.memory = EmbodiedMemory(encoder, MemoryConfig(top_k=self.cfg.top_k, static_after=self.cfg.static_after))
        self.planner = Planner(
            llm, self.memory, PlannerConfig(prefill=PrefillConfig(method=self.cfg.method), max_new_tokens=self.cfg.max_new_tokens)
        )
        self.limits = UpdateLimits(max_bytes=self.cfg.max_update_bytes)
        self.tracker = SubtaskTracker()
        self.issued: list[str] = []  # subtasks published since the goal
        self.goal = ""
        self.counts = {"plans": 0, "published": 0, "updates_applied": 0, "updates_rejected": 0}
        self.last_error = ""
        self.last_plan: PlanStep | None = None
        self._lock = threading.Lock()  # guards what callbacks hand to the timer
        self._pending: deque[MemoryUpdate] = deque()
        self._new_goal: str | None = None
        self._dirty = False
        self._future: Future | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")

        inputs, ticks, misc = (MutuallyExclusiveCallbackGroup() for _ in range(3))
        self._instruction_pub = self.create_publisher(String, "instruction", LATCHED_QOS)
        self._plan_pub = self.create_publisher(String, "~/plan", 10)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_subscription(String, "goal", self._on_goal, LATCHED_QOS, callback_group=inputs)
        self.create_subscription(String, "memory_update", self._on_memory_update, UPDATE_QOS, callback_group=inputs)
        self.create_service(Trigger, "~/reset", self._on_reset, callback_group=misc)
        self.create_timer(1.0 / self.cfg.tick_hz, self._on_tick, callback_group=ticks)
        self.create_timer(1.0 / self.cfg.diagnostics_rate_hz, self._publish_diagnostics, callback_group=misc)
        self.get_logger().info(f"planner ready: {self.cfg.model} ({self.cfg.method}) on {device}")

    # ------------------------------------------------------------------ callbacks (validate and queue)
    def _on_goal(self, msg: String) -> None:
        try:
            text = conversions.instruction_text(msg.data)
        except ValueError as e:
            self._reject(f"goal rejected: {e}")
            return
        with self._lock:
            self._new_goal = text
        self.get_logger().info(f"goal: {text!r}")

    def _on_memory_update(self, msg: String) -> None:
        try:
            update = parse_memory_update(msg.data, self.limits)
        except MemoryUpdateError as e:
            self._reject(f"memory update rejected: {e}", update=True)
            return
        except Exception as e:  # noqa: BLE001 - one bad message never ends the node; said, with its type
            self._reject(f"memory update rejected: {type(e).__name__}: {e}", update=True)
            return
        with self._lock:
            self._pending.append(update)

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._lock:
            self._new_goal = ""
        response.success, response.message = True, "goal and issued subtasks forgotten"
        return response

    def _reject(self, message: str, *, update: bool = False) -> None:
        with self._lock:
            self.counts["updates_rejected"] += update
            self.last_error = message
        self.get_logger().error(message, throttle_duration_sec=1.0)
        self._publish_diagnostics()

    # ------------------------------------------------------------------ the planning loop
    def _on_tick(self) -> None:
        if self._future is not None:
            if not self._future.done():
                return
            future, self._future = self._future, None
            with self._lock:  # a goal set (or reset, or the same one again) while it planned: that plan is stale
                superseded = self._new_goal is not None
            if superseded:
                self.get_logger().info(f"a plan for the previous goal {self.goal!r} is dropped")
            else:
                self._finish_plan(future)
        with self._lock:
            updates, goal = list(self._pending), self._new_goal
            self._pending.clear()
            self._new_goal = None
        if goal is not None:  # a goal published again starts its plan over (a simulator's next episode of one task)
            self.goal, self.issued = goal, []
            self.tracker.reset()
            self._dirty = bool(goal)
        for update in updates:
            try:
                summary = apply_memory_update(self.memory, update)
            except MemoryUpdateError as e:
                self._reject(f"memory update rejected: {e}", update=True)
                continue
            except Exception as e:  # noqa: BLE001 - one update must not take the node down; it is reported
                self._reject(f"memory update failed: {type(e).__name__}: {e}", update=True)
                self._dirty = True  # it may have applied part of itself
                continue
            with self._lock:
                self.counts["updates_applied"] += 1
            self._dirty |= bool(summary.changed or summary.deleted or update.advance)
        if self._dirty and self.goal:
            self._dirty = False
            self._future = self._worker.submit(self.planner.next_subtask, self.goal, list(self.issued))

    def _finish_plan(self, future: Future) -> None:
        try:
            step: PlanStep = future.result()
        except Exception as e:  # noqa: BLE001 - a failing plan must not take the node down; it is reported
            self._reject(f"planning failed: {e}")
            return
        self.last_plan = step
        changed = self.tracker.update(step.instruction)
        if changed:
            self._instruction_pub.publish(String(data=step.instruction))
            self.issued.append(step.instruction)
        with self._lock:
            self.counts["plans"] += 1
            self.counts["published"] += changed
            self.get_logger().info(f"subtask: {step.instruction!r} ({step.ttft_ms:.0f} ms to first token)")
        self._plan_pub.publish(String(data=json.dumps({
            "instruction": step.instruction, "changed": changed, "ttft_ms": round(step.ttft_ms, 1),
            "total_ms": round(step.total_ms, 1), "recompute_share": round(step.prefill.recompute_share, 3),
            "retrieved": list(step.retrieved), "step": self.memory.step,
        })))  # fmt: skip

    # ------------------------------------------------------------------ diagnostics
    def _publish_diagnostics(self) -> None:
        # snapshot and publish under the lock: the timer and _reject both report, and a status taken before
        # another must not be published after it (the counters would arrive without their error)
        with self._lock:
            error, self.last_error = self.last_error, ""
            counts = dict(self.counts)
            self._publish_status(error, counts)

    def _publish_status(self, error: str, counts: dict) -> None:
        """One DiagnosticArray with this status (caller holds ``_lock``)."""
        plan = self.last_plan
        values = {
            **counts,
            "goal": self.goal,
            "subtask": self.tracker.current or "",
            "memory_segments": len(self.memory),
            "memory_step": self.memory.step,
            "planning": self._future is not None,
            "ttft_ms_last": f"{plan.ttft_ms:.1f}" if plan else "",
            "recompute_share_last": f"{plan.prefill.recompute_share:.3f}" if plan else "",
            "last_error": error,
        }
        status = DiagnosticStatus(
            level=DiagnosticStatus.ERROR if error else DiagnosticStatus.OK,
            name=f"{self.get_fully_qualified_name()}: planner",
            message=error or (f"subtask: {self.tracker.current}" if self.tracker.current else "waiting for a goal"),
            hardware_id=self.cfg.model,
            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()],
        )
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(msg)

    def destroy_node(self) -> None:
        """Stop planning (a plan in flight finishes, nothing more is published), then destroy the node."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
        super().destroy_node()


def main(args: list[str] | None = None) -> NoReturn:
    """``python -m vla_runtime_ros.planner_node --ros-args -p model:=DIR`` (or ``ros2 run``); see ``runner``."""
    run_node(lambda stop: PlannerNode(), args, name="vla_planner", threads=3)


if __name__ == "__main__":
    main()
