"""The life of a node's process: every node's ``main()`` is ``run_node(<factory>, args, ...)``.

``run`` starts rclpy without its signal handlers, builds the node, spins it on a background thread
and waits in the main thread for a reason to stop:

- SIGINT: Ctrl-C, ``ros2 launch`` shutting down, ``docker stop`` / ``systemctl stop`` set up as the
  README's ROS section shows;
- SIGTERM: plain ``docker stop`` / ``systemctl stop``, ``kill``, and with ``--exit-with-parent`` the
  death of the process that started this one (the kernel sends it; see ``exit_with_parent``); a parent
  that died while this process was still importing ends it before the node is built;
- the node asking to end (``Stop.request``: the simulator after its last episode);
- a crash: an exception out of a callback.

Then no callback runs any more (the executor is stopped) and the node is destroyed; nodes release
what they hold in ``destroy_node`` (the policy node deactivates, so its publishers stop, and shuts
down, releasing the model), and rclpy's context is destroyed with its DDS participant (which removes its
shared memory from ``/dev/shm``). The process exits 0 when told to stop or done, 1 when the node could
not start or crashed, with the reason on the last FATAL line (``launch_support`` repeats that line
when it stops ``ros2 launch`` with an error). A second signal while stopping is logged and ignored:
the stop waits for at most one inference step in flight. ``end_process`` then ends the process at
once, ignoring further stop signals and skipping the interpreter's teardown (see there).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Callable, NoReturn

import rclpy
from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.logging import get_logger
from rclpy.node import Node
from rclpy.signals import SignalHandlerOptions
from rclpy.task import Future
from rclpy.utilities import remove_ros_args

from . import PARENT_AT_START

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REAL_TIME_POLICIES = {getattr(os, name): name for name in ("SCHED_FIFO", "SCHED_RR") if hasattr(os, name)}


class NodeStartError(RuntimeError):
    """The node could not start (a failed configure, a bad parameter); the message says why."""


class Stop:
    """Why the process ends, set once (the first reason wins) from any thread or a signal handler."""

    WAKE_S = 0.2  # the longest a signal delivered to another thread waits for its handler (``wait``)

    def __init__(self) -> None:
        self.reason = ""
        self.code = 0
        self._lock = threading.RLock()  # a signal handler may interrupt request() in the main thread
        self._event = threading.Event()
        self.spin_future = Future()  # done at the stop: ends the executor's spin

    def request(self, reason: str, code: int = 0) -> bool:
        """End the process with exit ``code``; False when a stop was already requested."""
        with self._lock:
            if self._event.is_set():
                return False
            self.reason, self.code = reason, code
            self._event.set()
        self.spin_future.set_result(reason)
        return True

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        """Block the main thread until a stop is requested (signal handlers run meanwhile).

        It waits in slices of ``WAKE_S``: CPython runs a signal handler in the main thread only, but the
        kernel may hand a process-directed SIGINT or SIGTERM to any thread that does not block it (a DDS or
        torch thread). The main thread is then not interrupted, and a wait without a timeout sleeps through the
        signal for good; with slices the handler runs when the slice ends.
        """
        while not self._event.wait(self.WAKE_S):
            pass


def exit_with_parent() -> None:
    """Have the kernel send SIGTERM to this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    ``ros2 launch`` killed with SIGTERM or SIGKILL leaves its nodes running; with this they stop
    as they do on ``systemctl stop`` instead of driving the robot on without a supervisor. A parent
    that died before this call sends nothing: ``run`` compares the parent with ``PARENT_AT_START``
    afterwards. (The signal follows the parent *thread* that forked this process.)
    """
    if not sys.platform.startswith("linux"):
        raise OSError(f"--exit-with-parent needs Linux's prctl(PR_SET_PDEATHSIG); this is {sys.platform}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def parse_process_args(args: list[str]) -> argparse.Namespace:
    """The process's own options (those outside ``--ros-args``); ``args[0]`` is the program."""
    parser = argparse.ArgumentParser(prog=os.path.basename(args[0]) if args else None)
    parser.add_argument(
        "--exit-with-parent", action="store_true",
        help="stop (as on SIGTERM) when the parent process ends; launch files pass it",
    )
    return parser.parse_args(remove_ros_args(args)[1:])


