"""HybridVLA processing: AR action tokens and the collaborative ensemble. No ``nn.Module``.

Action tokens are OpenVLA's 256-bin scheme (``processing_openvla.ActionTokenizer``) shifted by
``need_to_sub``: the tokenizer's vocabulary end is ``32000 - need_to_sub``.
"""

from __future__ import annotations

import numpy as np

from ..action_postprocess import binarize_gripper, gripper_dims
from ..openvla.processing_openvla import ActionTokenizer
from .configuration_hybridvla import TEXT_VOCAB_SIZE, CollaborativeEnsembleConfig


def ar_action_tokenizer(need_to_sub: int = 0, n_bins: int = 256) -> ActionTokenizer:
    """HybridVLA's ``ActionTokenizer(tokenizer, need_to_sub)``: ids ``32000 - need_to_sub - bin``.
    Use ``.normalized(ids)`` (bins -> [-1, 1]); un-normalisation goes through ``postprocess_actions``."""
    return ActionTokenizer(n_bins, TEXT_VOCAB_SIZE - need_to_sub)


def ar_is_confident(confidences: np.ndarray, cfg: CollaborativeEnsembleConfig) -> bool:
    """Whether the AR action joins the diffusion one.

    confidences: [D] max-softmax probability of each generated AR token. ``code``: the first 6 summed
    > threshold (5.8); ``paper``: the mean of all > threshold (0.96).
    """
    confidences = np.asarray(confidences, dtype=np.float64)
    score = confidences[:6].sum() if cfg.rule == "code" else confidences.mean()
    return bool(score > cfg.resolved_threshold)


def collaborative_ensemble(
    diff_action: np.ndarray, ar_action: np.ndarray, confidences: np.ndarray, cfg: CollaborativeEnsembleConfig
) -> tuple[np.ndarray, bool]:
    """HybridVLA's collaborative action ensemble on robot-unit actions.

    diff_action, ar_action: [D]; confidences: [D]. Confident AR: the mean of both with the gripper
    binarised at 0.5 again; otherwise the diffusion action. Returns (action [D], whether AR was used).
    """
    if ar_is_confident(confidences, cfg):
        mean = (np.asarray(diff_action, dtype=np.float64) + np.asarray(ar_action, dtype=np.float64)) / 2.0
        return binarize_gripper(mean, gripper_dims(mean.shape[-1]), half_is_open=False), True
    return np.asarray(diff_action, dtype=np.float64), False


def quat_xyzw_to_euler_xyz(q: np.ndarray) -> np.ndarray:
    """Unit quaternion [qx, qy, qz, qw] -> extrinsic x-y-z Euler angles [roll, pitch, yaw] (radians), the
    convention HybridVLA's actions and states use (``Rotation.from_euler("xyz", ...)`` upstream)."""
    norm = np.linalg.norm(q)
    if not norm > 1e-9:  # zero (or NaN): no rotation to read
        raise ValueError(f"the state's quaternion {np.asarray(q).tolist()} has no direction (norm {norm:g})")
    x, y, z, w = np.asarray(q, dtype=np.float64) / norm
    roll = np.arctan2(2 * (w * x + y * z), 1 - 2 * (x * x + y * y))
    pitch = np.arcsin(np.clip(2 * (w * y - z * x), -1.0, 1.0))
    yaw = np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
    return np.array([roll, pitch, yaw])


def _xyz_rpy_gripper(state: np.ndarray) -> np.ndarray:
    return state


def _xyz_quat_gripper(state: np.ndarray) -> np.ndarray:
    return np.concatenate([state[:3], quat_xyzw_to_euler_xyz(state[3:7]), state[7:]])


def _xyz_gripper(state: np.ndarray) -> np.ndarray:
    return np.concatenate([state[:3], np.zeros(3), state[3:]])


# robot state layouts HybridVLA's proprio token accepts, by name -> (length, converter to its own layout
# [x, y, z, roll, pitch, yaw, gripper]); each length means one layout, so the default picks it by length
STATE_LAYOUTS = {
    "xyz_rpy_gripper": (7, _xyz_rpy_gripper),  # upstream's cur_robot_state
    "xyz_quat_gripper": (8, _xyz_quat_gripper),  # RLBench gripper_pose (quaternion xyzw) + gripper_open
    "xyz_gripper": (4, _xyz_gripper),  # Meta-World hand position + gripper opening (orientation fixed: 0)
}


def to_proprio(state: np.ndarray, layout: str | None = None) -> np.ndarray:
    """A robot state -> HybridVLA's 7-D proprio layout ``[x, y, z, roll, pitch, yaw, gripper]``.

    layout: a key of ``STATE_LAYOUTS``; ``None`` = the layout of the state's length. ``ValueError``
    naming the accepted layouts otherwise.
    """
    state = np.asarray(state, dtype=np.float64).reshape(-1)
    accepted = ", ".join(f"{name} [{n}]" for name, (n, _) in STATE_LAYOUTS.items())
    if layout is None:
        matches = [name for name, (n, _) in STATE_LAYOUTS.items() if n == state.shape[0]]
        if not matches:
            raise ValueError(f"observation `state` has shape {state.shape}; HybridVLA accepts {accepted}")
        layout = matches[0]
    if layout not in STATE_LAYOUTS:
        raise KeyError(f"unknown state layout {layout!r}; known: {', '.join(STATE_LAYOUTS)}")
    length, convert = STATE_LAYOUTS[layout]
    if state.shape[0] != length:
        raise ValueError(f"observation `state` has shape {state.shape}; state layout {layout!r} has {length} values")
    return convert(state)
