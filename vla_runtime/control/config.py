"""Configuration of the real-time control loop (``vla_runtime.control``).

Strings exist only at the YAML/CLI boundary: ``ControlConfig.from_strings`` turns them into the
enums below once (an unknown name raises ``KeyError`` listing the valid ones).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, fields
from enum import Enum


class Schedule(str, Enum):
    """When a step starts.

    ``DEADLINE``: as late as possible so that it finishes just before the tick it serves (running step-time
    quantile + margin), on the newest frame at that moment. ``ASAP``: as soon as a new frame arrives and
    the queue is empty (the loop before issue 16; kept for comparison).
    """

    DEADLINE = "deadline"
    ASAP = "asap"


class PublishMode(str, Enum):
    """``TICK``: one action per control tick. ``IMMEDIATE``: a step's action goes out as soon as it is
    computed (event-driven controllers); ticks still carry queued chunk actions and the fallback."""

    TICK = "tick"
    IMMEDIATE = "immediate"


class Fallback(str, Enum):
    """What a tick without a fresh or queued action publishes.

    ``HOLD``: nothing (a position-controlled robot holds its last target). ``ZERO``: a zero action
    (delta / velocity commands stop), except ``fallback_keep_dims``, which repeat the last action (an
    absolute gripper). ``REPEAT_LAST``: the last action again (only safe for position targets).
    """

    HOLD = "hold"
    ZERO = "zero"
    REPEAT_LAST = "repeat_last"


class Blend(str, Enum):
    """How two chunks' predictions for the same tick combine.

    ``NONE``: the newest prediction wins. ``TEMPORAL``: ACT's temporal ensembling, weights
    ``exp(-temporal_coeff * i)`` with ``i = 0`` the oldest prediction. ``ADAPTIVE``: CogACT's adaptive
    ensemble, weights ``exp(adaptive_alpha * cos(a_i, a_newest))``. ``RTC``: real-time chunking: each step is
    given the actions queued for its chunk (``ControlLoop.guidance``) and a policy that can (CogACT) generates
    its chunk as their continuation; the newest prediction then wins, as with ``NONE``.
    """

    NONE = "none"
    TEMPORAL = "temporal"
    ADAPTIVE = "adaptive"
    RTC = "rtc"


ENUMS = {"schedule": Schedule, "publish_mode": PublishMode, "fallback": Fallback, "blend": Blend}


def parse_enum(kind: type[Enum], value: str | Enum, name: str) -> Enum:
    """``kind(value)``; ``KeyError`` naming the parameter and the valid values otherwise."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        raise KeyError(f"`{name}` is {value!r}; expected one of {', '.join(m.value for m in kind)}") from None


