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
