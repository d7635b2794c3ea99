"""``kv.attention`` under ``torch.compile`` with dynamic shapes (what ``SessionConfig.compile`` uses): the
``enable_gqa`` flag SDPA receives is a plain bool, so the graph guards on the head counts instead of handing SDPA
a symbolic comparison. torch 2.11 (the GPU image's) rejects a ``SymBool`` there, which broke every layer of a
compiled decode into its own graph and recompiled it per layer index: compiled ran 0.65x eager on an H100."""

import pytest
import torch
import torch.nn.functional as F

from vla_runtime.kv.attention import block_attention, causal_attention, masked_attention


def sdpa_gqa_flags(fn, *args) -> list:
    """The ``enable_gqa`` argument of every SDPA call in the graph ``fn(*args)`` compiles to (dynamic shapes,
    one graph)."""
    flags = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            if node.target is F.scaled_dot_product_attention:
                flags.append(node.kwargs.get("enable_gqa"))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    return flags


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain multi-head, grouped-query
@pytest.mark.parametrize("call", ["causal decode", "causal prefill", "causal past", "block", "masked"])
def test_sdpa_gets_a_plain_bool_for_grouped_query_attention(kv_heads, call):
    t = 1 if call == "causal decode" else 3
    q = torch.randn(1, 4, t, 8)
    k, v = torch.randn(1, kv_heads, 5, 8), torch.randn(1, kv_heads, 5, 8)
    fns = {
        "causal decode": lambda q, k, v: causal_attention(q, k, v, past=4),
        "causal prefill": lambda q, k, v: causal_attention(q, k[:, :, :3], v[:, :, :3], past=0),
        "causal past": lambda q, k, v: causal_attention(q, k, v, past=2),
        "block": block_attention,
        "masked": lambda q, k, v: masked_attention(q, k, v, torch.ones(t, 5, dtype=torch.bool)),
    }
    flags = sdpa_gqa_flags(fns[call], q, k, v)
    assert flags == [kv_heads != 4], f"SDPA's enable_gqa in the graph: {flags} (a SymBool is an fx Node)"
