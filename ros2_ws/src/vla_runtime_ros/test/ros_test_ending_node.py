"""A node run by ``vla_runtime_ros.runner.run`` in a process of its own, as every node is: it ends on its
first timer tick, by raising (``crash``) or by asking the runner to stop (``done``). The process prints
one JSON line saying what ``run`` returned and left behind, then exits 0.

``test_node_process`` runs it with ``python -m ros_test_ending_node MODE [--pretend-fifo]``. It used to
call ``run`` inside the test process, beside the harness's participant: a second Fast DDS participant
in one process, which a node process never has, and whose teardown once hung in
``rcl_node_fini`` -> ``destroy_participant`` for good (eProsima/Fast-DDS#6193 reports hangs in that
setting).
"""

import json
import os
import signal
import sys

from rclpy.node import Node
from ros_harness import ROS_ARGS_QUIET
from vla_runtime_ros.runner import run


class EndingNode(Node):
    """Ends on its first timer tick: by raising (a crash) or by asking the runner to stop."""

    def __init__(self, stop, crash: bool) -> None:
        super().__init__("ending_node")
        self.stop, self.crash, self.destroyed = stop, crash, False
        self.create_timer(0.01, self._tick)

    def _tick(self) -> None:
        if self.crash:
            raise RuntimeError("a bug in a callback")
        self.stop.request("the work is done")

    def destroy_node(self) -> None:
        self.destroyed = True
        super().destroy_node()


def main(argv: list[str]) -> None:
    mode, options = argv[0], argv[1:]
    if mode not in ("crash", "done") or set(options) - {"--pretend-fifo"}:
        sys.exit(f"usage: python -m ros_test_ending_node crash|done [--pretend-fifo], got {argv}")
    if "--pretend-fifo" in options:  # as if started under SCHED_FIFO (which needs privileges to do for real)
        os.sched_getscheduler = lambda pid: os.SCHED_FIFO
    nodes = []

    def make(stop):
        nodes.append(EndingNode(stop, crash=mode == "crash"))
        return nodes[0]

    previous = signal.getsignal(signal.SIGTERM)
    code = run(make, ["ending_node", "--ros-args", *ROS_ARGS_QUIET], name="ending_node", threads=2)
    report = {"code": code, "destroyed": bool(nodes) and nodes[0].destroyed,
              "handlers_restored": signal.getsignal(signal.SIGTERM) is previous}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
