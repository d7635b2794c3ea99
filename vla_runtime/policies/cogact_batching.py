"""``CogACTPolicy.step_batch``: one step of several CogACT sessions as one batch.

As ``openvla_batching`` does for OpenVLA: every row's image in one pass of the vision towers; the step
prefixes of equal length in one forward through a ``RowsCache`` (each row attends through its own session's
cache: histories of any length step together; a history episode's first step pins its prompt alone first);
then the DiT samples every row's chunk in one DDIM loop, each row starting from the noise its own session's
generator draws, so a row gets the chunk it would get alone (up to float rounding of the batched products).
A row whose observation carries an RTC prefix (``Observation.prefix``) is sampled on its own.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from ..device import synchronize
from ..kv.rows import RowsCache
from ..models.cogact.modeling_cogact import CogACT
from .base import BatchInputError, Observation, StepResult

if TYPE_CHECKING:
    from .cogact import CogACTPolicy, CogACTSession


@torch.inference_mode()
def step_batch(policy: "CogACTPolicy", sessions: list["CogACTSession"], observations: list[Observation]) -> list[StepResult]:
    """See ``Policy.step_batch``. Timings of each result are the batch's (vision, prefill, denoise, total)."""
    if len(sessions) != len(observations):
        raise ValueError(f"{len(sessions)} sessions but {len(observations)} observations")
    if len({id(s) for s in sessions}) != len(sessions) or any(s.policy is not policy for s in sessions):
        raise ValueError("step_batch takes distinct sessions of this policy")
    start = time.perf_counter()
    pixels = []
    for i, (session, obs) in enumerate(zip(sessions, observations)):
        try:
            pixels.append(session.pixels(obs))  # nothing of any episode has changed yet
        except ValueError as e:
            raise BatchInputError(i, e) from e
    image_tokens = policy.vlm.embed_image(torch.cat(pixels))  # [B, N, dim]
    synchronize(policy.device)
    vision_ms = (time.perf_counter() - start) * 1e3
    timings = [{"vision": vision_ms, "prefill": 0.0} for _ in sessions]

    t0 = time.perf_counter()
    embeds = [s.context(image_tokens[i : i + 1], [], timings[i]) for i, s in enumerate(sessions)]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(embeds):
        by_length[e.shape[1]].append(i)
    decoder = policy.vlm.language_model.model
    cognition: list[torch.Tensor | None] = [None] * len(sessions)  # [1, 1, dim] per row
    for rows in by_length.values():
        cache = sessions[rows[0]].cache if len(rows) == 1 else RowsCache([sessions[i].cache for i in rows])
        hidden = decoder(inputs_embeds=torch.cat([embeds[i] for i in rows]), cache=cache)  # [b, T, dim]
        for j, i in enumerate(rows):
            cognition[i] = CogACT.cognition(hidden[j : j + 1])
    synchronize(policy.device)
    prefill_ms = (time.perf_counter() - t0) * 1e3

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
        t = timings[i]
        t["prefill"] += prefill_ms
        t["denoise"] = denoise_ms
        actions = s.finish(normalized[i])
        t["total"] = (time.perf_counter() - start) * 1e3
        results.append(StepResult(actions=actions, timings=t, kv=s.cache.stats()))
    return results