@dataclass
class ControlConfig:
    """The control loop's parameters.

    Args:
        rate_hz: control ticks per second.
        schedule: when steps start (``Schedule``).
        publish_mode: when actions go out (``PublishMode``).
        step_quantile: quantile of recent step times the schedule plans with (0.95: 1 step in 20 may overrun).
        margin_ms: extra time planned before each tick (timer jitter, publishing).
        step_window: recent step times kept for the quantile.
        refill_threshold: chunk policies: a new step is planned to land while this many actions of the
            current chunk are still queued (0: just in time; more: earlier, and the overlap is blended).
        latency_skip: chunk policies: action ``i`` of a chunk serves the ``i``-th tick from its frame's
            arrival; those for ticks already past are skipped. Off: a chunk starts at the next tick.
        blend: how overlapping chunks combine (``Blend``).
        temporal_coeff: ``Blend.TEMPORAL``'s m (ACT: 0.01).
        adaptive_alpha: ``Blend.ADAPTIVE``'s alpha (CogACT: 0.1).
        fallback: what a tick without an action publishes (``Fallback``).
        fallback_keep_dims: ``Fallback.ZERO``: dimensions that repeat the last action instead (a gripper).
        late_grace_ms: ``TICK``: a tick with nothing queued while the step planned for it is still running waits
            up to this long past its due time (under half a period) for that step, and publishes its action
            late instead of the fallback (``ControlLoop.grace_until``; counted in ``ticks_late``). 0: the tick
            falls back at once; the default, ``inf``: up to the cap, 0.45 of a period (a late action is still
            nearer its own tick than the next). A step planned with a quantile of step times overruns now and
            then, and an action a little late is better for a robot than a tick without one (``bench_ros.py``:
            10 ms left 0-8 ticks of 300-600 empty per minute at 5 and 10 Hz, the cap 0-2). The ROS node and ``eval --control-rate``
            wait; ``RemotePolicyLoop.tick`` returns at once.
        align_to_frames: ``DEADLINE`` with ``TICK``: move the tick phase (not the rate) so that frames arrive just
            before the steps start. Without it the newest frame is on average half a camera period old when a
            step takes it (the control timer's phase against the camera's is chance).
        frame_guard_ms: how long before a step's start frames are placed (camera and delivery jitter).
        align_window: steps whose frame ages decide a phase move.
        align_quantile: the phase moves by this quantile of their frame ages less the guard: that share of
            steps may find their frame not arrived yet and take the one before (a camera period older).
        frame_wait_ms: a step whose start finds the camera's next frame due within this long waits for it (at
            most this long) and takes it on arrival, rather than the newest frame, a camera period older (0: off,
            the default). The camera's period and phase come from the frames' receipt times
            (``timing.FrameClock``). With it the phase can be aligned to frames arriving about at the start
            (``frame_guard_ms`` 0), where without it a late frame costs a whole camera period.
    """

    rate_hz: float = 5.0
    schedule: Schedule = Schedule.DEADLINE
    publish_mode: PublishMode = PublishMode.TICK
    step_quantile: float = 0.95
    margin_ms: float = 3.0
    step_window: int = 50
    refill_threshold: int = 1
    latency_skip: bool = True
    blend: Blend = Blend.NONE
    temporal_coeff: float = 0.01
    adaptive_alpha: float = 0.1
    fallback: Fallback = Fallback.HOLD
    fallback_keep_dims: tuple[int, ...] = ()
    late_grace_ms: float = math.inf
    align_to_frames: bool = True
    frame_guard_ms: float = 5.0
    align_window: int = 20
    align_quantile: float = 0.1
    frame_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        for name, kind in ENUMS.items():
            setattr(self, name, parse_enum(kind, getattr(self, name), name))
        self.fallback_keep_dims = tuple(self.fallback_keep_dims)
        if not (self.rate_hz > 0 and math.isfinite(self.rate_hz)):
            raise ValueError(f"`rate_hz` must be a finite number > 0, got {self.rate_hz}")
        for name in ("margin_ms", "temporal_coeff", "adaptive_alpha", "frame_guard_ms", "frame_wait_ms"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):  # NaN fails both
                raise ValueError(f"`{name}` must be a finite number >= 0, got {getattr(self, name)}")
        if not 0.0 < self.step_quantile <= 1.0:
            raise ValueError(f"`step_quantile` must be in (0, 1], got {self.step_quantile}")
        if self.step_window < 1:
            raise ValueError(f"`step_window` must be >= 1, got {self.step_window}")
        if self.refill_threshold < 0:
            raise ValueError(f"`refill_threshold` must be >= 0, got {self.refill_threshold}")
        if not self.late_grace_ms >= 0:  # NaN too
            raise ValueError(f"`late_grace_ms` must be >= 0, got {self.late_grace_ms}")
        if not 0.0 <= self.align_quantile <= 1.0:
            raise ValueError(f"`align_quantile` must be in [0, 1], got {self.align_quantile}")
        if self.align_window < 1:
            raise ValueError(f"`align_window` must be >= 1, got {self.align_window}")
        if any(d < 0 for d in self.fallback_keep_dims):
            raise ValueError(f"`fallback_keep_dims` must be >= 0, got {list(self.fallback_keep_dims)}")

    @property
    def period(self) -> float:
        """Seconds between ticks."""
        return 1.0 / self.rate_hz

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
