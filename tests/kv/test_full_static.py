"""``FullCache(static_shapes=True)``: every forward attends over a power-of-two extent of the buffer behind the
plan's mask, so its outputs equal the dynamic cache's (prefill, decode, a bidirectional block, a key bias,
rollback) while a forward of T tokens has one shape at every length within an extent: compiled without dynamic
shapes, a prefill and any number of decode steps are two graphs (the dynamic cache: one per length). What
``REDUCE_OVERHEAD`` sessions (CUDA graphs) use."""

import pytest
import torch
from torch._dynamo.utils import counters

from vla_runtime.kv import FullCache, KVConfig, make_cache
from vla_runtime.kv.static_view import static_extent
from vla_runtime.models.llama import LLAMA_CONFIGS, LlamaModel
from vla_runtime.policies.compiled import CompiledDecoder

CFG = LLAMA_CONFIGS["tiny"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaModel(CFG).eval()


def full(static: bool) -> FullCache:
    return make_cache(KVConfig.of("full", capacity=48), CFG.geometry, **({"static_shapes": True} if static else {}))


@torch.inference_mode()
def episode(model: LlamaModel, cache: FullCache, decoder=None) -> list[torch.Tensor]:
    """A prefill, decodes, a bidirectional block rolled back, a key bias on the first keys, more decodes."""
    decoder = model if decoder is None else decoder
    gen = torch.Generator().manual_seed(1)
    outs = [decoder(inputs_embeds=torch.randn(1, 9, CFG.dim, generator=gen), cache=cache)]
    outs += [decoder(torch.tensor([[5 + i]]), cache=cache) for i in range(3)]
    with cache.bidirectional_block():
        outs.append(decoder(inputs_embeds=torch.randn(1, 4, CFG.dim, generator=gen), cache=cache))
    cache.bias_keys(torch.linspace(-1.0, 0.5, CFG.n_layers * 6).reshape(CFG.n_layers, 6))
    mark = cache.mark()
    outs.append(decoder(torch.tensor([[9]]), cache=cache))
    cache.rollback(mark)
    outs += [decoder(torch.tensor([[11 + i]]), cache=cache) for i in range(3)]
    return outs


def test_static_shapes_give_the_dynamic_caches_outputs(model):
    want, got = episode(model, full(False)), episode(model, full(True))
    assert len(want) == len(got) == 9
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_compiled_without_dynamic_shapes_a_static_cache_needs_one_graph_per_forward_length(model):
    graphs = {}
    for static in (False, True):
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        decoder = CompiledDecoder(model, dynamic=False, fullgraph=True)
        with torch.inference_mode():
            cache = full(static)
            decoder(inputs_embeds=torch.randn(1, 9, CFG.dim), cache=cache)
            for i in range(6):
                decoder(torch.tensor([[3 + i]]), cache=cache)
        graphs[static] = counters["stats"]["unique_graphs"] - before
    assert graphs[True] == 2, graphs  # the prefill's and the decode's
    assert graphs[False] > 2, graphs  # the dynamic cache's shapes grow with every token (what the test guards against)



def test_the_extent_is_the_held_tokens_rounded_up_to_a_power_of_two():
    assert [static_extent(n, 4096) for n in (1, 256, 257, 290, 513, 4000)] == [256, 256, 512, 512, 1024, 4096]
    assert static_extent(300, 300) == 300  # capped at the buffer
    with pytest.raises(ValueError, match="a static forward sees 1..48 keys, got 49"):
        static_extent(49, 48)


@torch.inference_mode()
def test_a_long_episode_attends_over_a_growing_power_of_two_extent(model):
    """Capacity 2048, a history growing past 256 and 512 tokens: each forward reads the extent its held tokens
    need (not the capacity) and gives the dynamic cache's outputs."""
    static, dynamic = (make_cache(KVConfig.of("full", capacity=2048), CFG.geometry, static_shapes=s) for s in (True, False))
    gen = torch.Generator().manual_seed(2)
    extents = []
    for n in (200, 100, 100, 150, 1):
        x = torch.randn(1, n, CFG.dim, generator=gen)
        want = model(inputs_embeds=x, cache=dynamic)
        static.plan_forward(n)
        extents.append(static._static_mask.shape[1])
        torch.testing.assert_close(model(inputs_embeds=x, cache=static), want, rtol=1e-5, atol=1e-5)
    assert extents == [256, 512, 512, 1024, 1024], extents  # held after each: 200, 300, 400, 550, 551
