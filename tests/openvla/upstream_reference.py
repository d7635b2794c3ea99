"""Upstream OpenVLA's decoding, written out plainly for tests: no cache reuse, numpy bin mapping.

``greedy_ids`` re-runs the whole multimodal sequence for every token (a fresh ``FullCache`` each time) and
takes the argmax over the whole vocabulary (``predict_action`` calling ``generate``) or over the action
ids only (our default). ``ids_to_actions`` is ``predict_action``'s mapping: ``clip(vocab - id - 1, 0,
n_bins - 2)`` -> bin centre -> ``0.5 * (x + 1) * (q99 - q01) + q01`` where the mask is set.
"""

import numpy as np
import torch

from vla_runtime.kv import FullCache, FullParams


@torch.no_grad()
def greedy_ids(policy, pixels: torch.Tensor, input_ids: list[int], n: int, *, full_vocab: bool) -> list[int]:
    """pixels [1, C, S, S], input_ids upstream's prompt ids (BOS first) -> ``n`` greedy token ids."""
    cfg = policy.config
    first, last = cfg.action_token_range
    ids = list(input_ids)
    for _ in range(n):
        cache = FullCache(cfg.llm.geometry, FullParams(capacity=len(ids) + cfg.vision.num_patches + 1))
        logits = policy.model(pixels, torch.tensor([ids]), cache=cache)[0, -1]  # [V]
        ids.append(int(logits.argmax()) if full_vocab else first + int(logits[first : last + 1].argmax()))
    return ids[len(input_ids) :]


def ids_to_actions(ids, *, vocab_size: int, n_bins: int, action_stats: dict) -> np.ndarray:
    """Token ids [D] -> actions [D] in robot units, as upstream's ``predict_action``."""
    bins = np.linspace(-1, 1, n_bins)
    centers = (bins[:-1] + bins[1:]) / 2.0
    normalized = centers[np.clip(vocab_size - np.asarray(ids) - 1, 0, centers.shape[0] - 1)]
    q01, q99 = np.asarray(action_stats["q01"]), np.asarray(action_stats["q99"])
    mask = np.asarray(action_stats.get("mask", [True] * len(q01)))
    return np.where(mask, 0.5 * (normalized + 1) * (q99 - q01) + q01, normalized)
