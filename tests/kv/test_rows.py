"""RowsCache: a batched forward whose rows attend through their own caches equals each row run alone,
for every cache of the matrix, while the rows hold different histories."""

import pytest
import torch

from vla_runtime.kv import ChunkedGatedCache, ChunkGate, FullCache, KVMode, make_cache
from vla_runtime.kv.rows import RowsCache

from .cases import COMPRESSING, REGISTERED, build, episode, kv, tiny_model


@pytest.mark.parametrize("level", ["easy", "hard"])
@pytest.mark.parametrize("mode", REGISTERED, ids=lambda m: m.value)
def test_rows_equal_separate_streams(mode, level):
    rows_equal_separate_streams(mode, level)


def test_rows_with_chunk_mass_equal_separate_streams():
    """The row seam hands each row's chunk score bias (``chunk_mass``) to its own attention."""
    rows_equal_separate_streams(KVMode.CHUNKED, "hard", chunk_mass=True)


@torch.no_grad()
def rows_equal_separate_streams(mode, level, **overrides):
    model = tiny_model()
    x, bounds = episode(4, batch=2, seed=1)
    alone = [build(mode, level, model, **overrides) for _ in range(2)]
    rows = [build(mode, level, model, **overrides) for _ in range(2)]
    assert all(r.row_batching for r in rows if isinstance(r, ChunkedGatedCache))
    # row 1 runs one extra step first, alone: from then on the two rows hold different lengths
    extra = torch.randn(1, bounds[1], x.shape[2], generator=torch.Generator().manual_seed(7))
    model(inputs_embeds=x[1:, : bounds[0]], cache=alone[1], pin=True)
    model(inputs_embeds=x[1:, : bounds[0]], cache=rows[1], pin=True)
    model(inputs_embeds=extra, cache=alone[1])
    model(inputs_embeds=extra, cache=rows[1])
    model(inputs_embeds=x[:1, : bounds[0]], cache=alone[0], pin=True)
    model(inputs_embeds=x[:1, : bounds[0]], cache=rows[0], pin=True)
    together = RowsCache(rows)
    start = bounds[0]
    for n in bounds[1:]:
        expected = torch.cat([model(inputs_embeds=x[i : i + 1, start : start + n], cache=alone[i]) for i in range(2)])
        torch.testing.assert_close(model(inputs_embeds=x[:, start : start + n], cache=together), expected, rtol=1e-5, atol=1e-5)
        start += n
    for a, r in zip(alone, rows):
        assert a.stats() == r.stats()
    assert rows[0].stats().tokens_seen != rows[1].stats().tokens_seen
    assert together.stats().tokens_seen == sum(r.stats().tokens_seen for r in rows)


@torch.no_grad()
def test_mark_and_rollback_reach_every_row():
    model = tiny_model()
    x, bounds = episode(2, batch=2)
    rows = [build(KVMode.FULL, "easy", model) for _ in range(2)]
    together = RowsCache(rows)
    model(inputs_embeds=x[:, : bounds[0]], cache=together, pin=True)
    held = [r.stats().tokens_seen for r in rows]
    mark = together.mark()
    model(inputs_embeds=x[:, bounds[0] : bounds[0] + bounds[1]], cache=together)
    together.rollback(mark)
    assert [r.stats().tokens_seen for r in rows] == held
    with pytest.raises(ValueError, match="unknown RowsCache mark"):
        together.rollback(mark)
    with pytest.raises(ValueError, match="batch of 1 rows for 2 caches"):
        model(inputs_embeds=x[:1, :3], cache=together)
    old = together.mark()  # a mark of this episode is not one of the next
    together.reset()
    model(inputs_embeds=x[:, : bounds[0]], cache=together, pin=True)
    with pytest.raises(ValueError, match="unknown RowsCache mark"):
        together.rollback(old)
    assert together.mark() == 0


