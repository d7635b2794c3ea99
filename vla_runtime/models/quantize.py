"""Weight-only quantization of ``nn.Linear`` layers (the LLM's decoder layers; activations, the KV cache and the
LM head stay in the model dtype).

- ``INT8``: per-output-channel symmetric int8, ``w ~= q * scale[out]`` (q in [-127, 127]).
- ``INT4``: group-wise asymmetric 4 bit along the input dimension, ``w ~= q * scale[out, g] + low[out, g]``
  (q in [0, 15], ``group_size`` inputs per group), two values packed per byte.

``Int8Linear`` runs ATen's ``_weight_int8pack_mm`` on CPU (dequantised inside the kernel) and ``(x @ q.T) * scale``
elsewhere; ``Int4Linear`` unpacks, scales and shifts in plain torch, then ``F.linear``. Both run on any device and
under ``torch.compile``; ``dequantized_weight()`` is the float reference the tests hold them to. They save weight
memory (4x, ~7x) everywhere; whether they are faster depends on the device's kernels for the dequantising matmul
(see the README's speed section: on the CPUs measured so far they are slower than float32).
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F


class QuantMode(str, Enum):
    """Weight-only quantization of the LLM's linear layers: ``NONE`` (model dtype), ``INT8``, ``INT4``."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


QUANT_MODES = tuple(m.value for m in QuantMode)  # the spellings the CLI accepts
INT4_GROUP = 128  # inputs per int4 group at most (halved until it splits a layer's inputs: 64 for SmolLM2's 576)


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and one float scale per output channel.

    Buffers: ``weight_int8`` [out, in] int8, ``scale`` [out] (model dtype), ``bias`` [out] or ``None``.
    """

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_int8.shape[1], weight_int8.shape[0]
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight.detach().float()  # [out, in]
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [out]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale.to(linear.weight.dtype), bias)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] in the scale's dtype: the weight this layer multiplies by (the float reference)."""
        return self.weight_int8.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]. On CPU ATen's ``_weight_int8pack_mm`` (the same buffers, dequantised inside
        the kernel); elsewhere, and for bfloat16 inputs whose width is not a multiple of 16 (torch 2.14's CPU kernel
        returns garbage or crashes there), the plain-torch form, ``(x @ q.T) * scale``."""
        if x.device.type == "cpu" and (x.dtype != torch.bfloat16 or self.in_features % 16 == 0):
            flat = x.reshape(-1, self.in_features).contiguous()  # the kernel reads rows as contiguous
            flat = torch._weight_int8pack_mm(flat, self.weight_int8, self.scale.to(x.dtype))
            out = flat.view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int4Linear(nn.Module):
    """``nn.Linear`` with 4-bit weights in groups of ``group_size`` inputs, a scale and an offset per group.

    Buffers: ``packed`` [out, in / 2] uint8 (input ``2i`` in the low nibble, ``2i + 1`` in the high one),
    ``scale``, ``low`` [out, in / group_size] (model dtype), ``bias`` [out] or ``None``.
    """

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.group_size = self.in_features // scale.shape[1]
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("low", low)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = INT4_GROUP) -> "Int4Linear":
        """Groups of ``group_size`` inputs, or of the first halving of it that splits the layer's inputs into even
        groups (a smaller group only makes the weights more exact)."""
        out_f, in_f = linear.weight.shape
        group = min(group_size, in_f)
        while group > 2 and (in_f % group or group % 2):
            group //= 2
        if in_f % group or group % 2:
            raise ValueError(f"int4 needs a layer's inputs ({in_f}) to split into even groups of at most {group_size}")
        w = linear.weight.detach().float().view(out_f, in_f // group, group)  # [out, G, group]
        low, high = w.amin(-1), w.amax(-1)  # [out, G]
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(out_f, in_f)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)  # [out, in / 2]
        bias = None if linear.bias is None else linear.bias.detach().clone()
        dtype = linear.weight.dtype
        return cls(packed, scale.to(dtype), low.to(dtype), bias)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] in the scale's dtype: the weight this layer multiplies by (the float reference)."""
        q = torch.stack((self.packed & 15, self.packed >> 4), dim=-1).view(self.out_features, -1, self.group_size)
        w = q.to(self.scale.dtype) * self.scale[..., None] + self.low[..., None]  # [out, G, group]
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)


def quantize_linears(module: nn.Module, mode: QuantMode, *, group_size: int = INT4_GROUP) -> int:
    """Replace every ``nn.Linear`` inside ``module`` by its ``mode`` counterpart, in place. Returns how many were
    replaced (0 for ``NONE``)."""
    if not isinstance(mode, QuantMode):
        raise TypeError(f"`quantize` must be a QuantMode ({', '.join(QUANT_MODES)}), got {mode!r}")
    if mode is QuantMode.NONE:
        return 0
    targets = [(name, child) for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    for name, linear in targets:
        new = Int8Linear.from_linear(linear) if mode is QuantMode.INT8 else Int4Linear.from_linear(linear, group_size)
        module.set_submodule(name, new)
    return len(targets)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (what its weights take in memory)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
