"""Test harness for the ROS tests: node subprocesses, a spinning harness node, waiting without sleeps.

Everything here talks real rclpy over Fast DDS. Waiting is always for a condition (a message, a
matched endpoint, a service, a node's acknowledgement on /diagnostics), polled every 10 ms up to a
timeout that scales with what this machine measures, never a fixed sleep. What a node needs
continuously streams from harness timers; what is sent once is reliable or re-sent until acknowledged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import rclpy
import yaml
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile
from sensor_msgs.msg import Image

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


def node_logs(*procs: "NodeProcess", diag: "Diagnostics | None" = None) -> Callable[[], str]:
    """For ``Collector.wait(explain=...)``: each process's output and ``diag``'s newest status, read at the timeout."""
    def text() -> str:
        parts = [f"--- {p.log_path.name}:\n{p.output()}" for p in procs]
        if diag is not None and diag.statuses:
            parts.append(f"--- last status: {[(kv.key, kv.value) for kv in diag.statuses[-1].values]}")
        return "\n".join(parts)
    return text


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


def solid_image(seed: int, shape: tuple[int, int] = (48, 64)) -> np.ndarray:
    """A uint8 [H, W, 3] frame whose mean colour differs per ``seed`` (so its action does too)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(20, 235, size=3)
    noise = rng.integers(-20, 21, size=(*shape, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def raw_image_msg(pixels: np.ndarray, encoding: str, *, pad: int = 0, bigendian: bool = False) -> Image:
    """An Image built the way a camera driver would: rows of ``pixels`` (uint8 or uint16) + ``pad`` junk bytes."""
    h, w = pixels.shape[:2]
    rows = pixels.reshape(h, -1)
    if pixels.dtype.itemsize > 1:
        rows = rows.astype(">u2" if bigendian else "<u2")
    row_bytes = rows.view(np.uint8).reshape(h, -1)
    junk = np.full((h, pad), 0xAB, dtype=np.uint8)
    msg = Image(height=h, width=w, encoding=encoding, is_bigendian=int(bigendian))
    msg.step = row_bytes.shape[1] + pad
    msg.data = np.concatenate([row_bytes, junk], axis=1).tobytes()
    return msg


def string_cdr(payload: bytes) -> bytes:
    """A serialized std_msgs/String carrying arbitrary bytes (little-endian CDR), for non-UTF-8 input."""
    return b"\x00\x01\x00\x00" + struct.pack("<I", len(payload) + 1) + payload + b"\x00"
