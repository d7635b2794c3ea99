"""What the ``step_batch`` of every Prismatic family shares: the batch's checks, each row's input validation,
the caches a forward over a set of rows uses, and (CogACT, HybridVLA) the step's first half, vision and prefill.

- ``check_batch``: as many observations as sessions, distinct sessions of this policy.
- ``row_inputs``: each row's inputs read before anything changes; a refused input raises ``BatchInputError``
  naming its row, and no episode has changed.
- ``RowCaches``: a row's own cache when a forward has one row, else one ``RowsCache`` per set of rows, shared by
  the step's forwards over the same rows (OpenVLA's prefill and decode, HybridVLA's prefill and branches).
- ``prefill_batch``: every row's image (and proprio) in one pass of the vision towers, then the step prefixes of
  equal length in one forward each (a history episode's first step pins its prompt alone first).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from ..device import synchronize
from ..kv.base import KVCache
from ..kv.rows import RowsCache
from .base import BatchInputError, Observation

if TYPE_CHECKING:
    from .prismatic_session import PrismaticPolicy, PrismaticSession

R = TypeVar("R")


def check_batch(policy, sessions: Sequence, observations: Sequence[Observation]) -> None:
    """``ValueError`` unless there is one observation per session and the sessions are distinct ones of ``policy``."""
    if len(sessions) != len(observations):
        raise ValueError(f"{len(sessions)} sessions but {len(observations)} observations")
    if len({id(s) for s in sessions}) != len(sessions) or any(s.policy is not policy for s in sessions):
        raise ValueError("step_batch takes distinct sessions of this policy")


def row_inputs(sessions: Sequence, observations: Sequence[Observation], read: Callable[..., R]) -> list[R]:
    """``read(session, observation)`` of every row, in order, once its cache has room for the step
    (``check_room``); the first ``ValueError`` becomes a ``BatchInputError`` with that row's index. ``read`` must
    change nothing of the episode (so a refused batch leaves every episode as it was)."""
    out = []
    for i, (session, obs) in enumerate(zip(sessions, observations)):
        try:
            session.check_room()
            out.append(read(session, obs))
        except ValueError as e:
            raise BatchInputError(i, e) from e
    return out


class RowCaches:
    """The cache a forward over some rows of the batch uses: the session's own cache for one row, else a
    ``RowsCache`` over theirs, one per set of rows for the whole step.

    Args:
        caches: the sessions' caches, one per batch row.
    """

    def __init__(self, caches: Sequence[KVCache]) -> None:
        self.caches = list(caches)
        self._made: dict[tuple[int, ...], RowsCache] = {}

    def __call__(self, rows: Sequence[int]) -> KVCache | RowsCache:
        if len(rows) == 1:
            return self.caches[rows[0]]
        key = tuple(rows)
        if key not in self._made:
            self._made[key] = RowsCache([self.caches[i] for i in key])
        return self._made[key]


@dataclass
class BatchPrefix:
    """The step's first half for every row.

    Args:
        start: ``time.perf_counter()`` when the step began.
        timings: per row, ``vision`` and ``prefill`` milliseconds (the batch's; a pinned prompt's included).
        hidden: per row, the final (post-norm) hidden states of its prefix [1, T_i, dim], now in its cache.
        caches: the step's ``RowCaches`` (``caches(range(B))``: the cache a forward over every row uses).
    """

    start: float
    timings: list[dict]
    hidden: list[torch.Tensor]
    caches: RowCaches


def prefill_batch(policy: "PrismaticPolicy", sessions: Sequence["PrismaticSession"],
                  observations: Sequence[Observation]) -> BatchPrefix:  # fmt: skip
    """Check the batch, read every row's inputs (``BatchInputError`` before any change), run vision over every
    row at once and prefill the step prefixes, rows of one prefix length in one forward."""
    check_batch(policy, sessions, observations)
    start = time.perf_counter()
    def read(session, obs: Observation) -> tuple:
        session.check_prefix(obs.prefix)
        return session.pixels(obs), session._proprio_tokens(obs)

    inputs = row_inputs(sessions, observations, read)
    image_tokens = policy.vlm.embed_image(torch.cat([pixels for pixels, _ in inputs]))  # [B, N, dim]
    synchronize(policy.device)
    vision_ms = (time.perf_counter() - start) * 1e3
    timings = [{"vision": vision_ms, "prefill": 0.0} for _ in sessions]

    t0 = time.perf_counter()
    embeds = [s.context(image_tokens[i : i + 1], inputs[i][1], timings[i]) for i, s in enumerate(sessions)]  # [1, T_i, dim]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(embeds):
        by_length[e.shape[1]].append(i)
    decoder, caches = policy.vlm.language_model.model, RowCaches([s.cache for s in sessions])
    hidden: list[torch.Tensor | None] = [None] * len(sessions)
    for rows in by_length.values():
        out = decoder(inputs_embeds=torch.cat([embeds[i] for i in rows]), cache=caches(rows))  # [b, T, dim]
        for j, i in enumerate(rows):
            hidden[i] = out[j : j + 1]
    synchronize(policy.device)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    for t in timings:
        t["prefill"] += prefill_ms
    return BatchPrefix(start=start, timings=timings, hidden=hidden, caches=caches)
