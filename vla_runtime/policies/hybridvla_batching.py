"""``HybridVLAPolicy.step_batch``: one step of several HybridVLA sessions as one batch.

``prismatic_batching.prefill_batch`` runs vision (and the proprio embedder) over every row in one pass and the
step prefixes of equal length in one forward through a ``RowsCache``; then both branches over every row at once
on the cached prefixes: the DDIM loop inside the LLM (each step's ``[t, x]`` appended and rolled back on every
row's cache) and the AR decode.
Each row takes its random draws (diffusion noise, AR t and noise) from its own session's generator in the
order a step alone takes them, so it gets the actions it gets alone (up to float rounding of the batched
products). Alone, single mode runs the prefix together with the first DDIM step; here it is prefilled first
(a ``RowsCache`` rolls back to marks, not to token counts), which changes no value.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..device import synchronize
from ..models.hybridvla.modeling_hybridvla import denoise_on_cache
from .base import Observation, StepResult
from .hybridvla import decode_ar_branch
from .prismatic_batching import prefill_batch

if TYPE_CHECKING:
    from .hybridvla import HybridVLAPolicy, HybridVLASession


@torch.inference_mode()
def step_batch(policy: "HybridVLAPolicy", sessions: list["HybridVLASession"], observations: list[Observation]) -> list[StepResult]:
    """See ``Policy.step_batch``. Timings of each result are the batch's (vision, prefill, denoise, decode, total)."""
    prefix = prefill_batch(policy, sessions, observations)
    draws = [s.draw() for s in sessions]
    cache = prefix.caches(range(len(sessions)))
    run_diff, run_ar = policy.config.sampling.branches
    normalized = ids = conf = None
    t0 = time.perf_counter()
    if run_diff:
        noise = torch.cat([d.diff_noise for d in draws])  # [B, chunk, A]
        normalized = denoise_on_cache(policy.model.lm, policy.model.head, cache, policy.diffusion, noise)
    synchronize(policy.device)
    denoise_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    if run_ar:
        # one empty-token id for every row: the policy's tokenizer gives each prompt the same
        ids, conf = decode_ar_branch(policy, cache, torch.cat([d.ar_noise for d in draws]), torch.cat([d.t for d in draws]),
                                     sessions[0].prompt.empty)  # fmt: skip
    synchronize(policy.device)
    decode_ms = (time.perf_counter() - t0) * 1e3
    results = []
    for i, s in enumerate(sessions):
        t = prefix.timings[i]
        if run_diff:
            t["denoise"] = denoise_ms
        if run_ar:
            t["decode"] = decode_ms
        actions = s.finish(None if normalized is None else normalized[i], None if ids is None else ids[i],
                           None if conf is None else conf[i])  # fmt: skip
        t["total"] = (time.perf_counter() - prefix.start) * 1e3
        results.append(StepResult(actions=actions, timings=t, kv=s.cache.stats()))
    return results
