"""``SlotCache``: the bookkeeping every registered cache shares, written once.

A cache here holds its K/V in one ``SlotStore`` (``k, v: [L, B, Hkv, S, D]``) and counts tokens from the
episode start. What is the same for every cache lives here: the constructor's shape (geometry + the
cache's own params), the open mark and ``rollback``, committing a forward's tokens, the positions used and
the bytes held (read off the store's tensors). A cache adds ``attend``, ``end_forward``, ``stats`` and how
many slots it holds (``held_slots``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

from .base import CacheParams
from .geometry import CacheGeometry
from .store import SlotStore


def check_growth(grow: bool, static_shapes: bool) -> None:
    """A cache whose store grows (``grow``) hands its forwards new buffers now and then, which a forward with static
    shapes (a CUDA graph replaying fixed addresses) cannot take."""
    if grow and static_shapes:
        raise ValueError("`grow` needs dynamic shapes: a cache with `static_shapes` allocates every slot at once")


class SlotCache:
    """Base of every registered cache. A subclass sets ``params_class`` (its hyper-parameter dataclass) and
    builds ``self.store`` in ``__init__`` before calling ``reset()``.

    Args (of every subclass's constructor, which ``make_cache`` calls):
        geometry: the decoder's ``CacheGeometry``.
        params: an instance of ``params_class`` (``None`` = its defaults).
        batch, device, dtype: fixed at construction.
    """

    params_class: ClassVar[type[CacheParams]]
    store: SlotStore
    # n one-token forwards, planned and committed, trace into one graph inside ``tokens_ahead(n)`` (``FullCache``;
    # ``ChunkedGatedCache`` under a mark once it has compressed)
    traces_token_loop: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        params = getattr(cls, "params_class", None)
        if not (isinstance(params, type) and issubclass(params, CacheParams)):
            raise TypeError(f"{cls.__name__} must set `params_class` to its CacheParams dataclass, got {params!r}")

    def __init__(self, geometry: CacheGeometry, params: CacheParams | None = None) -> None:
        """Sets ``geometry`` and ``params`` (a ``params_class``, resolved for the geometry: no unset sizes left);
        the subclass then builds the store."""
        params = self.params_class() if params is None else params
        if not isinstance(params, self.params_class):
            raise ValueError(f"{type(self).__name__} takes {self.params_class.__name__}, got {type(params).__name__}")
        self.geometry = geometry
        self.params = params.resolve(geometry)

    # ---- episode -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the episode's tokens (subclasses also clear their own state, then call this)."""
        self.store.reset()
        self._mark: int | None = None
        self._positions_used = 0
        self.bidirectional = False

    def plan_forward(self, t: int) -> None:
        """Settle the next forward of ``t`` new tokens (slots, positions: host-side bookkeeping) before its layers
        run; ``attend`` does it at the first layer otherwise. A compiled layer pass (``policies.compiled``) calls it
        eagerly first, so the graph reads the plan and stores no Python state. Nothing to settle by default."""

    @property
    def length(self) -> int:
        """Tokens appended since the last reset (held or compressed away)."""
        return self.store.length

    def _commit(self, new: int, n_keys: int) -> bool:
        """The forward's ``new`` tokens are held (its queries used positions up to ``n_keys - 1``). Returns
        whether the cache may change its layout now (compress, trim): not while a mark is open."""
        self.store.commit(new)
        self._positions_used = max(self._positions_used, n_keys)
        return self._mark is None

    # ---- mark / rollback ---------------------------------------------------------------------------
    def mark(self) -> int:
        """Open a mark: no compression until ``rollback`` closes it, so the rollback is exact."""
        self._mark = self.store.length
        return self._mark

    def rollback(self, mark: int) -> None:
        """Drop the tokens appended after ``mark`` and close the open mark."""
        self.store.check_rollback(mark)
        self.store.length = mark
        self._mark = None

    @contextmanager
    def bidirectional_block(self) -> Iterator[int]:
        """Forwards inside append a *query block* that leaves no trace: its tokens attend to everything the
        cache shows and to each other both ways (not causally), at the positions after the held tokens; on
        exit they are rolled back (a mark is open inside, so nothing is compressed meanwhile). Yields the
        mark. OpenVLA-OFT's history mode evaluates its parallel action block this way."""
        if self._mark is not None:
            raise ValueError("bidirectional_block needs no open mark (it opens and closes its own)")
        mark = self.mark()
        self.bidirectional = True
        try:
            yield mark
        finally:
            self.bidirectional = False
            self.rollback(mark)

    # ---- bytes -------------------------------------------------------------------------------------
    def held_slots(self) -> int:
        """Slots holding a token or chunk, summed over layers."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Bytes of K/V held: the store's per-slot bytes (K and V, all batch rows and heads) x ``held_slots``."""
        return self.store.slot_bytes() * self.held_slots()
