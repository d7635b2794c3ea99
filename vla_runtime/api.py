"""Runtime API: the contract every edge (ROS node, simulator, CLI, training) uses (DESIGN §2).

    policy = load_policy(path, device="cpu", kv=KVConfig(KVMode.CHUNKED))
    session = policy.new_session("put the cup in the drawer")
    result = session.step(Observation(images={"primary": frame_uint8_hwc}))
    result.actions  # [horizon, action_dim] in robot units
"""

from __future__ import annotations

from .policies.base import (
    PRIMARY_CAMERA,
    ActionPrefix,
    ActionQueue,
    BatchInputError,
    EpisodeSession,
    Observation,
    Policy,
    StepResult,
    validate_image,
    validate_instruction,
)
from .policies.registry import FAMILIES, check_speed_options, detect_family, load_policy, register_family

__all__ = [
    "FAMILIES", "PRIMARY_CAMERA", "ActionPrefix", "ActionQueue", "BatchInputError", "EpisodeSession", "Observation", "Policy",
    "StepResult", "check_speed_options", "detect_family", "load_policy", "register_family", "validate_image", "validate_instruction",
]
