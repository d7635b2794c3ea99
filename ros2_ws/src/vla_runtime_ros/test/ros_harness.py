"""Test harness for the ROS tests: node subprocesses, a spinning harness node, waiting without sleeps.

Everything here talks real rclpy over Fast DDS. Waiting is always for a condition (a message, a
matched endpoint, a service), polled every 10 ms up to a timeout, never a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import rclpy
import yaml
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy._rclpy_pybind11 import InvalidHandle
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor, ShutdownException
from rclpy.node import Node
from rclpy.qos import QoSProfile
from sensor_msgs.msg import Image

TEST_DIR = Path(__file__).resolve().parent
# the test modules, and the package sources when the package is not installed (see conftest)
SUBPROCESS_PATHS = [str(p) for p in sys.path if p in (str(TEST_DIR), str(TEST_DIR.parent))]
ROS_ARGS_QUIET = ["--disable-external-lib-logs"]  # no log files under ~/.ros


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy; ``TimeoutError`` naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


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

    def wait(self, count: int, timeout: float, what: str = "messages") -> list[Any]:
        """Wait until at least ``count`` messages arrived in total; returns all of them."""
        wait_for(lambda: len(self.items) >= count, timeout, f"{count} {what} (got {len(self.items)})")
        return [r.msg for r in self.items]


class Harness:
    """A node spinning on a background executor, from which tests publish, subscribe and call."""

    def __init__(self, name: str = "test_harness") -> None:
        self.context = rclpy.Context()
        rclpy.init(args=["--ros-args", *ROS_ARGS_QUIET], context=self.context)
        self.node = Node(name, context=self.context)
        self.executor = MultiThreadedExecutor(num_threads=2, context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        """Spin until shutdown. Tests destroy in-process nodes while this thread spins; rclpy may then meet a
        handle whose destruction was requested while it builds the wait set (InvalidHandle). That node is
        gone, the others are fine: keep spinning rather than let one race end every later delivery."""
        while self.context.ok():
            try:
                self.executor.spin_once(timeout_sec=0.1)
            except InvalidHandle:
                continue
            except (ExternalShutdownException, ShutdownException):
                return

    def subscribe(self, msg_type: type, topic: str, qos: QoSProfile | int = 10, *, publishers: int = 0,
                  timeout: float = 20.0) -> Collector:
        """A collecting subscription, returned once ``publishers`` publishers matched it."""
        collector = Collector()
        sub = self.node.create_subscription(msg_type, topic, collector, qos)
        wait_for(lambda: sub.get_publisher_count() >= publishers, timeout, f"a publisher on {topic}")
        return collector

    def publisher(self, msg_type: type, topic: str, qos: QoSProfile | int = 10, *, subscribers: int = 1, timeout: float = 20.0):
        """A publisher, returned once ``subscribers`` subscriptions matched it."""
        pub = self.node.create_publisher(msg_type, topic, qos)
        wait_for(lambda: pub.get_subscription_count() >= subscribers, timeout, f"a subscriber on {topic}")
        return pub

    def call(self, srv_type: type, name: str, request: Any, timeout: float = 20.0) -> Any:
        client = self.node.create_client(srv_type, name)
        try:
            wait_for(client.service_is_ready, timeout, f"service {name}")
            future = client.call_async(request)
            wait_for(future.done, timeout, f"the response of {name}")
            return future.result()
        finally:
            self.node.destroy_client(client)

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)
        self._thread.join(timeout=5)


class Diagnostics:
    """The ``/diagnostics`` statuses whose name contains ``name``."""

    def __init__(self, harness: Harness, name: str) -> None:
        self.name = name
        self.statuses: list[DiagnosticStatus] = []
        harness.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_msg, 50)

    def _on_msg(self, msg: DiagnosticArray) -> None:
        self.statuses.extend(s for s in msg.status if self.name in s.name)

    def wait(self, predicate: Callable[[DiagnosticStatus, dict[str, str]], bool], timeout: float = 10.0, *, after: int = 0,
             what: str = "a diagnostic status") -> tuple[DiagnosticStatus, dict[str, str]]:
        """The first status from index ``after`` on that satisfies ``predicate(status, values)``."""

        def find():
            for status in self.statuses[after:]:
                values = {kv.key: kv.value for kv in status.values}
                if predicate(status, values):
                    return status, values
            return None

        return wait_for(find, timeout, what)

    def latest(self, timeout: float = 10.0) -> dict[str, str]:
        """Values of the next status to arrive."""
        return self.wait(lambda s, v: True, timeout, after=len(self.statuses))[1]


class NodeProcess:
    """``python -m vla_runtime_ros.<module> --ros-args --params-file <yaml>`` in a subprocess."""

    def __init__(self, module: str, params: dict, tmp: Path, *, name: str, namespace: str = "/", extra_args: tuple = ()) -> None:
        self.params_file = tmp / f"{name}_params.yaml"
        self.params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
        self.log_path = tmp / f"{name}.log"
        self.args = [
            sys.executable, "-m", f"vla_runtime_ros.{module}",
            "--ros-args", "--params-file", str(self.params_file),
            "-r", f"__node:={name}", "-r", f"__ns:={namespace}", *ROS_ARGS_QUIET, *extra_args,
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*SUBPROCESS_PATHS, env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def interrupt(self, timeout: float = 10.0) -> tuple[int, float]:
        """SIGINT (Ctrl-C); returns (exit code, seconds it took). Kills it and raises if it hangs."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.args} did not exit within {timeout} s of SIGINT:\n{self.output()}") from None
        return code, time.monotonic() - start

    def close(self) -> None:
        if self.alive():
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
