"""``OpenVLAPolicy.step_batch``: one step of several OpenVLA sessions as one batch.

The sessions' caches may hold different histories (lengths, retained chunks, positions): the forward runs
with a ``RowsCache``, so projections, MLPs, the vision towers and the action head see the whole batch while
each row attends through its own session's cache. A step has three batched parts:

- vision: every row's image (and proprio) in one pass of the towers and projector;
- prefill: rows whose step sequences have the same length in one forward (history mode after its first
  step: every row; single mode: rows with prompts of the same token length); a history episode's first step
  pins its prompt on its own first;
- decode: all rows together, one token per forward.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from ..device import synchronize
from ..models.generation import decode
from .base import Observation, StepResult
from .prismatic_batching import RowCaches, check_batch, row_inputs

if TYPE_CHECKING:
    from .openvla import OpenVLAPolicy, OpenVLASession


@torch.inference_mode()
def step_batch(policy: "OpenVLAPolicy", sessions: list["OpenVLASession"], observations: list[Observation]) -> list[StepResult]:
    """See ``Policy.step_batch``. Timings of each result are the batch's (vision, prefill, decode, total)."""
    check_batch(policy, sessions, observations)
    start = time.perf_counter()
    inputs = row_inputs(sessions, observations, lambda s, o: s.inputs(o))  # nothing of any episode has changed yet
    pixels = torch.cat([p for p, _ in inputs])  # [B, C, S, S]
    states = None if inputs[0][1] is None else torch.cat([s for _, s in inputs])  # [B, P]
    image_tokens, proprio = sessions[0]._embed_observation(pixels, states)  # [B, N, dim], [[B, 1, dim]] or []
    synchronize(policy.device)
    vision_ms = (time.perf_counter() - start) * 1e3
    timings = [{"vision": vision_ms, "prefill": 0.0, "decode": 0.0} for _ in sessions]

    t0 = time.perf_counter()
    embeds = [s.context(image_tokens[i : i + 1], [p[i : i + 1] for p in proprio], timings[i]) for i, s in enumerate(sessions)]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(embeds):
        by_length[e.shape[1]].append(i)
    decoder = policy.model.language_model.model
    head = sessions[0].token_head()  # one policy: the same action ids for every session
    first: list[torch.Tensor | None] = [None] * len(sessions)  # the logits after each prompt, [1, V']
    caches = RowCaches([s.cache for s in sessions])
    for rows in by_length.values():
        hidden = decoder(inputs_embeds=torch.cat([embeds[i] for i in rows]), cache=caches(rows))  # [b, T, dim]
        logits = head.logits(hidden[:, -1])  # [b, V']
        for j, i in enumerate(rows):
            first[i] = logits[j : j + 1]
    synchronize(policy.device)
    prefill_ms = (time.perf_counter() - t0) * 1e3

    t0 = time.perf_counter()
    by_dim: dict[int, list[int]] = defaultdict(list)  # sessions of different datasets may differ in action_dim
    for i, s in enumerate(sessions):
        by_dim[s.action_dim].append(i)
    ids: list[torch.Tensor | None] = [None] * len(sessions)
    for dim, rows in by_dim.items():
        cache = caches(rows)
        marks = [sessions[i].open_decode() for i in rows]
        out = decode(lambda tok: head.logits(decoder(tok, cache=cache)[:, -1]), torch.cat([first[i] for i in rows]), head.pick,
                     max_new_tokens=dim)  # [b, action_dim]
        for i, mark in zip(rows, marks):
            sessions[i].close_decode(mark)
        for j, i in enumerate(rows):
            ids[i] = out[j : j + 1]
    synchronize(policy.device)
    decode_ms = (time.perf_counter() - t0) * 1e3
    for t in timings:
        t["prefill"] += prefill_ms
        t["decode"] = decode_ms
    return [s.finish(ids[i], timings[i], start) for i, s in enumerate(sessions)]
