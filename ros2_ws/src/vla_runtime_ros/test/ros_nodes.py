"""Node subprocesses for the ROS tests: ``python -m vla_runtime_ros.<module> --ros-args ...``, as ``ros2 launch`` starts
them, tied to the test process's life and time-shared, with their output kept for failure messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml
from ros_harness import PATIENCE, ROS_ARGS_QUIET, Diagnostics, subprocess_env


# Node processes start under the default time-sharing policy whatever the test process runs under: a
# real-time policy (SCHED_FIFO/RR) is inherited by every thread of the node, and rclpy's
# MultiThreadedExecutor busy-waits for its pool threads (ros2/rclpy#1452), which at equal real-time
# priority on busy CPUs never run: the node livelocks (issue 13's two-bringup hang). `ros2 launch` from a
# shell or a service starts them time-shared too. The wrapper resets the policy and execs the node (same pid).
TIME_SHARING = (
    (sys.executable, "-S", "-c",
     "import os, sys; os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)); os.execv(sys.argv[1], sys.argv[1:])")
    if hasattr(os, "sched_setscheduler") else ()
)
EXIT_WITH_PARENT = "--exit-with-parent"


class NodeProcess:
    """``python -m vla_runtime_ros.<module> [process_args] --ros-args --params-file <yaml>`` in a subprocess.

    Every node runs with ``--exit-with-parent`` (the kernel stops it when the process that started it ends:
    this test process, or ``launcher``), so no node outlives a test run that was killed, and under
    ``SCHED_OTHER`` (see ``TIME_SHARING``). The death signal follows the *thread* that started the node:
    start nodes from the test's own thread, not from a helper thread that ends before them.

    ``launcher``: a command the node is started through (its parent), e.g. ``(sys.executable, "-c", ...)``.
    """

    def __init__(self, module: str, params: dict, tmp: Path, *, name: str, namespace: str = "/", extra_args: tuple = (),
                 process_args: tuple = (), launcher: tuple = ()) -> None:
        self.params_file = tmp / f"{name}_params.yaml"
        self.params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
        self.log_path = tmp / f"{name}.log"
        if EXIT_WITH_PARENT not in process_args:
            process_args = (*process_args, EXIT_WITH_PARENT)
        self.args = [
            *TIME_SHARING, *launcher, sys.executable, "-m", f"vla_runtime_ros.{module}", *process_args,
            "--ros-args", "--params-file", str(self.params_file),
            "-r", f"__node:={name}", "-r", f"__ns:={namespace}", *ROS_ARGS_QUIET, *extra_args,
        ]
        env = subprocess_env()
        self._log = self.log_path.open("w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout: float = 0.0) -> int:
        return self.proc.wait(timeout=PATIENCE.timeout(timeout))

    def wait_active(self, diag: "Diagnostics") -> None:
        """Wait for the node to report itself active; its start-up time scales later waits (``PATIENCE``)."""
        diag.wait(lambda s, v: v.get("state") == "active", PATIENCE.timeout(120.0), what=f"{diag.name} active\n{self.output()}")
        PATIENCE.observe(time.monotonic() - self.started, factor=3.0)

    def interrupt(self, timeout: float = 0.0, signum: int = signal.SIGINT) -> tuple[int, float]:
        """SIGINT (Ctrl-C) or ``signum``; returns (exit code, seconds it took). Kills it and raises if it hangs."""
        timeout = PATIENCE.timeout(timeout)
        start = time.monotonic()
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.args} did not exit within {timeout:.0f} s of {signal.Signals(signum).name}:\n{self.output()}") from None
        return code, time.monotonic() - start

    def close(self) -> None:
        """Stop the node as ``ros2 launch`` does, SIGINT first (SIGKILL only if it does not exit), and close its log.

        A node that exits cleanly destroys its DDS participant: its endpoints leave at once (the harness stops
        writing to them) and Fast DDS removes its shared-memory segments and ports from ``/dev/shm``. A SIGKILLed
        node leaves about three such files behind, and the harness, a participant living for the whole session,
        goes on matching it until its lease expires.
        """
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=PATIENCE.timeout())
            except subprocess.TimeoutExpired:  # a node that hangs on SIGINT fails the tests that check that, not this
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def node_logs(*procs: NodeProcess, diag: Diagnostics | None = None) -> Callable[[], str]:
    """For ``Collector.wait(explain=...)``: each process's output and ``diag``'s newest status, read at the timeout."""
    def text() -> str:
        parts = [f"--- {p.log_path.name}:\n{p.output()}" for p in procs]
        if diag is not None and diag.statuses:
            parts.append(f"--- last status: {[(kv.key, kv.value) for kv in diag.statuses[-1].values]}")
        return "\n".join(parts)
    return text
