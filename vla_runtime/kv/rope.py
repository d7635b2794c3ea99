"""Rotary position embedding shared by every cache (HF ``rotate_half`` / NeoX layout).

Caches store keys *without* RoPE and rotate at attention time with the positions they
assign, so this module is the single place that knows the frequency schedule:
default, ``linear``, ``dynamic`` (NTK) and ``llama3`` scaling, as transformers computes them.
Rotation is done in float32 and rounded once to the storage dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..json_fields import ConfigFields

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Frequency schedule of one model's rotary embedding.

    Args:
        head_dim: rotated dimension (the full head dim; partial rotary is not used by our families).
        theta: base wavelength (``rope_theta``).
        rope_type: one of ``ROPE_TYPES``.
        factor: scaling factor for ``linear``/``dynamic``/``llama3``.
        low_freq_factor, high_freq_factor: ``llama3`` band edges.
        original_max_position: pretraining context (``llama3``) or ``max_position_embeddings`` (``dynamic``).
    """

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 2048

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"`rope_type` is {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.head_dim % 2:
            raise ValueError(f"`head_dim` must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, hf: dict, *, head_dim: int, max_position: int, where: str = "config.json") -> "RopeConfig":
        """Read ``rope_theta``/``rope_scaling`` (transformers 4.x) or ``rope_parameters`` (5.x)."""
        top = ConfigFields(hf, where)
        scaling = {**top.dict("rope_scaling", {}), **top.dict("rope_parameters", {})}
        f = ConfigFields(scaling, f"{where} rope_scaling")
        theta = f.float("rope_theta", top.float("rope_theta", 10000.0))
        return cls(
            head_dim=head_dim,
            theta=theta,
            rope_type=f.str("rope_type", f.str("type", "default")),
            factor=f.float("factor", 1.0),
            low_freq_factor=f.float("low_freq_factor", 1.0),
            high_freq_factor=f.float("high_freq_factor", 4.0),
            original_max_position=f.int("original_max_position_embeddings", max_position),
        )


def inv_freq(cfg: RopeConfig, *, seq_len: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32). ``seq_len`` only matters for ``dynamic``."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    base = cfg.theta
    if cfg.rope_type == "dynamic":
        seq_len = max(seq_len, cfg.original_max_position)
        base = cfg.theta * ((cfg.factor * seq_len / cfg.original_max_position) - (cfg.factor - 1)) ** (dim / (dim - 2))
    freqs = 1.0 / (base**exponents)
    if cfg.rope_type == "linear":
        freqs = freqs / cfg.factor
    elif cfg.rope_type == "llama3":
        low_wavelen = cfg.original_max_position / cfg.low_freq_factor
        high_wavelen = cfg.original_max_position / cfg.high_freq_factor
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_wavelen, freqs / cfg.factor, freqs)
        smooth = (cfg.original_max_position / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freqs = torch.where(medium, smoothed, scaled)
    return freqs


def rope_cos_sin(positions: torch.Tensor, cfg: RopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer positions.

    positions: [..., T] int. Returns cos, sin: [..., T, head_dim] float32.
    """
    max_pos = int(positions.max()) + 1 if positions.numel() and cfg.rope_type == "dynamic" else 0
    freqs = positions.float()[..., None] * inv_freq(cfg, seq_len=max_pos, device=positions.device)  # [..., T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, D]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, H, T, D]`` by ``cos, sin: [T, D]`` (float32); computes in float32, rounds once."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def rerotate(k: torch.Tensor, delta: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """Shift already-rotated keys by ``delta`` positions.

    k: [B, H, T, D] rotated at positions p; delta: [T] int. Returns keys rotated at p + delta.
    """
    cos, sin = rope_cos_sin(delta, cfg)
    return apply_rope(k, cos, sin)
