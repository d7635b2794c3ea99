"""CogACT processing: the cognition-token suffix and the adaptive action ensemble. No ``nn.Module``.

The prompt is OpenVLA's (``In: What action should the robot take to {instruction}?\\nOut:``); CogACT
appends the empty token 29871 and EOS (id 2). EOS is the "cognition token": the LLM's final-norm
hidden state there conditions the DiT (CogACT issue #12).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..action_postprocess import binarize_gripper, gripper_dims
from .configuration_cogact import AdaptiveEnsembleConfig


def cognition_suffix(empty_id: int, eos_id: int) -> tuple[int, ...]:
    """What CogACT appends after ``\nOut:``: the empty token (29871) and EOS (2), the cognition token."""
    return (empty_id, eos_id)


def ensemble_weights(candidates: np.ndarray, alpha: float) -> np.ndarray:
    """Weights of the adaptive ensemble: softmax over ``alpha * cos(candidate_j, newest)``.

    candidates: [n, D], the newest prediction last. Cosine over all D dims (the 0/1 gripper included,
    as upstream), with 1e-7 in the denominator. Returns [n] summing to 1.
    """
    ref = candidates[-1]
    cos = candidates @ ref / (np.linalg.norm(candidates, axis=1) * np.linalg.norm(ref) + 1e-7)
    w = np.exp(alpha * cos)
    return w / w.sum()


class AdaptiveEnsembler:
    """Per-episode state of CogACT's adaptive action ensemble (``sim_cogact/adaptive_ensemble.py``).

    Keeps the last K predicted chunks. The action for now combines, for each chunk predicted j steps
    ago, its row j (oldest chunk contributes row n-1, the newest row 0), weighted by ``ensemble_weights``;
    the gripper is binarised again at 0.5 afterwards (deploy.py).
    """

    def __init__(self, cfg: AdaptiveEnsembleConfig) -> None:
        if cfg.horizon is None:
            raise ValueError("AdaptiveEnsembler needs `horizon` (K) set")
        self.cfg = cfg
        self._chunks: deque[np.ndarray] = deque(maxlen=cfg.horizon)

    def __call__(self, chunk: np.ndarray) -> np.ndarray:
        """chunk: [chunk_len, D] in robot units, newest prediction. Returns the action to execute [D]."""
        chunk = np.asarray(chunk, dtype=np.float64)
        if chunk.ndim != 2:
            raise ValueError(f"chunk must be [chunk_len, action_dim], got shape {chunk.shape}")
        self._chunks.append(chunk)
        n = len(self._chunks)
        if n > chunk.shape[0]:
            raise ValueError(f"ensemble horizon {self.cfg.horizon} exceeds the chunk length {chunk.shape[0]}")
        candidates = np.stack([c[n - 1 - i] for i, c in enumerate(self._chunks)])  # [n, D], newest last
        action = ensemble_weights(candidates, self.cfg.alpha) @ candidates
        return binarize_gripper(action, gripper_dims(action.shape[-1]), half_is_open=False)

    def reset(self) -> None:
        self._chunks.clear()

    def __len__(self) -> int:
        return len(self._chunks)
