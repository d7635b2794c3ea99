"""``compile_apart``: every compiled callable keeps its own dynamo cache. Two models of different layouts (one with
fused projections) compile the same ``LlamaModel.layers_forward``; sharing its code object, a call with the guards
skipped (how a compiled session steps) could run the other model's graph, as torch 2.11 did on an H200
(``KeyError: 'qkv_proj'``). Backend ``eager``: dynamo's tracing and caching without inductor, quick."""

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from vla_runtime.kv import KVConfig, make_cache
from vla_runtime.models.fuse import fuse_projections
from vla_runtime.models.llama import LLAMA_CONFIGS, LlamaModel
from vla_runtime.policies.compiled import CompiledDecoder, compile_apart

CFG = LLAMA_CONFIGS["tiny"]


def code_of(compiled) -> object:
    """The code object dynamo caches a ``torch.compile``-d function's graphs on."""
    return getattr(compiled._torchdynamo_orig_callable, "__func__", compiled._torchdynamo_orig_callable).__code__


def test_two_layouts_compile_apart_and_each_runs_its_own_graph_with_the_guards_skipped():
    torch.manual_seed(0)
    plain = LlamaModel(CFG).eval()
    fused = LlamaModel(CFG).eval()
    fused.load_state_dict(plain.state_dict())
    fuse_projections(fused.layers)
    decoders = {name: CompiledDecoder(m, backend="eager", dynamic=True) for name, m in (("plain", plain), ("fused", fused))}
    codes = {name: code_of(d.layers) for name, d in decoders.items()}
    assert len({id(c) for c in codes.values()} | {id(LlamaModel.layers_forward.__code__)}) == 3  # a copy each
    x = torch.randn(1, 5, CFG.dim, generator=torch.Generator().manual_seed(1))

    def run(name, model_or_decoder):
        cache = make_cache(KVConfig(), CFG.geometry)
        with torch.inference_mode():
            return model_or_decoder(inputs_embeds=x, cache=cache)

    want = {name: run(name, m) for name, m in (("plain", plain), ("fused", fused))}
    for name, decoder in decoders.items():  # compile each (guards evaluated)
        torch.testing.assert_close(run(name, decoder), want[name], rtol=0, atol=0)
    assert {name: len(_debug_get_cache_entry_list(c)) for name, c in codes.items()} == {"plain": 1, "fused": 1}
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):  # as a compiled session's steps run
        for name, decoder in decoders.items():
            torch.testing.assert_close(run(name, decoder), want[name], rtol=0, atol=0)


def test_a_module_is_compiled_as_it_is():
    layer = torch.nn.Linear(4, 4)
    compiled = compile_apart(layer, backend="eager")
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), layer(x))
