"""Real-time control loop: deadline-scheduled steps, chunk refill with latency skipping and blending,
and a deadline fallback. Used by the ROS policy node and, for a policy served elsewhere, by a robot's own loop
(``remote.RemotePolicyLoop``); free of ROS (see ``loop.ControlLoop``)."""

from .broker import ChunkBroker, Missed, blend
from .config import Blend, ControlConfig, Fallback, PublishMode, Schedule
from .loop import ControlLoop, ControlStats, Plan, Source, TickOutput
from .remote import RemotePolicyLoop
from .ticker import DeadlineTicker
from .timing import StepTimer, TickGrid

__all__ = [
    "Blend", "ChunkBroker", "ControlConfig", "ControlLoop", "ControlStats", "DeadlineTicker", "Fallback", "Missed", "Plan", "PublishMode",
    "RemotePolicyLoop", "Schedule", "Source", "StepTimer", "TickGrid", "TickOutput", "blend",
]
