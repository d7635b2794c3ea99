"""``HybridVLAPolicy.step_batch``: one step of several HybridVLA sessions as one batch.

Vision (and the proprio embedder) over every row in one pass; the step prefixes of equal length in one
forward through a ``RowsCache``; then both branches over every row at once on the cached prefixes: the DDIM
loop inside the LLM (each step's ``[t, x]`` appended and rolled back on every row's cache) and the AR decode.
Each row takes its random draws (diffusion noise, AR t and noise) from its own session's generator in the
order a step alone takes them, so it gets the actions it gets alone (up to float rounding of the batched
products). Alone, single mode runs the prefix together with the first DDIM step; here it is prefilled first
(a ``RowsCache`` rolls back to marks, not to token counts), which changes no value.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from ..device import synchronize
from ..kv.rows import RowsCache
from ..models.hybridvla.modeling_hybridvla import denoise_on_cache
from .base import BatchInputError, Observation, StepResult
from .hybridvla import decode_ar_branch

if TYPE_CHECKING:
    from .hybridvla import HybridVLAPolicy, HybridVLASession


@torch.inference_mode()
def step_batch(policy: "HybridVLAPolicy", sessions: list["HybridVLASession"], observations: list[Observation]) -> list[StepResult]:
    """See ``Policy.step_batch``. Timings of each result are the batch's (vision, prefill, denoise, decode, total)."""
    if len(sessions) != len(observations):
        raise ValueError(f"{len(sessions)} sessions but {len(observations)} observations")
    if len({id(s) for s in sessions}) != len(sessions) or any(s.policy is not policy for s in sessions):
        raise ValueError("step_batch takes distinct sessions of this policy")
    start = time.perf_counter()
    pixels, proprio = [], []
    for i, (session, obs) in enumerate(zip(sessions, observations)):
        try:  # nothing of any episode has changed yet
            pixels.append(session.pixels(obs))
            proprio.append(session._proprio_tokens(obs))
        except ValueError as e:
            raise BatchInputError(i, e) from e
    image_tokens = policy.vlm.embed_image(torch.cat(pixels))  # [B, N, dim]
    synchronize(policy.device)
    vision_ms = (time.perf_counter() - start) * 1e3
    timings = [{"vision": vision_ms, "prefill": 0.0} for _ in sessions]

    t0 = time.perf_counter()
    embeds = [s.context(image_tokens[i : i + 1], proprio[i], timings[i]) for i, s in enumerate(sessions)]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(embeds):
        by_length[e.shape[1]].append(i)
    decoder = policy.vlm.language_model.model
    for rows in by_length.values():
        cache = sessions[rows[0]].cache if len(rows) == 1 else RowsCache([sessions[i].cache for i in rows])
        decoder(inputs_embeds=torch.cat([embeds[i] for i in rows]), cache=cache)
    synchronize(policy.device)
    prefill_ms = (time.perf_counter() - t0) * 1e3

    draws = [s.draw() for s in sessions]
    cache = sessions[0].cache if len(sessions) == 1 else RowsCache([s.cache for s in sessions])
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
        t = timings[i]
        t["prefill"] += prefill_ms
        if run_diff:
            t["denoise"] = denoise_ms
        if run_ar:
            t["decode"] = decode_ms
        actions = s.finish(None if normalized is None else normalized[i], None if ids is None else ids[i],
                           None if conf is None else conf[i])  # fmt: skip
        t["total"] = (time.perf_counter() - start) * 1e3
        results.append(StepResult(actions=actions, timings=t, kv=s.cache.stats()))
    return results
