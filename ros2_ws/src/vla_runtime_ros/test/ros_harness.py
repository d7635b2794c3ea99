"""Test harness for the ROS tests: a spinning harness node, /diagnostics, waiting without sleeps (node subprocesses:
``ros_nodes``; test messages: ``ros_messages``).

Everything here talks real rclpy over Fast DDS. Waiting is always for a condition (a message, a
matched endpoint, a service, a node's acknowledgement on /diagnostics), polled every 10 ms up to a
timeout that scales with what this machine measures, never a fixed sleep. What a node needs
continuously streams from harness timers; what is sent once is reliable or re-sent until acknowledged.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile

TEST_DIR = Path(__file__).resolve().parent
# the test modules, and the package sources when the package is not installed (see conftest)
SUBPROCESS_PATHS = [str(p) for p in sys.path if p in (str(TEST_DIR), str(TEST_DIR.parent))]
ROS_ARGS_QUIET = ["--disable-external-lib-logs"]  # no log files under ~/.ros


def subprocess_env() -> dict[str, str]:
    """This process's environment for a child Python process: the test folder (helper modules, test
    policies) on its path, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*SUBPROCESS_PATHS, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Patience:
    """How long to wait before calling something lost, scaled by how slow this machine is right now.

    Every wait is for a condition, never a sleep, so a generous timeout costs a passing run nothing; it
    only bounds how long a failing one takes. Routine work the tests measure (endpoint discovery, a
    node's start-up, a service round trip) raises every timeout to ``factor`` times the slowest seen,
    so a slow or loaded machine makes the suite slower, not red.
    """

    def __init__(self, floor: float = 30.0) -> None:
        self.floor = floor
        self.needed = 0.0

    def observe(self, seconds: float, factor: float = 20.0) -> None:
        """Routine work took ``seconds``; waits for things of that kind get ``factor`` times as long."""
        self.needed = max(self.needed, seconds * factor)

    def timeout(self, at_least: float = 0.0) -> float:
        return max(self.floor, at_least, self.needed)


PATIENCE = Patience()  # one per test process: the machine's slowness is a property of the process's machine


