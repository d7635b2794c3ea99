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


class RopeTable:
    """cos/sin for positions ``0 .. size-1`` (float32). Rows equal ``rope_cos_sin`` of the positions asked for, bit for
    bit (``tests/kv/test_rope_table.py``).

    ``grow=False`` computes every row at once: a compiled forward that reads slices of the table then always sees the
    same base tensor (a table replaced by a larger one is a new graph input, and a compiled session past its warm-up
    must not recompile). ``grow=True`` computes rows when first asked for, doubling, for a cache of many positions that
    hands out fresh copies (``span``): it holds at most twice what was asked for, not every position a 32k-token model
    could reach. ``dynamic`` (NTK) scaling depends on the sequence length, so it is recomputed per request.
    """

    MIN_ROWS = 256

    def __init__(self, cfg: RopeConfig, size: int, device: torch.device | str, *, grow: bool = False) -> None:
        self.cfg = cfg
        self.size = size
        self.device = device
        self._cos = self._sin = None
        if not grow and cfg.rope_type != "dynamic":
            self._rows(size)

    def _rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table with at least ``n`` rows (``n <= size``): cos, sin [rows, D]."""
        held = 0 if self._cos is None else self._cos.shape[0]
        if n > held:
            rows = min(self.size, max(n, 2 * held, self.MIN_ROWS))
            self._cos, self._sin = rope_cos_sin(torch.arange(rows, device=self.device), self.cfg)
        return self._cos, self._sin

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [n, D] for positions 0..n-1."""
        if self.cfg.rope_type == "dynamic":
            return rope_cos_sin(torch.arange(n, device=self.device), self.cfg)
        cos, sin = self._rows(n)
        return cos[:n], sin[:n]

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [end - start, D] for positions ``start .. end-1``, as fresh tensors (not views into the table:
        a compiled forward that takes them as inputs sees no storage offset that moves with ``start``)."""
        if self.cfg.rope_type == "dynamic":
            return rope_cos_sin(torch.arange(start, end, device=self.device), self.cfg)
        cos, sin = self._rows(end)
        return cos[start:end].clone(), sin[start:end].clone()

    def inv_freq(self, n: int) -> torch.Tensor:
        """[D/2] float32 inverse frequencies for a sequence of n positions (for the Triton kernel)."""
        return inv_freq(self.cfg, seq_len=n, device=self.device)
