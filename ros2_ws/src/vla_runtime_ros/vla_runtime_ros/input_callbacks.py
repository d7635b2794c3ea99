"""The input callbacks of ``PolicyNode`` (frames, instructions, joint states).

``InputCallbacks`` is a mixin of ``PolicyNode`` (``policy_node.py`` holds the lifecycle, the subscriptions and
/diagnostics; ``policy_control.py`` the episodes and control ticks). The callbacks are tiny: each validates its
message, stores it in the node's ``Inputs`` under the node's lock and wakes the control thread while no step job
is in flight (a job takes the newest frame itself). A bad message is reported (log and /diagnostics) and dropped;
the node goes on.
"""

from __future__ import annotations

import time

from rclpy.qos import qos_policy_name_from_kind
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from . import conversions


class InputCallbacks:
    """Input callbacks of ``PolicyNode`` (see the module docstring)."""

    def _on_image(self, msg: Image | CompressedImage) -> None:
        now, cfg = time.monotonic(), self._cfg
        if cfg is None:  # cleanup is destroying this subscription
            return
        stamp = msg.header.stamp
        with self._lock:
            self._telemetry.frame_stamp = f"{stamp.sec}.{stamp.nanosec:09d}"
        try:
            if isinstance(msg, Image):
                conversions.check_image_msg(msg, max_pixels=cfg.max_image_pixels)
            elif len(msg.data) == 0:
                raise ValueError(f"CompressedImage data is empty (format {msg.format!r})")
        except ValueError as e:
            self._report_error(f"image rejected: {e}", kind="input")
            return
        with self._lock:
            self._telemetry.frames_received += 1
            self._telemetry.frames_dropped += self._inputs.add_frame(msg, now, active=self._active)
            self._frame_arrived.notify_all()
        if self._future is None:  # a job in flight takes the newest frame itself (module docstring)
            self._wake()

    def _on_incompatible_image_qos(self, event) -> None:
        if self._cfg is None:
            return
        self._report_error(
            f"a camera publisher's QoS is incompatible with this subscription ({qos_policy_name_from_kind(event.last_policy_kind)}); "
            f"its frames never arrive. image_reliability is {self._cfg.image_reliability!r}: use best_effort for best-effort cameras",
            kind="setup",
        )

    def _on_incompatible_instruction_qos(self, event) -> None:
        if self._cfg is None:
            return
        self._report_error(
            f"an instruction publisher's QoS is incompatible with this subscription ({qos_policy_name_from_kind(event.last_policy_kind)}); "
            "its instructions never arrive. Publish instructions reliable (volatile or transient local)", kind="setup",
        )

    def _on_instruction(self, msg: String, info: dict) -> None:
        if self._instruction_seen.seen(info):  # through the other subscription already, or older than one that was
            return
        try:
            text = conversions.instruction_text(msg.data)
        except ValueError as e:
            self._report_error(f"instruction rejected: {e}", kind="input")
            return
        with self._lock:
            self._inputs.set_instruction(text, time.monotonic())
            if text != self._episode_instruction and self._active:
                self._request_episode(text)
        self.get_logger().info(f"instruction: {text!r}")

    def _on_joint_state(self, msg: JointState) -> None:
        cfg = self._cfg
        if cfg is None:
            return
        try:
            state = conversions.joint_state_to_array(msg, cfg.joint_names)
        except ValueError as e:
            with self._lock:
                self._inputs.reject_state(str(e))
            self._report_error(f"joint state rejected: {e}", kind="input")
            return
        with self._lock:
            self._inputs.add_state(state, msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9)
            self._telemetry.joint_state_stamp = self._inputs.state_stamp
        if self._future is None:  # a frame may have been waiting for this state
            self._wake()

    def _wake(self) -> None:
        """Wake the control thread between ticks (a frame, a joint state or a finished job)."""
        with self._lock:  # _stop_control clears it under the lock before stopping it
            if self._control_thread is not None:
                self._control_thread.wake()

    def _watchdog(self, now: float) -> str:
        """Why no action may go out now ('' when inputs are fresh and the last episode started; caller holds
        ``_lock``); shown on /diagnostics."""
        inputs = self._inputs.hold_reason(now)
        reason = self._episode_failure or inputs  # no session at all comes first
        self._telemetry.warning, self._telemetry.frames_stale = reason, self._inputs.frames_stale
        return reason
