"""HybridVLA processing: AR action tokens <-> normalised actions, and the collaborative ensemble. No ``nn.Module``.

Action tokens are OpenVLA's 256-bin scheme shifted by ``need_to_sub``:
``id = (32000 - need_to_sub) - digitize(clip(a, -1, 1), linspace(-1, 1, 256))``; decoding maps
``d = (32000 - need_to_sub) - id`` to bin centre ``clip(d - 1, 0, 254)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..normalization import binarize_gripper, gripper_dims
from .configuration_hybridvla import TEXT_VOCAB_SIZE, CollaborativeEnsembleConfig

N_BINS = 256


@dataclass(frozen=True)
class ARActionCodec:
    """Normalised actions in [-1, 1] <-> action token ids.

    Args:
        need_to_sub: shift of the id range below the text vocabulary (0 -> ids 31744..31999).
        n_bins: bin edges over [-1, 1] (255 centres).
    """

    need_to_sub: int = 0
    n_bins: int = N_BINS

    @property
    def vocab_end(self) -> int:
        return TEXT_VOCAB_SIZE - self.need_to_sub

    @property
    def token_range(self) -> tuple[int, int]:
        """Inclusive [lowest, highest] id an action can take."""
        return self.vocab_end - self.n_bins, self.vocab_end - 1

    def encode(self, actions: np.ndarray) -> np.ndarray:
        """actions: [..., D] normalised -> int64 ids [..., D]."""
        bins = np.linspace(-1.0, 1.0, self.n_bins)
        return (self.vocab_end - np.digitize(np.clip(actions, -1.0, 1.0), bins)).astype(np.int64)

    def decode(self, ids: np.ndarray) -> np.ndarray:
        """ids: [..., D] -> float64 bin centres [..., D] in [-1, 1]."""
        bins = np.linspace(-1.0, 1.0, self.n_bins)
        centres = (bins[:-1] + bins[1:]) / 2.0
        return centres[np.clip(self.vocab_end - np.asarray(ids, dtype=np.int64) - 1, 0, self.n_bins - 2)]


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
