"""Actions per tick: chunks placed on the tick grid, overlapping predictions blended.

A chunk ``[H, action_dim]`` placed at tick ``k0`` predicts tick ``k0 + i`` with row ``i``. Every tick
keeps the predictions it received (oldest first) until it is served; ``pop`` blends them.
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from .config import Blend


class Missed(str, Enum):
    """What ``ChunkBroker.pop(k)`` does with predictions for earlier ticks that were never served (no tick
    callback ran for them: a tick spent starting an episode, an executor starved for more than a period).

    ``DROP``: time-indexed chunk rows (latency skipping): too old for tick ``k``. ``NEWEST``: a single-action
    policy: its newest action serves ``k``. ``SHIFT``: chunk rows executed in order (no latency skipping):
    the oldest serves ``k`` and the rest move back by as many ticks.
    """

    DROP = "drop"
    NEWEST = "newest"
    SHIFT = "shift"


def blend(predictions: list[np.ndarray], mode: Blend, *, temporal_coeff: float, adaptive_alpha: float) -> np.ndarray:
    """One action from the predictions for one tick.

    Args:
        predictions: ``n`` arrays [action_dim], oldest first.
        mode: ``Blend.NONE`` and ``RTC`` (the newest), ``TEMPORAL`` (ACT: ``w_i = exp(-m i)``, ``i = 0`` oldest) or
            ``ADAPTIVE`` (CogACT: ``w_i = exp(alpha * cos(a_i, a_newest))``).
    Returns:
        [action_dim] float64.
    """
    stack = np.stack(predictions).astype(np.float64)  # [n, action_dim]
    if mode in (Blend.NONE, Blend.RTC) or len(predictions) == 1:
        return stack[-1]
    if mode is Blend.TEMPORAL:
        weights = np.exp(-temporal_coeff * np.arange(len(stack)))  # [n]
    elif mode is Blend.ADAPTIVE:
        newest = stack[-1]
        norms = np.linalg.norm(stack, axis=1) * np.linalg.norm(newest)  # [n]
        cos = np.where(norms > 0, stack @ newest / np.where(norms > 0, norms, 1.0), 0.0)  # [n]
        weights = np.exp(adaptive_alpha * cos)
    else:
        raise KeyError(f"unknown blend {mode!r}; expected one of {', '.join(m.value for m in Blend)}")
    return (weights[:, None] * stack).sum(axis=0) / weights.sum()


class ChunkBroker:
    """Predicted actions keyed by the tick they serve.

    Args:
        mode, temporal_coeff, adaptive_alpha: see ``blend``.
    """

    def __init__(self, mode: Blend = Blend.NONE, *, temporal_coeff: float = 0.01, adaptive_alpha: float = 0.1) -> None:
        self.mode = mode
        self.temporal_coeff = temporal_coeff
        self.adaptive_alpha = adaptive_alpha
        self._ticks: dict[int, list[np.ndarray]] = {}

    def place(self, chunk: np.ndarray, k0: int, *, first_open: int) -> tuple[int, int]:
        """Put ``chunk`` [H, action_dim] at ticks ``k0 .. k0 + H - 1``; rows for ticks before ``first_open``
        (already served) are skipped. Returns (rows skipped, rows that overlap a queued prediction)."""
        skipped = overlapped = 0
        for i, action in enumerate(np.asarray(chunk, dtype=np.float64)):
            k = k0 + i
            if k < first_open:
                skipped += 1
                continue
            if k in self._ticks:
                overlapped += 1
            self._ticks.setdefault(k, []).append(action)
        return skipped, overlapped

    def pop(self, k: int, missed: Missed = Missed.DROP) -> np.ndarray | None:
        """The action for tick ``k`` (blended), or ``None``; afterwards nothing is queued for ticks <= ``k``.

        ``missed``: what becomes of predictions for earlier ticks that were never served (``Missed``).
        """
        earlier = sorted(t for t in self._ticks if t < k)
        if earlier and missed is Missed.SHIFT:
            delay = k - earlier[0]
            self._ticks = {t + delay: p for t, p in self._ticks.items()}
            earlier = []
        predictions = self._ticks.pop(k, None)
        if not predictions and earlier and missed is Missed.NEWEST:
            predictions = self._ticks[earlier[-1]]
        for old in earlier:
            del self._ticks[old]
        if not predictions:
            return None
        return blend(predictions, self.mode, temporal_coeff=self.temporal_coeff, adaptive_alpha=self.adaptive_alpha)

    def peek(self, k: int) -> np.ndarray | None:
        """What ``pop(k)`` would return now (blended), leaving the queue as it is; ``None`` if nothing is queued for ``k``."""
        predictions = self._ticks.get(k)
        if not predictions:
            return None
        return blend(predictions, self.mode, temporal_coeff=self.temporal_coeff, adaptive_alpha=self.adaptive_alpha)

    def serves(self, k: int, missed: Missed = Missed.DROP) -> bool:
        """Whether ``pop(k, missed)`` would return an action."""
        return bool(self._ticks.get(k)) or (missed is not Missed.DROP and any(t < k for t in self._ticks))

    def last_tick(self) -> int | None:
        """The last tick with a prediction (``None`` when empty)."""
        return max(self._ticks) if self._ticks else None

    def queued_from(self, k: int) -> int:
        """Ticks from ``k`` on that have a prediction."""
        return sum(1 for t in self._ticks if t >= k)

    def clear(self) -> None:
        self._ticks.clear()

    def __len__(self) -> int:
        return len(self._ticks)
