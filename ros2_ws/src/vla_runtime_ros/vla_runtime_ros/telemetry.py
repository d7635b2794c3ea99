"""Counters and rolling statistics behind the policy node's ``/diagnostics`` status.

Plain Python (no node): the node updates a ``PolicyTelemetry`` from its callbacks under its own
lock and turns ``values()`` into ``diagnostic_msgs/KeyValue``s.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from vla_runtime.kv.base import KVStats

LEVELS = {"ok": DiagnosticStatus.OK, "warn": DiagnosticStatus.WARN, "error": DiagnosticStatus.ERROR, "stale": DiagnosticStatus.STALE}


class Rolling:
    """The last ``size`` samples; percentiles over them."""

    def __init__(self, size: int = 200) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self._values, q)) if self._values else float("nan")

    def __len__(self) -> int:
        return len(self._values)


class RateMeter:
    """Events per second over the last ``window_s`` seconds (monotonic timestamps)."""

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def tick(self, now: float) -> None:
        self._times.append(now)
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        if len(self._times) < 2:
            return 0.0
        return (len(self._times) - 1) / max(self._times[-1] - self._times[0], 1e-9)

    def _trim(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()


@dataclass
class PolicyTelemetry:
    """What the policy node reports. Counters are totals since configure."""

    frames_received: int = 0
    frames_dropped: int = 0  # replaced by a newer frame before inference used them
    frames_stale: int = 0  # control ticks skipped because the newest frame was too old
    frames_unpaired: int = 0  # skipped: no joint state stamped within joint_state_max_skew_s of the frame
    steps_without_frame: int = 0  # frame_wait_ms: a step's start and wait came with no new frame (camera late)
    bad_inputs: int = 0  # rejected images, instructions, joint states
    inference_errors: int = 0
    setup_errors: int = 0  # e.g. a camera whose QoS cannot match the subscription
    control_errors: int = 0  # a control tick that raised (a bug: reported, and the ticks go on)
    actions_published: int = 0
    actions_suppressed: int = 0  # computed but not published (dry_run)
    actions_withheld: int = 0  # dropped by the watchdog (stale image / instruction / joint state)
    values_clipped: int = 0
    steps: int = 0
    episode: int = 0
    joint_state_stamp: float = 0.0  # header.stamp of the newest valid joint state (0: unstamped)
    frame_stamp: str = ""  # header.stamp (sec.nanosec) of the newest image received, accepted or not
    last_error: str = ""
    errors_since_report: int = 0
    warning: str = ""
    kv: KVStats = field(default_factory=KVStats)
    step_ms: Rolling = field(default_factory=Rolling)  # decode + session.step wall time
    latency_ms: Rolling = field(default_factory=Rolling)  # frame receipt -> action published
    frame_age_ms: Rolling = field(default_factory=Rolling)  # frame receipt -> the step that used it started
    action_rate: RateMeter = field(default_factory=RateMeter)

    def error(self, message: str, *, kind: str) -> None:
        """Count an error of ``kind`` (``input``, ``inference``, ``setup`` or ``control``) and keep its message."""
        counters = {"input": "bad_inputs", "inference": "inference_errors", "setup": "setup_errors", "control": "control_errors"}
        setattr(self, counters[kind], getattr(self, counters[kind]) + 1)
        self.last_error = message
        self.errors_since_report += 1

    def status(self, *, name: str, hardware_id: str, state: str, now: float, live: dict[str, object]) -> DiagnosticStatus:
        """One ``DiagnosticStatus``; ERROR when an error happened since the previous status.

        ``live``: the control loop's state at this moment, reported as is after the counters (the queue
        length, whether a frame waits or a step runs, subscriptions matched to each output topic).
        """
        if self.errors_since_report:
            level, message = LEVELS["error"], self.last_error
        elif self.warning:
            level, message = LEVELS["warn"], self.warning
        else:
            level, message = LEVELS["ok"], state
        self.errors_since_report = 0
        values = {
            "state": state,
            "episode": self.episode,
            "steps": self.steps,
            "step_ms_p50": self.step_ms.percentile(50),
            "step_ms_p95": self.step_ms.percentile(95),
            "latency_ms_p50": self.latency_ms.percentile(50),
            "latency_ms_p95": self.latency_ms.percentile(95),
            "frame_age_ms_p50": self.frame_age_ms.percentile(50),
            "action_rate_hz": self.action_rate.rate(now),
            "actions_published": self.actions_published,
            "actions_suppressed": self.actions_suppressed,
            "actions_withheld": self.actions_withheld,
            "values_clipped": self.values_clipped,
            "frames_received": self.frames_received,
            "frames_dropped": self.frames_dropped,
            "frames_stale": self.frames_stale,
            "frames_unpaired": self.frames_unpaired,
            "steps_without_frame": self.steps_without_frame,
            "frame_stamp": self.frame_stamp,
            "joint_state_stamp": self.joint_state_stamp,
            "bad_inputs": self.bad_inputs,
            "inference_errors": self.inference_errors,
            "setup_errors": self.setup_errors,
            "control_errors": self.control_errors,
            "last_error": self.last_error,
            "kv_bytes": self.kv.bytes,
            "kv_tokens_raw": self.kv.tokens_raw,
            "kv_tokens_seen": self.kv.tokens_seen,
            "kv_chunks_retained": self.kv.chunks_retained,
            "kv_chunks_dropped": self.kv.chunks_dropped,
            "kv_positions_used": self.kv.positions_used,
            **live,
        }
        return DiagnosticStatus(
            level=level,
            name=name,
            message=message,
            hardware_id=hardware_id,
            values=[KeyValue(key=k, value=_format(v)) for k, v in values.items()],
        )


def control_values(loop, cfg) -> dict[str, object]:
    """A ``ControlLoop``'s counters since activation and ``cfg``'s (``PolicyNodeConfig``) schedule, for /diagnostics."""
    if loop is None or cfg is None:
        return {}
    stats = loop.stats
    return {
        "schedule": cfg.schedule, "publish_mode": cfg.publish_mode, "fallback": cfg.fallback,
        "step_plan_ms": loop.lead() * 1e3, "ticks": stats.ticks, "fallbacks": stats.fallbacks,
        "steps_late": stats.steps_late, "ticks_overrun": stats.ticks_overrun,
        "actions_skipped": stats.actions_skipped, "actions_blended": stats.actions_blended,
        "actions_immediate": stats.immediate, "phase_shifts": stats.phase_shifts, "ticks_late": stats.ticks_late,
        "ticks_missed": stats.ticks_missed,
    }


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def status_values(status: DiagnosticStatus) -> dict[str, str]:
    """``{key: value}`` of a ``DiagnosticStatus`` (for tests and tools)."""
    return {kv.key: kv.value for kv in status.values}
