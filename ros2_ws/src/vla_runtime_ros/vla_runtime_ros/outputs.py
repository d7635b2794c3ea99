"""The policy node's actuator outputs: ``~/action``, ``~/action_chunk``, ``~/twist`` and ``~/gripper``.

Lifecycle publishers (silent while the node is inactive), created at configure and destroyed at
cleanup; actions are clipped to ``action_low``/``action_high`` before they go out.
"""

from __future__ import annotations

import numpy as np
from geometry_msgs.msg import TwistStamped
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import Float32, Float32MultiArray

from . import conversions
from .params import PolicyNodeConfig

ACTION_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def action_bounds(cfg: PolicyNodeConfig, action_dim: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``action_low`` / ``action_high`` as float32 [action_dim] arrays (``None`` = no clipping)."""
    if not cfg.action_low:
        return None, None
    if len(cfg.action_low) != action_dim:
        raise ValueError(f"`action_low`/`action_high` have {len(cfg.action_low)} values; the policy's actions have {action_dim}")
    return np.asarray(cfg.action_low, dtype=np.float32), np.asarray(cfg.action_high, dtype=np.float32)


class ActionOutputs:
    """The node's output publishers for a policy of ``action_dim`` and ``chunk_size`` (see the module docstring)."""

    def __init__(self, node, cfg: PolicyNodeConfig, *, action_dim: int, chunk_size: int) -> None:
        if cfg.publish_twist and action_dim < 6:
            raise ValueError(f"publish_twist needs actions of >= 6 values (xyz, rpy); the policy's have {action_dim}")
        self.low, self.high = action_bounds(cfg, action_dim)
        self.twist_scale, self.twist_frame_id = cfg.control_rate_hz, cfg.twist_frame_id
        self._node = node
        self.publishers = {"action": node.create_lifecycle_publisher(Float32MultiArray, "~/action", ACTION_QOS)}
        if chunk_size > 1:
            self.publishers["chunk"] = node.create_lifecycle_publisher(Float32MultiArray, "~/action_chunk", ACTION_QOS)
        if cfg.publish_twist:
            self.publishers["twist"] = node.create_lifecycle_publisher(TwistStamped, "~/twist", ACTION_QOS)
            self.publishers["gripper"] = node.create_lifecycle_publisher(Float32, "~/gripper", ACTION_QOS)

    def clip(self, actions: np.ndarray) -> tuple[np.ndarray, int]:
        """``actions`` [..., action_dim] as float32 within the bounds, and how many values were clipped."""
        return conversions.clip_actions(np.asarray(actions, dtype=np.float32), self.low, self.high)

    def publish_action(self, action: np.ndarray) -> None:
        """One clipped action [action_dim] on ``~/action`` (and as twist + gripper when enabled)."""
        self.publishers["action"].publish(conversions.actions_to_msg(action))
        if "twist" in self.publishers:
            stamp = self._node.get_clock().now().to_msg()
            self.publishers["twist"].publish(
                conversions.action_to_twist(action, scale=self.twist_scale, stamp=stamp, frame_id=self.twist_frame_id)
            )
            if action.shape[0] > 6:
                self.publishers["gripper"].publish(Float32(data=float(action[6])))

    def publish_chunk(self, chunk: np.ndarray) -> None:
        """A predicted chunk [horizon, action_dim], clipped, on ``~/action_chunk`` (chunk policies only)."""
        if "chunk" in self.publishers:
            self.publishers["chunk"].publish(conversions.actions_to_msg(self.clip(chunk)[0]))

    def subscriber_counts(self) -> dict[str, int]:
        """``{topic}_subscribers`` for /diagnostics."""
        return {f"{topic}_subscribers": pub.get_subscription_count() for topic, pub in self.publishers.items()}

    def destroy(self) -> None:
        for pub in self.publishers.values():
            self._node.destroy_lifecycle_publisher(pub)
        self.publishers = {}
