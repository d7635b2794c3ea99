"""Caches whose store grows as the episode needs it (``grow=True``, what an eager session gets) compute what the
same cache allocated whole computes, bit for bit, through growths that re-lay a wrapped raw ring and move the chunk
slots; and they allocate less."""

import pytest
import torch

from vla_runtime.kv import KVConfig, KVMode, make_cache
from vla_runtime.kv import store as store_module
from vla_runtime.kv.rows import RowsCache

from .cases import PROMPT, episode, tiny_model

# params under which the raw area must grow several times in a 10-step episode (from 4 slots), the rings of the
# sink window and the chunked cache wrap, and the chunked cache compresses, grows its chunk area (from 1 chunk) and
# evicts
GROWING = {
    KVMode.FULL: {},
    KVMode.SINK_WINDOW: {"window": 20, "n_sink": 2},
    KVMode.CHUNKED: {"window": 8, "chunk": 4, "max_chunks": 6},
}


@pytest.fixture
def small_first_area(monkeypatch):
    monkeypatch.setattr(store_module, "INITIAL_RAW_SLOTS", 4)
    monkeypatch.setattr(store_module, "INITIAL_CHUNK_SLOTS", 2)
    monkeypatch.setattr(store_module, "GROWTH_STEP", 4)


def cache_of(mode: KVMode, model, *, grow: bool):
    return make_cache(KVConfig.of(mode, **GROWING[mode]), model.cfg, grow=grow)


@torch.no_grad()
def drive(model, cache, x: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The episode forward by forward, every third one rolled back (as decoded action tokens are); the logits
    [B, N, V] and the store's allocated slots after each forward."""
    out, sizes, start = [], [], 0
    for i, n in enumerate(bounds):
        part = x[:, start : start + n]
        if i % 3 == 2:
            mark = cache.mark()
            out.append(model(inputs_embeds=part, cache=cache))
            cache.rollback(mark)
        else:
            out.append(model(inputs_embeds=part, cache=cache, pin=start + n <= PROMPT))
            start += n
        sizes.append(cache.store.slots)
    return torch.cat(out, dim=1), sizes


@pytest.mark.parametrize("mode", list(GROWING), ids=lambda m: m.value)
def test_a_growing_cache_computes_what_the_whole_allocation_computes(mode, small_first_area):
    model = tiny_model()
    x, bounds = episode(10)
    whole, grown = cache_of(mode, model, grow=False), cache_of(mode, model, grow=True)
    expected, _ = drive(model, whole, x, bounds)
    got, sizes = drive(model, grown, x, bounds)
    assert torch.equal(got, expected)
    assert grown.stats() == whole.stats()
    assert len(set(sizes)) >= 3, f"the store grew only {len(set(sizes)) - 1} times: {sizes}"
    assert grown.store.reserved_bytes() < whole.store.reserved_bytes() / 4
    if mode is KVMode.CHUNKED:
        assert grown.chunks_formed > grown.params.max_chunks  # chunks formed, moved with the growths and evicted
        assert (grown.store.chunk_slots, grown.store.max_chunk_slots) == (7, 7)  # grown from 2 to the budget's 6 + 1
        assert torch.equal(grown.chunk_valid, whole.chunk_valid) and torch.equal(grown.chunk_age, whole.chunk_age)
    grown.reset()  # a new episode keeps the grown buffers
    assert grown.store.slots == sizes[-1]
    assert torch.equal(drive(model, grown, x, bounds)[0], expected)


@pytest.mark.parametrize("mode", list(GROWING), ids=lambda m: m.value)
def test_growing_rows_of_a_batched_forward_compute_what_each_computes_alone(mode, small_first_area):
    """A ``RowsCache`` over growing caches (``vla-runtime serve``): rows that grow at different forwards."""
    model = tiny_model()
    x, bounds = episode(6, batch=2, seed=3)
    alone = [cache_of(mode, model, grow=False) for _ in range(2)]
    rows = [cache_of(mode, model, grow=True) for _ in range(2)]
    with torch.no_grad():  # row 1 starts one step ahead, so the rows grow at different forwards
        for caches in (alone, rows):
            model(inputs_embeds=x[1:, :PROMPT], cache=caches[1], pin=True)
            model(inputs_embeds=x[1:, PROMPT : PROMPT + 40], cache=caches[1])
            model(inputs_embeds=x[:1, :PROMPT], cache=caches[0], pin=True)
        together, start = RowsCache(rows), PROMPT
        for n in bounds[1:]:
            expected = torch.cat([model(inputs_embeds=x[i : i + 1, start : start + n], cache=alone[i]) for i in range(2)])
            # the batched projections round as a batch does (``test_rows``); a misplaced key would be far off
            torch.testing.assert_close(model(inputs_embeds=x[:, start : start + n], cache=together), expected, rtol=1e-5, atol=1e-5)
            start += n
    assert [r.stats() for r in rows] == [a.stats() for a in alone]
    assert rows[0].store.slots < alone[0].store.slots


def test_a_store_doubles_its_raw_area_up_to_its_capacity_and_then_refuses(small_first_area):
    model = tiny_model()
    cache = make_cache(KVConfig.of(KVMode.FULL, capacity=40), model.cfg, grow=True)
    x = torch.randn(1, 41, model.cfg.dim)
    sizes = [cache.store.slots]
    with torch.no_grad():
        for start, end in ((0, 6), (6, 16), (16, 30), (30, 38)):
            model(inputs_embeds=x[:, start:end], cache=cache)
            sizes.append(cache.store.slots)
        # what the forward needs, at least 1.25x, in steps of 4 slots, and never past the capacity
        assert sizes == [4, 8, 16, 32, 40]
        with pytest.raises(ValueError, match="FullCache is full: 38 tokens held"):
            model(inputs_embeds=x[:, 38:41], cache=cache)


def test_static_shapes_refuse_a_growing_store():
    model = tiny_model()
    with pytest.raises(ValueError, match="`grow` needs dynamic shapes"):
        make_cache(KVConfig.of(KVMode.CHUNKED, window=8, chunk=4, max_chunks=4), model.cfg, grow=True, static_shapes=True)
