"""The policy node's instruction input: volatile and transient-local publishers alike.

A transient-local subscription does not match a volatile publisher (plain ``ros2 topic pub``), and a
volatile one never receives what a transient-local publisher sent before it matched (a latched
instruction). So the node subscribes twice, reliable in both: transient local (latched instructions)
and volatile (every reliable publisher, live). A live sample of a transient-local publisher reaches
both; ``Deduplicator`` lets each sample through once, and never an older one after a newer one. Only the volatile subscription
reports incompatible publishers (best effort ones); the transient-local one would flag every
volatile publisher, which the volatile one serves.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Callable

from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import String

LATCHED_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
LIVE_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE)


class Deduplicator:
    """Lets each publisher's samples through once, in order: ``seen`` is True for a sample whose publication
    sequence number is not newer than one already let through from the same publisher.

    Order matters, not only repeats: the latched subscription keeps one sample, so of "A" then "B" it may
    deliver only "B" before the volatile one delivers "A"; "A" is older and must not win.
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._newest: OrderedDict[bytes, int] = OrderedDict()  # publisher gid -> newest sequence number let through
        self._stamps: deque[tuple[bytes, int]] = deque(maxlen=size)  # without sequence numbers: (gid, source stamp)

    def seen(self, info: dict[str, Any]) -> bool:
        gid_info = info.get("publisher_gid")
        gid = bytes(gid_info.get("data", b"")) if isinstance(gid_info, dict) else b""
        seq = info.get("publication_sequence_number")
        if seq is None:  # an rmw without sequence numbers: drop exact repeats only
            key = (gid, info.get("source_timestamp", 0))
            if key in self._stamps:
                return True
            self._stamps.append(key)
            return False
        if gid in self._newest and seq <= self._newest[gid]:
            return True
        self._newest[gid] = seq
        self._newest.move_to_end(gid)
        while len(self._newest) > self.size:
            self._newest.popitem(last=False)
        return False


def subscribe_instructions(node, callback: Callable[[String, dict], None], on_incompatible: Callable[[Any], None],
                           callback_group) -> list:
    """The two instruction subscriptions (``callback(msg, message_info)``); one callback group keeps them in order."""
    latched = node.create_subscription(
        String, "instruction", callback, LATCHED_QOS, callback_group=callback_group,
        event_callbacks=SubscriptionEventCallbacks(use_default_callbacks=False),
    )
    live = node.create_subscription(
        String, "instruction", callback, LIVE_QOS, callback_group=callback_group,
        event_callbacks=SubscriptionEventCallbacks(incompatible_qos=on_incompatible),
    )
    return [latched, live]
