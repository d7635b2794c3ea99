"""Fused projections for inference: each decoder layer's q/k/v as one GEMM and its gate/up as one.

A decode token multiplies a single row by every weight of a layer; seven small GEMMs per layer pay seven launches
(and, on a GPU, split-K reductions) where three larger ones (qkv, o, gate_up) and down do the same reading of
the weights. ``fuse_projections`` concatenates the weights along the output dimension, in place:

    fuse_projections(model.language_model.model.layers)   # after any adapter merge, before quantize_linears

The separate ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj`` modules are removed, so the fused model's
state dict no longer has Hugging Face's names: fuse a model to run it, not to save or fine-tune it. Every output
is the same dot product as before; only the GEMM's blocking may change the last bits of a float.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .llama import DecoderLayer


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose outputs are ``parts``' outputs, concatenated in order (same device and dtype)."""
    first = parts[0]
    if any(not isinstance(p, nn.Linear) or p.in_features != first.in_features for p in parts):
        raise TypeError("fused_linear takes nn.Linear layers with one input width (fuse before quantize_linears)")
    grad = first.weight.requires_grad
    # built on the meta device (no initialisation of weights about to be replaced), then given the concatenations
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=False, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=grad)  # [sum(out), in]
    if any(p.bias is not None for p in parts):
        bias = [p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.out_features) for p in parts]
        fused.bias = nn.Parameter(torch.cat(bias), requires_grad=grad)
    return fused


def fuse_projections(layers: nn.ModuleList) -> int:
    """Fuse q/k/v (``Attention.qkv_proj``) and gate/up (``MLP.gate_up_proj``) in every ``DecoderLayer`` of
    ``layers``, in place. Returns how many layers were fused (layers fused before are left as they are)."""
    fused = 0
    for layer in layers:
        if not isinstance(layer, DecoderLayer):
            raise TypeError(f"fuse_projections takes the LLaMA decoder's layers, got {type(layer).__name__}")
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None:
            continue
        attn.qkv_proj = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = fused_linear([mlp.gate_proj, mlp.up_proj])
        for module, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            for name in names:
                delattr(module, name)
        fused += 1
    return fused