def held_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K/V a cache holds in attention order (the store's slots, not its scratch space)."""
    s = cache.store
    if isinstance(cache, FullCache):
        return [(s.k[layer, :, :, : s.length], s.v[layer, :, :, : s.length]) for layer in range(s.k.shape[0])]
    raw = s.token_slots(s.raw_head, s.length)
    chunks = cache._retained_slots() if isinstance(cache, ChunkedGatedCache) else [raw[:0]] * s.k.shape[0]
    slots = [torch.cat((torch.arange(s.n_pinned), c, raw)) for c in chunks]
    return [(s.k[layer].index_select(2, idx), s.v[layer].index_select(2, idx)) for layer, idx in enumerate(slots)]


@pytest.mark.parametrize("level", ["easy", "hard"])
@pytest.mark.parametrize("mode", REGISTERED, ids=lambda m: m.value)
@torch.no_grad()
def test_ragged_rows_attend_batched_as_row_by_row(mode, level):
    """Four rows of three lengths (prompts of 5, 2, 9 and 5 tokens, row 1 a step ahead): prefills, decodes,
    rolled-back forwards and bidirectional blocks through a RowsCache on the RowSeam (queries and keys rotated
    for all rows at once, stores written once per forward) give bit for bit the outputs and held K/V of the same
    RowsCache routing every row through its cache's own ``attend``, and each cache's alone up to the rounding of
    batched projections."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    streams = {name: [build(mode, level, model) for _ in range(4)] for name in ("alone", "batched", "row_by_row")}
    if mode is KVMode.CHUNKED:  # layer 1 drops every chunk: its rows hold fewer keys than the other layer's
        for caches in streams.values():
            for c in caches:
                c.gate.tau[1] = 1e3
    for i, prompt in enumerate([5, 2, 9, 5]):
        x = torch.randn(1, prompt, 64, generator=gen)
        for caches in streams.values():
            model(inputs_embeds=x, cache=caches[i], pin=True)
    ahead = torch.randn(1, 12, 64, generator=gen)
    for caches in streams.values():
        model(inputs_embeds=ahead, cache=caches[1])
    batched, row_by_row = RowsCache(streams["batched"]), RowsCache(streams["row_by_row"])
    row_by_row.batched = False
    assert batched.batched

    def forward(x: torch.Tensor) -> None:
        out = model(inputs_embeds=x, cache=batched)
        assert torch.equal(out, model(inputs_embeds=x, cache=row_by_row))
        alone = torch.cat([model(inputs_embeds=x[i : i + 1], cache=c) for i, c in enumerate(streams["alone"])])
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)

    def rolled_back(x: torch.Tensor, *, block: bool = False) -> None:
        marks = {name: [c.mark() for c in caches] for name, caches in streams.items()}
        mark = batched.mark(), row_by_row.mark()
        for caches in streams.values():
            for c in caches:
                c.bidirectional = block  # what ``bidirectional_block`` sets inside its mark
        forward(x)
        for name, caches in streams.items():
            for c, m in zip(caches, marks[name]):
                c.bidirectional = False
                c.rollback(m)
        batched._marks.pop(), row_by_row._marks.pop()
        assert mark == (0, 0)

    for _ in range(4):  # a control step: a prefill, single-token decodes, forwards that leave no trace
        forward(torch.randn(4, 12, 64, generator=gen))
        for _ in range(3):
            forward(torch.randn(4, 1, 64, generator=gen))
        rolled_back(torch.randn(4, 2, 64, generator=gen))
        rolled_back(torch.randn(4, 3, 64, generator=gen), block=True)
    forward(torch.randn(4, 1, 64, generator=gen))  # lands on the slots the rolled-back tokens took
    for a, b, r in zip(*streams.values()):
        assert a.stats() == b.stats() == r.stats()
        for (ka, va), (kb, vb), (kr, vr) in zip(held_kv(a), held_kv(b), held_kv(r)):
            assert torch.equal(kb, kr) and torch.equal(vb, vr)
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)
    lengths = [c.stats().tokens_seen for c in streams["batched"]]
    assert lengths[0] == lengths[3] and len(set(lengths)) == 3  # the rows really are ragged
    if level == "hard" and mode in COMPRESSING:
        assert all(c.store.raw_head > c.store.n_pinned for c in streams["batched"])  # and compressed on the way
    if level == "hard" and mode is KVMode.CHUNKED:
        assert all(c.retained_per_layer()[0] > c.retained_per_layer()[1] == 0 for c in streams["batched"])


def test_rows_attend_on_their_own_without_the_row_seam():
    """A cache without ``row_batching`` (e.g. a Triton-backed one) makes the RowsCache route row by row."""
    model = tiny_model()
    rows = [build(KVMode.FULL, "easy", model) for _ in range(2)]
    assert RowsCache(rows).batched
    rows[1].row_batching = False
    assert not RowsCache(rows).batched


@torch.no_grad()
def test_rows_sharing_a_gate_compress_in_one_pass_as_each_alone():
    """Four chunked caches sharing one policy gate (trained-looking: scores straddle tau, and the 3-chunk budget
    evicts): ending their forwards together runs the gate's aggregator and LSTM once per forward for every row
    that forms chunks, and each cache keeps the same chunks, LSTM state and K/V as when it runs alone."""
    model = tiny_model()
    cfg = kv(KVMode.CHUNKED, "hard")
    torch.manual_seed(1)
    gate = ChunkGate(cfg.gate_config(model.cfg.geometry))
    gate.readout_weight.normal_(0.0, 3.0)
    gate.key_aggregator.fc2_weight.normal_(0.0, 0.05)
    alone = [make_cache(cfg, model.cfg, gate=gate) for _ in range(4)]
    rows = [make_cache(cfg, model.cfg, gate=gate) for _ in range(4)]
    gen = torch.Generator().manual_seed(5)
    for i, prompt in enumerate([5, 2, 9, 5]):
        x = torch.randn(1, prompt, 64, generator=gen)
        for caches in (alone, rows):
            model(inputs_embeds=x, cache=caches[i], pin=True)
    together, calls = RowsCache(rows), []
    score = gate.score
    gate.score = lambda k_rep, *a, **kw: calls.append(k_rep.shape[1]) or score(k_rep, *a, **kw)
    for _ in range(6):
        for t in (12, 1, 1):
            x = torch.randn(4, t, 64, generator=gen)
            expected = torch.cat([model(inputs_embeds=x[i : i + 1], cache=c) for i, c in enumerate(alone)])
            torch.testing.assert_close(model(inputs_embeds=x, cache=together), expected, rtol=1e-5, atol=1e-5)
    assert calls and 4 in calls  # rows compressed together, not only one by one
    kept = [c.retained_starts() for c in rows]
    assert kept == [c.retained_starts() for c in alone]
    assert any(0 < len(layer) for k in kept for layer in k) and any(c.stats().chunks_dropped for c in rows)
    for a, r in zip(alone, rows):
        assert a.stats() == r.stats()
        for x, y in zip(a.lstm_state, r.lstm_state):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
        for (ka, va), (kr, vr) in zip(held_kv(a), held_kv(r)):
            torch.testing.assert_close(kr, ka, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vr, va, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", REGISTERED, ids=lambda m: m.value)
@torch.no_grad()
def test_rows_planned_ahead_attend_at_this_forwards_positions(mode):
    """A row whose forward was begun by ``plan_forward`` (what a compiled decoder calls before its layer pass) gets
    this forward's ``row_plan``, never one left from an earlier forward: forwards of 2 and 1 tokens, a rollback to
    the start, then 3 tokens, each planned ahead, give what the 3 tokens give a fresh cache (the 1-token forward's
    plan held 3 keys too, with one new token)."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(11)
    x2, x1, x3 = (torch.randn(2, t, 64, generator=gen) for t in (2, 1, 3))
    planned = RowsCache([build(mode, "easy", model) for _ in range(2)])
    start = planned.mark()
    for x in (x2, x1):
        for cache in planned.caches:
            cache.plan_forward(x.shape[1])
        model(inputs_embeds=x, cache=planned)
    planned.rollback(start)
    for cache in planned.caches:
        cache.plan_forward(3)
    out = model(inputs_embeds=x3, cache=planned)
    fresh = RowsCache([build(mode, "easy", model) for _ in range(2)])
    torch.testing.assert_close(out, model(inputs_embeds=x3, cache=fresh), rtol=0, atol=0)