def wait_for(predicate: Callable[[], Any], timeout: float = 0.0, what: str = "a condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; ``TimeoutError`` naming ``what`` otherwise.

    ``timeout`` is a minimum: the wait lasts at least as long as ``PATIENCE`` allows on this machine.
    """
    timeout = PATIENCE.timeout(timeout)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.01)


def resend_until(publish: Callable[[], None], done: Callable[[], Any], what: str, *, hz: float = 10.0,
                 first: bool = True) -> Any:
    """``publish()`` again at ``hz`` until ``done()`` is truthy; returns its value.

    For messages a test sends once over a transport that may lose them (best-effort sensors, the first
    messages after discovery): the test repeats them, as a sensor would, until the receiver acknowledges.
    ``first=False`` waits one period before the first publish (for a message that may already be on its way).
    """
    deadline = time.monotonic() + PATIENCE.timeout()
    while True:
        if first:
            publish()
        first = True
        next_send = time.monotonic() + 1.0 / hz
        while time.monotonic() < next_send:
            value = done()
            if value:
                return value
            time.sleep(0.01)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {PATIENCE.timeout():.0f} s resending until {what}")


def camera_clock(hz: float, frames: int):
    """Yield ``frames`` times at ``hz`` (a camera's frame clock: sleeps until each frame is due)."""
    start = time.monotonic()
    for i in range(frames):
        time.sleep(max(0.0, start + i / hz - time.monotonic()))
        yield i


@dataclass
class Received:
    msg: Any
    t: float  # time.monotonic() at receipt


@dataclass
class Collector:
    """Every message of one subscription, with receipt times (thread-safe appends)."""

    items: list[Received] = field(default_factory=list)

    def __call__(self, msg: Any) -> None:
        self.items.append(Received(msg, time.monotonic()))

    def __len__(self) -> int:
        return len(self.items)

    def since(self, index: int) -> list[Any]:
        return [r.msg for r in self.items[index:]]

    def wait(self, count: int, timeout: float = 0.0, what: str = "messages",
             explain: Callable[[], str] | None = None) -> list[Any]:
        """Wait until at least ``count`` messages arrived in total; returns all of them.

        ``explain``: called at a timeout, its text added to the error (e.g. node logs as they are by then).
        """
        try:
            wait_for(lambda: len(self.items) >= count, timeout, f"{count} {what}")
        except TimeoutError as e:  # the count at the timeout, not at the start
            raise TimeoutError(f"{e} (got {len(self.items)})" + (f"\n{explain()}" if explain else "")) from None
        return [r.msg for r in self.items]


class Stream:
    """A sensor: publishes its current message on a harness timer at ``hz``, as a robot's drivers do.

    Tests never rely on one message arriving: what a node needs continuously (joint states, frames)
    streams, and ``set`` changes what streams from the next tick on (``None`` pauses it).
    """

    def __init__(self, harness: "Harness", msg_type: type, topic: str, qos: QoSProfile | int, hz: float, msg: Any = None) -> None:
        self.msg = msg
        self.sent = 0
        self.times: list[float] = []  # time.monotonic() of each publish
        self._publisher = harness.node.create_publisher(msg_type, topic, qos)
        self._timer = harness.node.create_timer(1.0 / hz, self._tick)

    def set(self, msg: Any) -> None:
        self.msg = msg

    def _tick(self) -> None:
        msg = self.msg
        if msg is not None:
            self._publisher.publish(msg)
            self.sent += 1
            self.times.append(time.monotonic())

    def close(self, harness: "Harness") -> None:
        with harness.paused():
            harness.node.destroy_timer(self._timer)
            harness.node.destroy_publisher(self._publisher)


class Harness:
    """A node spinning on a background thread, from which tests publish, subscribe and call.

    One single-threaded executor spins the harness node and any in-process node a test adds, so a
    callback never runs while the spin thread is paused: nodes, clients and timers are destroyed only
    then (destroying them while the executor builds its wait set is a race in rclpy), and the context
    is shut down only after the thread ended. An exception raised in any callback is recorded in
    ``errors``; the ROS conftest fails the test during which it happened.
    """

    def __init__(self, name: str = "test_harness") -> None:
        self.context = rclpy.Context()
        rclpy.init(args=["--ros-args", *ROS_ARGS_QUIET], context=self.context)
        self.node = Node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.errors: list[str] = []
        self._clients: dict[tuple[type, str], Any] = {}  # service clients, kept (see ``call``)
        self._stop, self._pause, self._parked, self._resume = (threading.Event() for _ in range(4))
        self._pause_lock = threading.Lock()
        self._last_spin = time.monotonic()  # when a spin_once last returned (``state``)
        self._thread = threading.Thread(target=self._spin, name="harness-spin", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            if self._pause.is_set():
                self._parked.set()
                self._resume.wait()
                continue
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except Exception:  # noqa: BLE001 - recorded; the conftest fails the running test with it
                self.errors.append(traceback.format_exc())
            self._last_spin = time.monotonic()

    def state(self) -> str:
        """What a failed test's report shows of the harness: is its spin thread alive and spinning, what it holds."""
        shm = Path("/dev/shm")
        fastdds_files = sum(1 for _ in shm.glob("fastdds_*")) if shm.is_dir() else 0
        return (f"spin thread alive: {self._thread.is_alive()}, paused: {self._pause.is_set()}, "
                f"last spin_once returned {time.monotonic() - self._last_spin:.1f} s ago; "
                f"harness node: {len(list(self.node.subscriptions))} subscriptions, {len(list(self.node.publishers))} publishers, "
                f"{len(list(self.node.timers))} timers; Fast DDS files in /dev/shm: {fastdds_files}")

    @contextlib.contextmanager
    def paused(self):
        """Hold the spin thread between two ``spin_once`` calls (no callback runs) for the block's duration."""
        with self._pause_lock:
            self._resume.clear()
            self._parked.clear()
            self._pause.set()
            try:
                if not self._parked.wait(PATIENCE.timeout()):
                    raise TimeoutError("the harness spin thread did not pause (a callback hangs?)")
                yield
            finally:
                self._pause.clear()
                self._resume.set()

    def add(self, node: Node) -> None:
        """Spin an in-process node with the harness."""
        self.executor.add_node(node)

    def remove(self, node: Node) -> None:
        """Stop spinning ``node`` and destroy it."""
        with self.paused():
            self.executor.remove_node(node)
            node.destroy_node()

    def stream(self, msg_type: type, topic: str, qos: QoSProfile | int, hz: float, msg: Any = None) -> Stream:
        return Stream(self, msg_type, topic, qos, hz, msg)

    def subscribe(self, msg_type: type, topic: str, qos: QoSProfile | int = 10, *, publishers: int = 0) -> Collector:
        """A collecting subscription, returned once ``publishers`` publishers matched it."""
        collector = Collector()
        sub = self.node.create_subscription(msg_type, topic, collector, qos)
        self._matched(lambda: sub.get_publisher_count() >= publishers, f"a publisher on {topic}")
        return collector

    def publisher(self, msg_type: type, topic: str, qos: QoSProfile | int = 10, *, subscribers: int = 1):
        """A publisher, returned once ``subscribers`` subscriptions matched it."""
        pub = self.node.create_publisher(msg_type, topic, qos)
        self._matched(lambda: pub.get_subscription_count() >= subscribers, f"a subscriber on {topic}")
        return pub

    def destroy_publisher(self, pub) -> None:
        with self.paused():
            self.node.destroy_publisher(pub)

    def _matched(self, predicate: Callable[[], bool], what: str) -> None:
        start = time.monotonic()
        wait_for(predicate, 0.0, what)
        PATIENCE.observe(time.monotonic() - start)

    def call(self, srv_type: type, name: str, request: Any, *, idempotent: bool = False) -> Any:
        """Call service ``name`` once it is ready; its response.

        A response can be lost: the server drops it when its response writer has not matched this client's
        reader within 100 ms of the request (rmw_fastrtps: "failed to send response (timeout): client will not
        receive response"), which a loaded machine does for a client that was just created. So clients live
        as long as the harness (that happens at most on a service's first call), and an ``idempotent`` request
        (a query; setting values the node already has is harmless) is re-sent every second until answered.
        """
        client = self._clients.get((srv_type, name))
        if client is None:
            client = self._clients[(srv_type, name)] = self.node.create_client(srv_type, name)
        self._matched(client.service_is_ready, f"service {name}")
        start = time.monotonic()
        futures = [client.call_async(request)]
        answered = lambda: next((f for f in futures if f.done()), None)  # noqa: E731
        if idempotent:
            future = resend_until(lambda: futures.append(client.call_async(request)), answered,
                                  f"the response of {name}", hz=1.0, first=False)
        else:
            future = wait_for(answered, 0.0, f"the response of {name}")
        PATIENCE.observe(time.monotonic() - start)
        return future.result()

    def close(self) -> None:
        """End the spin thread, then the executor, the node and the context, in that order."""
        self._stop.set()
        self._resume.set()
        self._thread.join(PATIENCE.timeout())
        if self._thread.is_alive():
            raise RuntimeError("the harness spin thread did not end (a callback hangs?)")
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


class Diagnostics:
    """The ``/diagnostics`` statuses whose name contains ``name``."""

    def __init__(self, harness: Harness, name: str) -> None:
        self.name = name
        self.statuses: list[DiagnosticStatus] = []
        self.stamps: list[float] = []  # per status: its message's header.stamp (s since the epoch), filled first
        harness.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_msg, 50)

    def _on_msg(self, msg: DiagnosticArray) -> None:
        mine = [s for s in msg.status if self.name in s.name]
        self.stamps.extend([msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9] * len(mine))
        self.statuses.extend(mine)

    def find(self, predicate: Callable[[DiagnosticStatus, dict[str, str]], bool], *, after: int = 0
             ) -> tuple[DiagnosticStatus, dict[str, str]] | None:
        """The first status from index ``after`` on that satisfies ``predicate(status, values)``, if one came."""
        for status in self.statuses[after:]:
            values = {kv.key: kv.value for kv in status.values}
            if predicate(status, values):
                return status, values
        return None

    def wait(self, predicate: Callable[[DiagnosticStatus, dict[str, str]], bool], timeout: float = 0.0, *, after: int = 0,
             what: str = "a diagnostic status") -> tuple[DiagnosticStatus, dict[str, str]]:
        """Wait for the first status from index ``after`` on that satisfies ``predicate(status, values)``."""
        return wait_for(lambda: self.find(predicate, after=after), timeout, what)

    def latest(self, timeout: float = 0.0) -> dict[str, str]:
        """Values of the next status to arrive."""
        return self.wait(lambda s, v: True, timeout, after=len(self.statuses))[1]