def run(make_node: Callable[[Stop], Node], args: list[str] | None = None, *, name: str, threads: int) -> int:
    """Run the node ``make_node(stop)`` builds until a stop (see the module docstring); the exit code.

    ``name`` names the logger used before the node exists; ``threads`` sizes the executor (1: every
    callback on one thread).
    ``make_node`` raises ``NodeStartError`` (or ``ValueError``/``KeyError`` for a bad parameter,
    ``OSError``/``ImportError``/``RuntimeError`` for a model that does not load) when the node cannot start.
    """
    args = list(sys.argv if args is None else args)
    options = parse_process_args(args)
    stop = Stop()
    parent = PARENT_AT_START

    def on_signal(signum: int, frame) -> None:
        reason = signal.Signals(signum).name
        if signum == signal.SIGTERM and os.getppid() != parent:
            reason += " (the parent process ended)"
        if not stop.request(f"{reason} received"):
            get_logger(name).warning(f"{reason} received while stopping ({stop.reason}); still stopping")

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    ros = node = None
    try:
        ros = rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
        with ros:
            logger = get_logger(name)
            _warn_if_real_time(logger, threads)
            try:
                if options.exit_with_parent:
                    exit_with_parent()
                    if os.getppid() != parent:
                        logger.info(f"stopping: the parent process (pid {parent}) ended while this one was starting")
                        return 0
                node = make_node(stop)
            except (RuntimeError, ValueError, KeyError, OSError, ImportError) as e:  # NodeStartError is a RuntimeError
                reason = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) adds quotes
                logger.fatal(f"could not start: {reason}")
                return 1
            _spin_until_stopped(node, stop, threads)
            node.get_logger().info(f"stopping: {stop.reason}")
            node.destroy_node()
            if stop.code:
                node.get_logger().fatal(f"exiting with code {stop.code}: {stop.reason}")
            return stop.code
    finally:
        if ros is not None:
            # The DDS participant is deleted now, not by the interpreter's teardown that end_process skips, and
            # Fast DDS removes its shared memory (segments, ports) from /dev/shm: left there, every node process
            # that ever exited would hold 0.5-33 MB of tmpfs, which is RAM, until the machine restarts. rcl's
            # context (and with it the participant) goes with the last object holding it: the context, and the
            # node's objects, some of which only the cycle collector frees (callbacks bound to the node).
            node = None
            ros.context.destroy()
            gc.collect()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_node(make_node: Callable[[Stop], Node], args: list[str] | None = None, *, name: str, threads: int) -> NoReturn:
    """Every node's ``main``: ``run`` the node, then ``end_process`` with its exit code."""
    end_process(run(make_node, args, name=name, threads=threads))


def end_process(code: int) -> NoReturn:
    """End this node process with ``code`` now that ``run`` returned: the node is destroyed and rclpy
    shut down, so nothing is left but the interpreter's teardown, which is skipped.

    Freeing every module (torch, transformers, the DDS libraries) took 1.6-2 s for a lone planner node
    on a 2-core machine busy with a training job, and over 5 s with two bringups running beside it,
    with the default SIGTERM action back in place: ``ros2 launch`` escalated its SIGINT to SIGTERM,
    killed the process (exit code -15) and reported a clean run as a failure. Here stop signals are ignored, logs flushed, and the process exits at once. ``atexit``
    handlers do not run: a node releases what it holds in ``destroy_node``.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # no stream, or a closed pipe: nothing more to say
            pass
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).fflush(None)  # C stdio too: rcutils writes the console log with it
    os._exit(code)


def _warn_if_real_time(logger, threads: int) -> None:
    """Warn when a multi-threaded node runs under a real-time policy (inherited, or ``chrt``).

    rclpy's ``MultiThreadedExecutor`` (9.1) hands a ready callback to its thread pool and, until a pool
    thread has started it, hands it over again without waiting (ros2/rclpy#1452). A pool thread of equal
    real-time priority cannot preempt that loop: with every CPU busy (two such nodes on two cores) no
    callback ever runs again. Measured (issue 13): the policy nodes of two bringups, SCHED_FIFO 99 inherited
    from the test process, stopped logging; py-spy showed the spin thread running (~90 % CPU, RT throttling's
    share) and a pool thread runnable but never scheduled.
    """
    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    if threads != 1 and policy in REAL_TIME_POLICIES:
        logger.warning(
            f"this process runs under the real-time policy {REAL_TIME_POLICIES[policy]} (priority "
            f"{os.sched_getparam(0).sched_priority}): its executor's threads busy-wait for each other and can stop "
            "every callback on a busy machine; run the node under SCHED_OTHER"
        )


def _spin_until_stopped(node: Node, stop: Stop, threads: int) -> None:
    """Spin ``node`` on a background thread until ``stop``; returns once no callback runs any more."""
    executor = SingleThreadedExecutor() if threads == 1 else MultiThreadedExecutor(num_threads=threads)
    executor.add_node(node)

    def spin() -> None:
        try:
            executor.spin_until_future_complete(stop.spin_future)
        except Exception as e:  # noqa: BLE001 - a crash ends the process with code 1, the node released first
            node.get_logger().error(traceback.format_exc())
            stop.request(f"crashed: {type(e).__name__}: {e}", code=1)

    thread = threading.Thread(target=spin, name="executor-spin")
    thread.start()
    stop.wait()
    thread.join()
    executor.shutdown()  # joins the executor's threads: every callback has returned
