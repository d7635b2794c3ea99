"""ChunkGate: the learnable part of the KV-Efficient cache (seed 002, contract 3).

For every decoder layer ``l`` (weights stacked over layers, so all layers run in one batched matmul):

* **Aggregator** — a 2-layer MLP per layer for keys and one for values, shared by all KV heads. It maps
  the C pre-RoPE keys (values) of a chunk to one key (value)::

      rep(x) = mean_c(x) + fc2(gelu(fc1(vec(x))))        x: [C, D] -> [D]

  ``fc2`` starts at zero, so an untrained aggregator *is* mean pooling, exactly, while gradients
  still reach ``fc2`` (the zero-initialised residual of IntentKV's head; research note §3d.4).
* **Retention gate** — an LSTM per layer (weights shared by the KV heads, state per head and batch
  row) reads each chunk representative ``rms_norm([k_rep ‖ v_rep])`` in order; the layer's score is::

      s = readout_bias[l] + mean_heads(readout_weight[l] · h)

  and the chunk is kept iff ``s > tau[l]`` (``tau`` learnable). ``readout_weight`` starts at zero and
  ``readout_bias - tau`` at ``keep_margin`` > 0, so an untrained gate keeps every chunk: a learned
  correction, zero at start, on a constant heuristic score.
* **Soft gate** for training: ``g = sigmoid((s - tau) / temperature)``; the parallel form adds
  ``log g`` to the attention scores of the chunk's key.

The module holds weights only; the LSTM ``(h, c)`` and the chunk scores are episode state kept by the
cache. ``ChunkedGatedParams.gate_config`` says which gate a cache needs; ``gate_io`` saves and loads gates.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .geometry import CacheGeometry

LSTMState = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ChunkGateConfig:
    """Geometry of a ``ChunkGate``.

    Args:
        n_layers: decoder layers (one aggregator and one LSTM each).
        head_dim: per-head size D of the keys/values it aggregates.
        chunk: tokens per chunk C (the aggregator's input is C x D).
        aggregator_hidden: hidden width of the aggregator MLPs.
        gate_hidden: LSTM hidden size.
        keep_margin: initial ``readout_bias - tau``; > 0 keeps every chunk while untrained.
    """

    n_layers: int
    head_dim: int
    chunk: int
    aggregator_hidden: int = 64
    gate_hidden: int = 32
    keep_margin: float = 3.0

    def __post_init__(self) -> None:
        for name in ("n_layers", "head_dim", "chunk", "aggregator_hidden", "gate_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not math.isfinite(self.keep_margin):
            raise ValueError(f"`keep_margin` must be finite, got {self.keep_margin}")


class StackedMLP(nn.Module):
    """One residual 2-layer MLP per layer, ``[C, D] -> [D]``: ``mean_c(x) + fc2(gelu(fc1(vec x)))``."""

    def __init__(self, n_layers: int, chunk: int, dim: int, hidden: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(chunk * dim)  # nn.Linear's default init for fc1
        self.fc1_weight = nn.Parameter(torch.empty(n_layers, chunk * dim, hidden).uniform_(-bound, bound))
        self.fc1_bias = nn.Parameter(torch.empty(n_layers, hidden).uniform_(-bound, bound))
        self.fc2_weight = nn.Parameter(torch.zeros(n_layers, hidden, dim))
        self.fc2_bias = nn.Parameter(torch.zeros(n_layers, dim))

    def forward(self, x: torch.Tensor, layers: slice) -> torch.Tensor:
        """x: [L', ..., C, D] for the layers ``layers`` selects -> [L', ..., D]."""
        lead = x.shape[:-2]
        flat = x.reshape(lead[0], -1, x.shape[-2] * x.shape[-1])  # [L', M, C*D]
        hidden = F.gelu(torch.baddbmm(self.fc1_bias[layers, None], flat, self.fc1_weight[layers]))  # [L', M, H]
        delta = torch.baddbmm(self.fc2_bias[layers, None], hidden, self.fc2_weight[layers])  # [L', M, D]
        return x.mean(dim=-2) + delta.view(*lead, x.shape[-1])  # [L', ..., D]


class ChunkGate(nn.Module):
    """Per-layer chunk aggregator + LSTM retention gate + threshold ``tau`` (weights only).

    Layer-stacked methods take a ``layers`` argument: ``None`` = every layer (leading dim L), an
    ``int`` = that one layer (no leading layer dim).
    """

    def __init__(self, cfg: ChunkGateConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n, d, hidden = cfg.n_layers, cfg.head_dim, cfg.gate_hidden
        self.key_aggregator = StackedMLP(n, cfg.chunk, d, cfg.aggregator_hidden)
        self.value_aggregator = StackedMLP(n, cfg.chunk, d, cfg.aggregator_hidden)
        bound = 1.0 / math.sqrt(hidden)  # nn.LSTM's default init
        self.lstm_weight_ih = nn.Parameter(torch.empty(n, 2 * d, 4 * hidden).uniform_(-bound, bound))
        self.lstm_weight_hh = nn.Parameter(torch.empty(n, hidden, 4 * hidden).uniform_(-bound, bound))
        self.lstm_bias = nn.Parameter(torch.empty(n, 4 * hidden).uniform_(-bound, bound))
        self.readout_weight = nn.Parameter(torch.zeros(n, hidden))
        self.readout_bias = nn.Parameter(torch.full((n,), float(cfg.keep_margin)))
        self.tau = nn.Parameter(torch.zeros(n))

    @staticmethod
    def _select(layers: int | None) -> tuple[slice, bool]:
        if layers is None:
            return slice(None), False
        return slice(layers, layers + 1), True

    def aggregate(
        self, k: torch.Tensor, v: torch.Tensor, layers: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk representatives from pre-RoPE keys/values.

        k, v: [L, B, Hkv, n, C, D] (``layers=None``) or [B, Hkv, n, C, D] (one layer).
        Returns k_rep, v_rep: [L, B, Hkv, n, D] / [B, Hkv, n, D] in the gate's dtype.
        """
        sel, single = self._select(layers)
        dtype = self.fc_dtype
        k, v = k.to(dtype), v.to(dtype)
        if single:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        k_rep = self.key_aggregator(k, sel)
        v_rep = self.value_aggregator(v, sel)
        if single:
            k_rep, v_rep = k_rep.squeeze(0), v_rep.squeeze(0)
        return k_rep, v_rep

    @property
    def fc_dtype(self) -> torch.dtype:
        return self.lstm_weight_ih.dtype

    def init_state(self, batch: int, kv_heads: int, layers: int | None = None, device=None) -> LSTMState:
        """Zero LSTM state ``(h, c)``: [L, B*Hkv, hidden] (or [B*Hkv, hidden] for one layer)."""
        shape = (batch * kv_heads, self.cfg.gate_hidden)
        if layers is None:
            shape = (self.cfg.n_layers, *shape)
        z = torch.zeros(shape, dtype=self.fc_dtype, device=device if device is not None else self.tau.device)
        return z, z.clone()

    def score(
        self, k_rep: torch.Tensor, v_rep: torch.Tensor, state: LSTMState, layers: int | None = None
    ) -> tuple[torch.Tensor, LSTMState]:
        """Run the LSTM over n chunks in order, per layer and batch row; one score per chunk.

        k_rep, v_rep: [L, B, Hkv, n, D] (or [B, Hkv, n, D] for one layer); state: ``init_state``'s shapes.
        Returns scores [L, B, n] (or [B, n]) and the state after the last chunk.
        """
        sel, single = self._select(layers)
        h, c = state
        if single:
            k_rep, v_rep, h, c = k_rep[None], v_rep[None], h[None], c[None]
        n_l, b, hkv, n, _ = k_rep.shape
        x = torch.cat((k_rep, v_rep), dim=-1).to(self.fc_dtype)  # [L', B, Hkv, n, 2D]
        x = x.permute(0, 3, 1, 2, 4).reshape(n_l, n, b * hkv, x.shape[-1])  # [L', n, B*Hkv, 2D]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # scale-free input
        first = 0 if sel.start is None else sel.start
        runs = [self._recur(x[i], h[i], c[i], first + i) for i in range(n_l)]
        hidden = torch.stack([r[0] for r in runs])  # [L', n, B*Hkv, H]
        h, c = torch.stack([r[1] for r in runs]), torch.stack([r[2] for r in runs])
        per_head = (hidden * self.readout_weight[sel, None, None]).sum(-1).view(n_l, n, b, hkv)
        s = (self.readout_bias[sel, None, None] + per_head.mean(-1)).transpose(1, 2)  # [L', B, n]
        if single:
            return s[0], (h[0], c[0])
        return s, (h, c)

    def _recur(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s LSTM over the chunks in order: x [n, N, 2D], h and c [N, H] -> hidden [n, N, H],
        h, c. torch's fused LSTM (gates i, f, g, o as here; cuDNN on CUDA): one kernel for the recurrence
        instead of ~10 small ones per chunk, forward and backward; always in the gate's dtype."""
        if x.shape[0] == 0:
            return x.new_zeros(0, *h.shape), h, c
        w_ih, w_hh, bias = self.lstm_weight_ih[layer], self.lstm_weight_hh[layer], self.lstm_bias[layer]
        # torch keeps [4H, in] weights and two biases; cuDNN views each operand flat: all must be contiguous
        params = [w_ih.t().contiguous(), w_hh.t().contiguous(), bias, torch.zeros_like(bias)]
        x, h, c = x.contiguous(), h.contiguous(), c.contiguous()
        with torch.autocast(x.device.type, enabled=False), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="RNN module weights are not part", category=UserWarning)
            hidden, h_n, c_n = torch.lstm(x, (h[None], c[None]), params, True, 1, 0.0, torch.is_grad_enabled(), False, False)
        return hidden, h_n[0], c_n[0]

    def threshold(self, layers: int | None = None) -> torch.Tensor:
        """tau: [L] (or a scalar tensor for one layer)."""
        return self.tau if layers is None else self.tau[layers]

    def keep_prob(self, s: torch.Tensor, layers: int | None = None, *, temperature: float = 1.0) -> torch.Tensor:
        """Soft gate ``sigmoid((s - tau) / temperature)``; s: [L, ...] or [...] for one layer."""
        tau = self.threshold(layers)
        if layers is None:
            tau = tau.view(-1, *([1] * (s.dim() - 1)))
        return torch.sigmoid((s - tau) / temperature)

    def log_keep_prob(self, s: torch.Tensor, layers: int | None = None, *, temperature: float = 1.0) -> torch.Tensor:
        """``log g`` computed stably (``logsigmoid``); same shapes as ``keep_prob``."""
        tau = self.threshold(layers)
        if layers is None:
            tau = tau.view(-1, *([1] * (s.dim() - 1)))
        return F.logsigmoid((s - tau) / temperature)

    def extra_repr(self) -> str:
        c = self.cfg
        return (
            f"layers={c.n_layers}, chunk={c.chunk}, head_dim={c.head_dim}, "
            f"agg_hidden={c.aggregator_hidden}, lstm_hidden={c.gate_hidden}"
        )


def check_gate(gate: ChunkGate, geometry: CacheGeometry, *, chunk: int) -> None:
    """Raise ``ValueError`` if ``gate`` is not a ``ChunkGate`` built for this model geometry and chunk size."""
    if not isinstance(gate, ChunkGate):
        raise ValueError(f"the chunked cache needs a ChunkGate (vla_runtime.kv.gate), got {type(gate).__name__}")
    want = {"n_layers": geometry.n_layers, "head_dim": geometry.head_dim, "chunk": chunk}
    for name, value in want.items():
        got = getattr(gate.cfg, name)
        if got != value:
            raise ValueError(
                f"ChunkGate has `{name}`={got} but the cache needs {value} (gate built for another model or KVConfig)"
            )
