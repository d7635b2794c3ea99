"""A client's decoded message -> a ``Request`` for its session (an observation step and/or a reset).

Every check names the key, what it got and what it allows, so a robot's developer can fix the client
from the error reply alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..api import PRIMARY_CAMERA, Observation
from .config import Limits, ObservationKeys


class BadRequest(ValueError):
    """A message the server cannot act on; the text goes back to the client."""


class RequestKind(str, Enum):
    STEP = "step"  # run the policy on an observation (after a reset, if the message also asked for one)
    RESET = "reset"  # end the episode only


@dataclass
class Request:
    """What one message asks of its session.

    Args:
        kind: ``STEP`` or ``RESET``.
        reset: end the current episode first.
        prompt: the instruction the message carries (``None``: keep the session's).
        observation: the step's input (``STEP`` only).
    """

    kind: RequestKind
    reset: bool = False
    prompt: str | None = None
    observation: Observation | None = None


def image_from_wire(value: object, key: str, limits: Limits) -> np.ndarray:
    """A uint8 image [H, W, 3] (or channels-first [3, H, W], transposed) -> uint8 [H, W, 3]."""
    if not isinstance(value, np.ndarray):
        raise BadRequest(f"{key!r} must be a numpy uint8 array [H, W, 3], got {type(value).__name__}")
    if value.dtype != np.uint8:
        raise BadRequest(f"{key!r} must have dtype uint8 (0..255 RGB), got {value.dtype}")
    if value.ndim == 3 and value.shape[0] == 3 and value.shape[2] != 3:
        value = value.transpose(1, 2, 0)  # [3, H, W] -> [H, W, 3]
    if value.ndim != 3 or value.shape[2] != 3 or min(value.shape[:2]) < 1:
        raise BadRequest(f"{key!r} must be an RGB image [H, W, 3] (or [3, H, W]), got shape {list(value.shape)}")
    pixels = value.shape[0] * value.shape[1]
    if pixels > limits.max_image_pixels:
        raise BadRequest(f"{key!r} has {pixels} pixels ({value.shape[0]}x{value.shape[1]}); the limit is {limits.max_image_pixels}")
    return value


def state_from_wire(message: dict, keys: list[str], limits: Limits) -> np.ndarray | None:
    """The state keys' values, flattened and concatenated -> float64 [state_dim]; ``None`` if none is present."""
    present = [k for k in keys if k in message]
    if not present:
        return None
    if len(present) != len(keys):
        missing = [k for k in keys if k not in message]
        raise BadRequest(f"the state is made of {keys}; the message lacks {missing}")
    parts = []
    for key in keys:
        value = message[key]
        if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            value = np.asarray(value, dtype=np.float64)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = np.asarray([value], dtype=np.float64)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf":
            raise BadRequest(f"{key!r} must be a numeric array or list, got {type(value).__name__}"
                             + (f" of {value.dtype}" if isinstance(value, np.ndarray) else ""))  # fmt: skip
        parts.append(value.astype(np.float64).reshape(-1))
    state = np.concatenate(parts)  # [state_dim]
    if state.size > limits.max_state_dim:
        raise BadRequest(f"the state has {state.size} values; the limit is {limits.max_state_dim}")
    if not np.isfinite(state).all():
        raise BadRequest(f"the state {keys} holds NaN or infinite values")
    return state


def parse_request(message: object, keys: ObservationKeys, limits: Limits) -> Request:
    """One decoded message -> ``Request``; ``BadRequest`` saying what is wrong otherwise.

    Keys the mapping does not name are ignored (openpi clients send robot-specific extras).
    """
    if not isinstance(message, dict):
        raise BadRequest(f"a message must be a map of observation keys to values, got {type(message).__name__}")
    bad_keys = [k for k in message if not isinstance(k, str)]
    if bad_keys:
        raise BadRequest(f"message keys must be strings, got {bad_keys[:3]!r}")
    reset = message.get(keys.reset, False)
    if not isinstance(reset, (bool, np.bool_)):
        raise BadRequest(f"{keys.reset!r} must be true or false, got {reset!r}")
    prompt = message.get(keys.prompt)
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRequest(f"{keys.prompt!r} must be a non-empty string, got {prompt!r:.80}")
        if len(prompt) > limits.max_prompt_chars:
            raise BadRequest(f"{keys.prompt!r} has {len(prompt)} characters; the limit is {limits.max_prompt_chars}")
    has_images = [k for k in keys.images.values() if k in message]
    if not has_images:
        if reset:
            return Request(RequestKind.RESET, reset=True, prompt=prompt)
        expected = ", ".join(repr(k) for k in (keys.images[PRIMARY_CAMERA], keys.prompt, keys.reset))
        raise BadRequest(f"the message has neither an observation nor a reset (expected keys include {expected}); "
                         f"got keys {sorted(message)[:10]}")  # fmt: skip
    images = {}
    for camera, key in keys.images.items():
        if key in message:
            images[camera] = image_from_wire(message[key], key, limits)
    if PRIMARY_CAMERA not in images:
        raise BadRequest(f"the policy camera {keys.images[PRIMARY_CAMERA]!r} is missing (got {has_images})")
    obs = Observation(images=images, state=state_from_wire(message, keys.state, limits))
    return Request(RequestKind.STEP, reset=bool(reset), prompt=prompt, observation=obs)
