"""``CogACTPolicy.step_batch``: one step of several CogACT sessions as one batch.

``prismatic_batching.prefill_batch`` runs the first half: every row's image in one pass of the vision towers;
the step prefixes of equal length in one forward through a ``RowsCache`` (each row attends through its own
session's cache: histories of any length step together; a history episode's first step pins its prompt alone
first); then the DiT samples every row's chunk in one DDIM loop, each row starting from the noise its own session's
generator draws, so a row gets the chunk it would get alone (up to float rounding of the batched products).
A row whose observation carries an RTC prefix (``Observation.prefix``) is sampled on its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..device import synchronize
from ..models.cogact.modeling_cogact import CogACT
from .base import Observation, StepResult
from .prismatic_batching import prefill_batch

if TYPE_CHECKING:
    from .cogact import CogACTPolicy, CogACTSession


@torch.inference_mode()
def step_batch(policy: "CogACTPolicy", sessions: list["CogACTSession"], observations: list[Observation]) -> list[StepResult]:
    """See ``Policy.step_batch``. Timings of each result are the batch's (vision, prefill, denoise, total)."""
    prefix = prefill_batch(policy, sessions, observations)
    cognition = [CogACT.cognition(h) for h in prefix.hidden]  # [1, 1, dim] per row

    t0 = time.perf_counter()
    action_model, cfg_scale = policy.model.action_model, policy.config.sampling.cfg_scale
    normalized: list[torch.Tensor | None] = [None] * len(sessions)  # [chunk, A] per row
    plain = [i for i, obs in enumerate(observations) if obs.prefix is None]
    if plain:
        noise = torch.cat([action_model.draw_noise(1, sessions[i].generator) for i in plain])  # each row's own draw
        out = action_model.sample(torch.cat([cognition[i] for i in plain]), cfg_scale=cfg_scale, noise=noise)
        for j, i in enumerate(plain):
            normalized[i] = out[j]
    for i, obs in enumerate(observations):
        if obs.prefix is not None:
            normalized[i] = action_model.sample(cognition[i], cfg_scale=cfg_scale, generator=sessions[i].generator,
                                                inpaint=sessions[i]._inpaint(obs.prefix))[0]  # fmt: skip
    synchronize(policy.device)
    denoise_ms = (time.perf_counter() - t0) * 1e3
    results = []
    for i, s in enumerate(sessions):
        t = prefix.timings[i]
        t["denoise"] = denoise_ms
        actions = s.finish(normalized[i])
        t["total"] = (time.perf_counter() - prefix.start) * 1e3
        results.append(StepResult(actions=actions, timings=t, kv=s.cache.stats()))
    return results
