"""``ChunkedGatedCache(static_shapes=True)``: every forward attends over the whole rotated view behind a mask built
from per-layer limits (``kv/static_view.py``), so its outputs equal the dynamic cache's through compressions that
leave each layer its own chunks (a gate that drops some, the budget evicting), ``chunk_mass``, a bidirectional
block and a rollback; and compiled without dynamic shapes, a whole history episode is one graph per forward length
(the dynamic cache: a new one for nearly every forward). What ``REDUCE_OVERHEAD`` sessions (CUDA graphs) use."""

import pytest
import torch
from torch._dynamo.utils import counters

from vla_runtime.kv import ChunkedGatedCache, ChunkGate, KVConfig, KVMode
from vla_runtime.models.llama import LlamaModel
from vla_runtime.policies.compiled import CompiledDecoder

from .cases import PROMPT, episode, kv, tiny_model

DIM = 64


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return tiny_model().model


def cache_of(model: LlamaModel, *, static: bool, chunk_mass: bool = False) -> ChunkedGatedCache:
    """The compressing case with room for a few chunks, a gate whose random scores drop some chunks while the budget
    evicts others, and a last layer that keeps none (so the layers' key counts differ)."""
    kv_cfg: KVConfig = kv(KVMode.CHUNKED, "hard", max_chunks=4, chunk_mass=chunk_mass)
    torch.manual_seed(3)
    gate = ChunkGate(kv_cfg.gate_config(model.cfg.geometry))
    with torch.no_grad():
        gate.readout_weight.normal_(0.0, 3.0)
        gate.readout_bias.zero_()
        gate.tau[-1] = 1e3
    return ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=gate, static_shapes=static)


@torch.inference_mode()
def history(decoder, cache: ChunkedGatedCache, steps: int = 6) -> list[torch.Tensor]:
    """A pinned prompt, then per step a frame's tokens and a decoded token inside a mark (rolled back); after the
    third step a bidirectional block (OFT's query block)."""
    x, bounds = episode(steps, dim=DIM)
    outs, start = [], 0
    for i, n in enumerate(bounds):
        outs.append(decoder(inputs_embeds=x[:, start : start + n], cache=cache, pin=start + n <= PROMPT))
        start += n
        if i % 4 == 1:  # after a frame: one decode rolled back, as an action token would be
            mark = cache.mark()
            outs.append(decoder(inputs_embeds=x[:, start - 1 : start], cache=cache))  # a slice: x's strides
            cache.rollback(mark)
        if i == 9:
            with cache.bidirectional_block():
                outs.append(decoder(inputs_embeds=x[:, 2:6], cache=cache))
    return outs


@pytest.mark.parametrize("chunk_mass", [False, True], ids=["plain", "chunk_mass"])
def test_static_shapes_give_the_dynamic_caches_outputs(model, chunk_mass):
    dynamic, static = cache_of(model, static=False, chunk_mass=chunk_mass), cache_of(model, static=True, chunk_mass=chunk_mass)
    want, got = history(model, dynamic), history(model, static)
    assert dynamic.retained_per_layer()[0] > 0 == dynamic.retained_per_layer()[-1]
    assert int(dynamic.gate_dropped[0]) > 0 and int(dynamic.budget_dropped[0]) > 0
    assert len(want) == len(got) > 20
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert torch.equal(static.chunk_valid, dynamic.chunk_valid)
    assert static.retained_starts() == dynamic.retained_starts()


def test_compiled_without_dynamic_shapes_a_static_cache_needs_one_graph_per_forward_length(model):
    def compiled_history(static: bool, steps: int) -> tuple[list[torch.Tensor], int]:
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        decoder = CompiledDecoder(model, dynamic=False, fullgraph=True)
        with torch._dynamo.config.patch(recompile_limit=64):  # the dynamic cache's graphs, counted, not cut off
            outs = history(decoder, cache_of(model, static=static), steps)
        return outs, counters["stats"]["unique_graphs"] - before

    got, graphs = compiled_history(static=True, steps=6)
    # the prompt's, a frame's, a decode's, the bidirectional block's (which also changes the mask's rule)
    assert graphs == 4 < len(got), graphs
    for w, g in zip(history(model, cache_of(model, static=False)), got, strict=True):  # eager, the dynamic cache
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # what the static cache is for: compiled the same way, the dynamic cache needs a graph for nearly every forward
    # (every held length its own); two steps show it at a third of the compile time of six
    got, graphs = compiled_history(static=False, steps=2)
    assert graphs >= len(got) - 2 > 6, (graphs, len(got))
    for w, g in zip(history(model, cache_of(model, static=False), 2), got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_static_shapes_refuse_the_triton_backend_and_a_length_scaled_rope(model):
    params = kv(KVMode.CHUNKED, "hard", backend="triton").params
    with pytest.raises(ValueError, match="static shapes needs the torch attention backend"):
        ChunkedGatedCache(model.cfg.geometry, params, static_shapes=True)
    auto = ChunkedGatedCache(model.cfg.geometry, kv(KVMode.CHUNKED, "hard").params, static_shapes=True)
    assert auto.backend.kernel is None and auto.view is not None


@torch.inference_mode()
def test_the_extent_grows_with_the_held_keys_and_the_outputs_stay_the_dynamic_caches(model):
    """A window wider than the smallest extent: the held keys pass 256, the attention reads 512 slots (not the
    buffer's 1025), and the outputs equal the dynamic cache's through compressions."""
    params = kv(KVMode.CHUNKED, "hard", capacity=1024, window=300, chunk=16, max_chunks=16).params
    static, dynamic = (ChunkedGatedCache(model.cfg.geometry, params, static_shapes=s) for s in (True, False))
    gen = torch.Generator().manual_seed(4)
    extents = []
    for i, n in enumerate([PROMPT] + [60] * 8):
        x = torch.randn(1, n, DIM, generator=gen)
        want = model(inputs_embeds=x, cache=dynamic, pin=i == 0)
        static.plan_forward(n)
        extents.append(int(static._static.key_index.shape[0]))
        torch.testing.assert_close(model(inputs_embeds=x, cache=static, pin=i == 0), want, rtol=1e-5, atol=1e-5)
    assert dynamic.chunks_formed > 0
    assert extents[0] == 256 and max(extents) == 512, extents
