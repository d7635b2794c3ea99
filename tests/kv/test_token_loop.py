"""A greedy decode's one-token forwards traced as one graph (``generation.greedy_tokens``, what
``policies.compiled.CompiledTokenLoop`` compiles): over the full cache with dynamic shapes, and over the chunked
cache under the decode's mark once it has compressed, the whole loop, the cache's plans and commits included,
traces with ``fullgraph=True``, decodes ``decode``'s ids and leaves the cache as the token-by-token decode leaves
it, through histories that pass the full cache's RoPE table growth and the chunked cache's compressions and
evictions without a new graph. Caches whose plans do not trace say so (``traces_token_loop``)."""

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from vla_runtime.kv import KVConfig, make_cache
from vla_runtime.models.generation import SamplingConfig, TokenHead, decode, greedy_tokens
from vla_runtime.models.llama import LLAMA_CONFIGS, LlamaModel
from vla_runtime.policies.compiled import MAX_LOOP_LAYERS, CompiledTokenLoop

CFG = LLAMA_CONFIGS["tiny"]
FRAME = 40  # tokens a history step appends before its decode
ACTION = 7  # tokens a decode picks


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaModel(CFG).eval()


@pytest.fixture(scope="module")
def head():
    lm_head = torch.nn.Linear(CFG.dim, CFG.vocab_size, bias=False)
    torch.nn.init.normal_(lm_head.weight, generator=torch.Generator().manual_seed(2))
    return TokenHead(lm_head, id_range=(100, 163))  # 64 ids from 100, like OpenVLA's action bins


def full(capacity: int = 720, **kw):
    return make_cache(KVConfig.of("full", capacity=capacity), CFG.geometry, **kw)


def chunked(chunk_mass: bool = False):
    kv = KVConfig.from_dict({"mode": "chunked", "window": 47, "chunk": 16, "max_chunks": 4, "capacity": 160,
                             "chunk_mass": chunk_mass})  # a raw ring of 156 slots, 116 past the pinned prompt: it wraps
    return make_cache(kv, CFG.geometry)


@torch.inference_mode()
def test_a_greedy_token_loop_is_one_graph_and_decodes_the_token_by_token_ids(model, head):
    """16 history steps of a frame (40 tokens), then 7 greedy tokens (every other step rolls them back, as
    ``history: observations`` does): ids, lengths, stats, the held K/V and a probe forward over them equal the eager
    loop's, and no graph is traced after the second step although the keys pass 256 and 512 positions (the full
    cache's RoPE table grows there)."""
    traced = torch.compile(greedy_tokens, fullgraph=True, backend="eager", dynamic=True)  # a graph break raises
    eager_cache, loop_cache = full(), full()
    assert loop_cache.traces_token_loop and CompiledTokenLoop(model).applies(head, loop_cache, ACTION)
    gen = torch.Generator().manual_seed(3)
    graphs = None
    for step in range(16):
        frame = torch.randn(1, FRAME, CFG.dim, generator=gen)
        ids = []
        for cache in (eager_cache, loop_cache):
            logits = head.logits(model(inputs_embeds=frame, cache=cache)[:, -1])
            mark = cache.mark() if step % 2 else None
            if cache is eager_cache:
                next_logits = lambda tok: head.logits(model(tok, cache=cache)[:, -1])  # noqa: E731
                ids.append(decode(next_logits, logits, head.pick, max_new_tokens=ACTION))
            else:
                with cache.tokens_ahead(ACTION - 1):
                    ids.append(traced(model, cache, head.weight, head.offset, logits, ACTION))
            if mark is not None:
                cache.rollback(mark)
        torch.testing.assert_close(ids[1], ids[0], rtol=0, atol=0)
        assert ids[0].shape == (1, ACTION) and 100 <= ids[0].min() and ids[0].max() <= 163
        assert loop_cache.length == eager_cache.length and loop_cache.stats() == eager_cache.stats()
        if step == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert loop_cache.length > 512, "the episode should pass the RoPE table's growth at 256 and 512 positions"
    assert counters["stats"]["unique_graphs"] == graphs, "a later step traced a new graph"
    n = loop_cache.length
    torch.testing.assert_close(loop_cache.store.k[:, :, :, :n], eager_cache.store.k[:, :, :, :n], rtol=0, atol=0)
    torch.testing.assert_close(loop_cache.store.v[:, :, :, :n], eager_cache.store.v[:, :, :, :n], rtol=0, atol=0)
    probe = torch.randn(1, 5, CFG.dim, generator=gen)  # what each cache holds, as attention reads it
    want, got = model(inputs_embeds=probe, cache=eager_cache), model(inputs_embeds=probe, cache=loop_cache)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@torch.inference_mode()
