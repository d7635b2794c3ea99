"""The policy node's inputs at a moment: the newest frame, instruction and joint states, what may be acted on.

Pure bookkeeping, no ROS calls and no clock of its own: every question takes ``now`` (``time.monotonic()``
seconds), so pairing and the watchdog are tested without DDS (``test_policy_inputs.py``). The node calls
it under its lock from the subscription callbacks, the control tick and the worker.

Pairing: image and joint state arrive on separate topics; a frame is acted on with the joint state
stamped nearest to it, within ``joint_state_max_skew_s``, and waits until a state that new arrived.
Unstamped messages are not paired (the newest state goes with any frame).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from vla_runtime.control.timing import FrameClock

UNPAIRED_GRACE_S = 0.1  # a frame waits at least this long for the joint state of its moment before the watchdog speaks


@dataclass
class Frame:
    """A camera message, not decoded yet."""

    msg: Any  # sensor_msgs/Image or CompressedImage
    received: float  # time.monotonic() at receipt
    seq: int

    @property
    def stamp(self) -> float:
        """header.stamp in seconds (0 for an unstamped message)."""
        return self.msg.header.stamp.sec + self.msg.header.stamp.nanosec * 1e-9


@dataclass(frozen=True)
class InputLimits:
    """The node parameters the inputs are judged by (``PolicyNodeConfig`` fields of the same names)."""

    max_image_age_s: float = 0.5
    max_instruction_age_s: float = 0.0  # 0: never expires
    default_instruction: str = ""
    use_joint_state: bool = False
    joint_state_max_skew_s: float = 0.01  # negative: the newest state, no pairing


class Inputs:
    """The newest inputs and which frames were used; see the module docstring."""

    def __init__(self, limits: InputLimits) -> None:
        self.limits = limits
        self.frame: Frame | None = None
        self.frame_seq = 0  # frames received in all
        self.used_seq = 0  # frames up to this one are used (or skipped): never acted on again
        self.instruction: tuple[str, float] | None = None  # (text, receipt time)
        self.state: np.ndarray | None = None
        self.state_stamp = 0.0  # header.stamp of ``state`` in seconds (0: unstamped)
        self.state_error = ""  # why the newest joint state was rejected
        self._recent_states: deque[tuple[float, np.ndarray]] = deque(maxlen=64)  # (stamp, state), stamped ones
        self.frames_stale = 0  # frames that became too old before a step used them
        self.clock = FrameClock()  # the camera's period and next frame (``ControlConfig.frame_wait_ms``)

    # ------------------------------------------------------------------ arrivals
    def add_frame(self, msg: Any, now: float, *, active: bool) -> bool:
        """Keep ``msg`` as the newest frame; True when it replaced one an active node had not used (a drop)."""
        dropped = active and self.frame is not None and self.frame.seq > self.used_seq
        self.frame_seq += 1
        self.frame = Frame(msg, now, self.frame_seq)
        self.clock.add(now)
        return dropped

    def add_state(self, state: np.ndarray, stamp: float) -> None:
        """A valid joint state stamped ``stamp`` seconds (0: unstamped)."""
        self.state, self.state_error, self.state_stamp = state, "", stamp
        if stamp:
            self._recent_states.append((stamp, state))

    def reject_state(self, error: str) -> None:
        """The newest joint state was invalid: no action until a valid one arrives."""
        self.state, self.state_error = None, error

    def set_instruction(self, text: str, now: float) -> None:
        self.instruction = (text, now)

    def skip_frames_until(self, seq: int) -> None:
        """Frames up to ``seq`` are never acted on (received before activation or an episode's start)."""
        self.used_seq = max(self.used_seq, seq)

    # ------------------------------------------------------------------ questions at ``now``
    def current_instruction(self) -> str:
        """The instruction an episode starts with now: the newest received, else the default ('' = none)."""
        return self.instruction[0] if self.instruction else self.limits.default_instruction

    def hold_reason(self, now: float) -> str:
        """Why no action may go out at ``now`` ('' when the inputs are fresh): the watchdog.

        A frame that became too old before it was used is marked used and counted in ``frames_stale``.
        """
        lim, frame = self.limits, self.frame
        if self.instruction is None and not lim.default_instruction:
            return "waiting for an instruction"
        if frame is None:
            return "waiting for an image"
        if now - frame.received > lim.max_image_age_s:
            if frame.seq > self.used_seq:
                self.used_seq = frame.seq
                self.frames_stale += 1
            return f"newest image is {now - frame.received:.2f} s old (max_image_age_s {lim.max_image_age_s})"
        if lim.max_instruction_age_s and self.instruction is not None and now - self.instruction[1] > lim.max_instruction_age_s:
            return f"instruction is {now - self.instruction[1]:.2f} s old (max_instruction_age_s {lim.max_instruction_age_s})"
        if lim.use_joint_state and self.state is None:
            return f"joint state invalid: {self.state_error}" if self.state_error else "waiting for joint states"
        if self.state_lags(frame) and now - frame.received > max(UNPAIRED_GRACE_S, lim.joint_state_max_skew_s):
            lag = frame.stamp - self.state_stamp
            return f"newest joint state is {lag:.3f} s older than the image (joint_state_max_skew_s {lim.joint_state_max_skew_s})"
        return ""

    def state_lags(self, frame: Frame) -> bool:
        """True while no joint state as new as ``frame`` (less the allowed skew) has arrived."""
        lim = self.limits
        if not lim.use_joint_state or self.state is None or lim.joint_state_max_skew_s < 0:
            return False
        if frame.stamp == 0.0 or self.state_stamp == 0.0:
            return False
        return self.state_stamp < frame.stamp - lim.joint_state_max_skew_s

    def state_at(self, frame: Frame) -> tuple[bool, np.ndarray | None]:
        """(found, the joint state of ``frame``'s moment), asked once no state is missing.

        The recent state stamped nearest to the frame, when it lies within ``joint_state_max_skew_s``;
        none does when the state of that moment was lost (best-effort transport): the frame is skipped.
        A state newer than the frame is no better than an older one, the robot may have moved since the
        picture was taken. Unstamped frames or states get the newest state.
        """
        skew = self.limits.joint_state_max_skew_s
        if self.state is None or not frame.stamp or not self.state_stamp or skew < 0:
            return True, self.state
        stamp, state = min(self._recent_states, key=lambda item: abs(item[0] - frame.stamp))
        return abs(stamp - frame.stamp) <= skew + 1e-6, state

    def usable_frame(self, now: float) -> Frame | None:
        """The newest frame a step may take at ``now``: not used yet, inputs fresh, its joint state arrived."""
        if self.hold_reason(now):
            return None
        frame = self.frame
        if frame is None or frame.seq <= self.used_seq or self.state_lags(frame):
            return None  # each frame is acted on once; a frame waits for the joint state of its moment
        return frame

    def pending(self) -> bool:
        """A frame not acted on yet waits."""
        return self.frame is not None and self.frame.seq > self.used_seq
