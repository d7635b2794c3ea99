"""Torch reference for ``rope``: rotary embedding at given positions (HF ``rotate_half`` / NeoX layout).

Same numbers as ``vla_runtime.kv.rope.apply_rope`` with ``rope_cos_sin`` (angles ``pos * inv_freq`` in float32,
rotation in float32, rounded once to the input dtype). It is re-stated here from ``inv_freq`` because
``vla_kernels`` sits below ``vla_runtime`` and must not import it; a test holds the two equal.
"""

from __future__ import annotations

import torch

from .checks import check_rope_args


def rope_angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of ``pos * inv_freq``. pos: [T] int; inv_freq: [D/2] float32. Returns two [T, D/2] float32."""
    angles = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [..., T, D]`` by half-width ``cos, sin: [T, D/2]``; float32 math, rounded once to x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [..., T, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, H, T, D]`` at positions ``pos: [T]`` (int32) with ``inv_freq: [D/2]`` (float32).

    Returns a new tensor [B, H, T, D] in x's dtype.
    """
    check_rope_args(x, pos, inv_freq)
    cos, sin = rope_angles(pos, inv_freq)
    return rotate(x, cos, sin)