@pytest.mark.parametrize("chunk_mass", [False, True])
def test_the_chunked_cache_traces_the_loop_under_a_mark_after_its_first_compression(model, head, chunk_mass):
    """``history: observations``: every step a frame, then 7 greedy tokens under a mark. Before the first compression
    the cache decodes token by token; after it the loop traces (its first forward planned eagerly, the rotated
    view's rebuild included), and over 16 steps of compressions, a budget of 4 chunks per layer filling and
    evicting, and the raw ring wrapping, its ids, stats and a probe forward over what the cache holds equal the
    eager loop's, with one graph throughout."""
    traced = torch.compile(greedy_tokens, fullgraph=True, backend="eager", dynamic=True)
    eager_cache, loop_cache = chunked(chunk_mass=chunk_mass), chunked(chunk_mass=chunk_mass)
    gen = torch.Generator().manual_seed(4)
    graphs, looped = None, 0
    for step in range(16):
        frame = torch.randn(1, FRAME, CFG.dim, generator=gen)
        ids = []
        for cache in (eager_cache, loop_cache):
            logits = head.logits(model(inputs_embeds=frame, cache=cache, pin=step == 0)[:, -1])
            mark = cache.mark()
            if cache is loop_cache and cache.traces_token_loop:
                with cache.tokens_ahead(ACTION - 1):
                    ids.append(traced(model, cache, head.weight, head.offset, logits, ACTION))
                looped += 1
            else:
                next_logits = lambda tok: head.logits(model(tok, cache=cache)[:, -1])  # noqa: E731
                ids.append(decode(next_logits, logits, head.pick, max_new_tokens=ACTION))
            cache.rollback(mark)
        torch.testing.assert_close(ids[1], ids[0], rtol=0, atol=0)
        assert loop_cache.stats() == eager_cache.stats()
        assert not loop_cache.traces_token_loop, "no mark is open between steps"
        if looped == 1:
            graphs = counters["stats"]["unique_graphs"]
    stats = loop_cache.stats()
    assert looped >= 12 and stats.chunks_dropped > 0 and stats.tokens_seen > 2 * loop_cache.store.ring_cap
    assert counters["stats"]["unique_graphs"] == graphs, "a later step traced a new graph"
    probe = torch.randn(1, 5, CFG.dim, generator=gen)
    want, got = model(inputs_embeds=probe, cache=eager_cache), model(inputs_embeds=probe, cache=loop_cache)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@torch.inference_mode()
def test_tokens_ahead_checks_the_room_as_a_forward_would(model):
    cache = full(capacity=48)
    model(inputs_embeds=torch.randn(1, 45, CFG.dim), cache=cache)
    with pytest.raises(ValueError, match="FullCache is full: 45 tokens held \\+ 6 new > capacity 48"):
        with cache.tokens_ahead(6):
            pass
    with cache.tokens_ahead(3):
        model(torch.tensor([[5]]), cache=cache)
    assert cache.length == 46


@torch.inference_mode()
def test_only_plain_greedy_heads_over_caches_whose_plans_trace_take_the_loop(model, head):
    dynamic, static = full(), full(static_shapes=True)
    assert dynamic.traces_token_loop and not static.traces_token_loop
    with dynamic.bidirectional_block():
        assert not dynamic.traces_token_loop
    model(inputs_embeds=torch.randn(1, 4, CFG.dim), cache=dynamic)
    dynamic.bias_keys(torch.zeros(CFG.n_layers, 2))
    assert not dynamic.traces_token_loop
    assert not make_cache(KVConfig.from_dict({"mode": "sink_window", "window": 64}), CFG.geometry).traces_token_loop
    static_kv = KVConfig.from_dict({"mode": "chunked", "window": 47})
    for static in (False, True):
        cache = make_cache(static_kv, CFG.geometry, static_shapes=static)
        cache.mark()
        assert not cache.traces_token_loop, "before its first compression the graph would specialise on the length"
        cache.rollback(0)
        model(inputs_embeds=torch.randn(1, 120, CFG.dim), cache=cache)
        assert cache.stats().chunks_retained > 0
        assert not cache.traces_token_loop, "without a mark a chunked forward may end in a compression"
        cache.mark()
        assert cache.traces_token_loop is not static  # static shapes (CUDA graphs): one call per token
    lm_head = torch.nn.Linear(CFG.dim, 200, bias=False)
    assert not TokenHead(lm_head, SamplingConfig(temperature=0.7)).plain_greedy
    assert not TokenHead(lm_head, allowed=torch.ones(200, dtype=torch.bool)).plain_greedy
    assert not TokenHead(lm_head, record_confidence=True).plain_greedy
    loop = CompiledTokenLoop(model)  # compiles lazily: nothing is compiled here
    assert TokenHead(lm_head).plain_greedy and loop.applies(TokenHead(lm_head), full(), ACTION)
    assert not loop.applies(TokenHead(lm_head, allowed=torch.ones(200, dtype=torch.bool)), full(), ACTION)


def test_a_loop_longer_than_its_layer_limit_decodes_token_by_token():
    """(n - 1) x layers above ``MAX_LOOP_LAYERS``: a 7B decoder's 32 layers unrolled 6 times would be a graph of 192
    layer passes to compile, for a step bound by its weights."""
    deep = LlamaModel(replace(CFG, n_layers=MAX_LOOP_LAYERS // (ACTION - 1) + 1))
    greedy = TokenHead(torch.nn.Linear(CFG.dim, 200, bias=False))
    assert not CompiledTokenLoop(deep).applies(greedy, full(), ACTION)
    assert CompiledTokenLoop(deep).applies(greedy, full(), 2)
