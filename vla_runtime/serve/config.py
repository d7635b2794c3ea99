"""Configuration of ``vla-runtime serve``: the wire-key mapping, the limits and the server itself."""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field
from typing import get_type_hints

from ..api import PRIMARY_CAMERA
from .wire import DecodeLimits

MAX_WINDOW_MS = 60_000.0  # a batch never waits a minute for more steps
MAX_REJOIN_FRACTION = 1e4  # of the median batch time


def check_types(config: object) -> None:
    """``ValueError`` naming the field unless every ``int``, ``float``, ``str`` and ``bool`` field of the dataclass
    ``config`` (optional ones: or ``None``) holds a value of that type (an int for a float; floats finite). A YAML
    file's ``api_token: 123456`` or ``port: "8000"`` is refused by name instead of failing somewhere inside."""
    names = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}
    hints = get_type_hints(type(config))
    for f in dataclasses.fields(config):
        hint = hints[f.name]
        optional = isinstance(hint, types.UnionType) and type(None) in hint.__args__
        kind = next((a for a in hint.__args__ if a is not type(None)), None) if optional else hint
        if kind not in names:
            continue
        value = getattr(config, f.name)
        if value is None and optional:
            continue
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise ValueError(f"`{f.name}` must be {names[kind]}{' or null' if optional else ''}, got {value!r}")


@dataclass
class ObservationKeys:
    """Which keys of a client's message fill the runtime's ``Observation`` (openpi's names by default).

    Args:
        images: camera name -> message key; ``"primary"`` is the policy camera and must be present.
        state: message keys whose values, flattened and concatenated in this order, are ``Observation.state``
            (e.g. DROID's ``["observation/joint_position", "observation/gripper_position"]``). A message
            without any of them has no state; one with only some of them is refused.
        prompt: key of the task instruction (a string).
        reset: key of the reset flag: ``{reset: True}`` ends the episode (with an observation in the same
            message the new episode starts with that step).
    """

    images: dict[str, str] = field(
        default_factory=lambda: {PRIMARY_CAMERA: "observation/image", "wrist": "observation/wrist_image"}
    )
    state: list[str] = field(default_factory=lambda: ["observation/state"])
    prompt: str = "prompt"
    reset: str = "reset"

    def __post_init__(self) -> None:
        if isinstance(self.state, str):
            self.state = [self.state]
        if PRIMARY_CAMERA not in self.images:
            raise ValueError(f"`images` must map the {PRIMARY_CAMERA!r} camera to a message key, got {self.images!r}")
        keys = [*self.images.values(), *self.state, self.prompt, self.reset]
        if any(not isinstance(k, str) or not k for k in keys):
            raise ValueError(f"message keys must be non-empty strings, got {keys!r}")
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"message keys must be distinct; used twice: {duplicates}")


@dataclass
class Limits:
    """What one message may carry. A message over ``max_message_bytes`` is refused by the websocket layer
    (close code 1009, nothing of it is buffered); every other breach gets an error reply.

    Args:
        max_message_bytes: largest websocket message (default 16 MiB).
        max_image_pixels: most pixels (H * W) of one image (default 4 Mpx).
        max_state_dim: most state values.
        max_prompt_chars: longest prompt.
        max_container_len: most entries of one msgpack array or map.
    """

    max_message_bytes: int = 16 * 2**20
    max_image_pixels: int = 4 * 2**20
    max_state_dim: int = 256
    max_prompt_chars: int = 2048
    max_container_len: int = 4096

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("max_message_bytes", "max_image_pixels", "max_state_dim", "max_prompt_chars", "max_container_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")

    def decode_limits(self) -> DecodeLimits:
        return DecodeLimits(max_bytes=self.max_message_bytes, max_container_len=self.max_container_len)


@dataclass
class BatchConfig:
    """Micro-batching of steps from several sessions.

    Args:
        max_batch: most steps run as one batched forward (1 = one at a time).
        window_ms: how long the worker waits for more steps after the first one arrives, when other
            sessions have steps in flight that could still join (0 = take only what is already queued).
        rejoin_fraction: the worker also waits for robots it expects back (answered, and sending their next
            step within their usual round trip) for up to this fraction of its recent median batch time. Robots
            that step again as soon as they are answered (closed loop, or running late) would otherwise split
            into groups that alternate on the worker, each batch smaller and the cycle longer. 0 = never wait
            past ``window_ms``.
    """

    max_batch: int = 8
    window_ms: float = 2.0
    rejoin_fraction: float = 0.1

    def __post_init__(self) -> None:
        check_types(self)
        if self.max_batch < 1:
            raise ValueError(f"`max_batch` must be >= 1, got {self.max_batch}")
        if not 0 <= self.window_ms <= MAX_WINDOW_MS:
            raise ValueError(f"`window_ms` must be in 0..{MAX_WINDOW_MS:g}, got {self.window_ms}")
        if not 0 <= self.rejoin_fraction <= MAX_REJOIN_FRACTION:
            raise ValueError(f"`rejoin_fraction` must be in 0..{MAX_REJOIN_FRACTION:g}, got {self.rejoin_fraction}")


@dataclass
class ServeConfig:
    """The server.

    Args:
        host: interface to listen on (``127.0.0.1``: this machine only; ``0.0.0.0``: every interface).
        port: TCP port (0 = any free port; the bound one is logged and returned).
        api_token: when set, a client must send ``Authorization: Api-Key <token>`` (openpi's client does
            with ``api_key=``) or ``Authorization: Bearer <token>``; others get HTTP 401.
        max_sessions: robots served at once; one more is refused with close code 1013 and the reason.
        idle_timeout_s: a session without a message for this long is closed and its memory freed.
        queue_size: steps waiting for the worker, all sessions together; a session whose step finds
            the queue full waits (and stops reading its socket) until a slot frees.
        keys, limits, batch: see ``ObservationKeys``, ``Limits``, ``BatchConfig``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_token: str | None = None
    max_sessions: int = 8
    idle_timeout_s: float = 300.0
    queue_size: int = 32
    keys: ObservationKeys = field(default_factory=ObservationKeys)
    limits: Limits = field(default_factory=Limits)
    batch: BatchConfig = field(default_factory=BatchConfig)

    def __post_init__(self) -> None:
        check_types(self)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"`port` must be in 0..65535, got {self.port}")
        if self.max_sessions < 1:
            raise ValueError(f"`max_sessions` must be >= 1, got {self.max_sessions}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"`idle_timeout_s` must be > 0, got {self.idle_timeout_s}")
        if self.queue_size < 1:
            raise ValueError(f"`queue_size` must be >= 1, got {self.queue_size}")
        if self.api_token is not None and not self.api_token.strip():
            raise ValueError("`api_token` must not be empty (leave it unset for no authentication)")
