"""One prefill's per-layer state: ``PrefillRun``, the cache object the decoder layers call (``attend``), and
``AttentionView``, one layer's attention as a recomputation method sees it (``MemoryPrefill`` in ``prefill.py``
drives the loop).

``PrefillRun`` owns a working buffer of the whole prompt's pre-RoPE keys per layer (stored KV loaded for rows
not computed, fresh k for computed rows), rotates all keys at their absolute positions and attends with a true
causal mask by position (a row sees key j iff ``pos[j] <= pos[row]``). Values and rotated keys land directly in
the ``FullCache`` that afterwards holds the whole prompt. At each layer, once the computed rows' keys and values
are in place, the method may shrink the rows the next layer computes (``after_attention``: it reads scores and
values, never the attention's output); the loader is then told which stored units those layers need.

A row that the next layer no longer computes only contributes its keys and values at this layer: its attention
output, output projection and MLP would be thrown away. So attention runs for the rows the next layer reads (at
the last layer, the prompt's last row, whose hidden state gives the logits) and ``layer_step`` drops the other
rows before the output projection. Every kept row's hidden state is the one a full layer gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..kv.attention import causal_attention, masked_attention
from ..kv.full import FullCache
from ..kv.rope import apply_rope, rope_cos_sin
from .importance import SegmentAttention
from .loader import LayerLoader
from .methods import Module, Plan, RecomputeMethod
from .prompt import MemoryPrompt
from .store import UnitKV

if TYPE_CHECKING:
    from .prefill import MemoryPrefill, PlanContext


@dataclass
class AttentionView:
    """One layer's attention as a method sees it. rows: [T] absolute positions computed (sorted);
    q: [1, Hq, T, D] and k: [1, Hkv, S, D] rotated; mask: [T, S]; v_fresh / v_stored: [Hkv, T, D]
    (stored only on layers the plan asked for)."""

    run: "PrefillRun"
    layer: int
    rows: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    mask: torch.Tensor
    v_fresh: torch.Tensor
    v_stored: torch.Tensor | None

    def probs(self, idx: torch.Tensor) -> torch.Tensor:
        """Attention probabilities of rows ``idx`` (indices into ``rows``), heads averaged: [len(idx), S]."""
        q = self.q[:, :, idx].float()  # [1, Hq, R, D]
        k = self.k.float()
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)  # [1, Hq, S, D]
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [1, Hq, R, S]
        scores = scores.masked_fill(~self.mask[idx], float("-inf"))
        return scores.softmax(-1).mean(dim=1)[0]  # [R, S]


class PrefillRun:
    """One prefill's state; the ``cache`` the decoder layers call. Not reusable across prompts."""

    def __init__(self, engine: "MemoryPrefill", prompt: MemoryPrompt, plan: Plan, ctx: PlanContext, out: FullCache) -> None:
        cfg = engine.model.cfg
        self.engine, self.prompt, self.plan, self.ctx, self.out = engine, prompt, plan, ctx, out
        self.method: RecomputeMethod = engine.method
        self.n_layers = cfg.n_layers
        s = prompt.n_tokens
        dev = engine.device
        self.pos = torch.arange(s, device=dev)
        self.cos, self.sin = rope_cos_sin(self.pos, cfg.rope)
        self.k_pre = torch.empty(cfg.n_layers, cfg.n_kv_heads, s, cfg.head_dim, device=dev, dtype=engine.dtype)
        self.modules: dict[str, Module] = {m.id: m for m in plan.modules}
        self.computed = plan.computed.clone()  # [S] bool, current layer
        self.rows = torch.nonzero(self.computed).flatten().to(dev)  # [T]
        self.next_computed: torch.Tensor | None = None
        self.out_index: torch.Tensor | None = None  # this layer's rows whose output is read (None: all)
        self.stats_rows: list[int] = []
        self.stats_total: list[int] = []
        self.stats_modules: list[tuple[str, ...]] = []
        self._recorded: torch.Tensor | None = None  # the computed set the last statistics describe
        self.loader: LayerLoader | None = None
        # stored_bias only: memory positions read from stored KV that is not exact, and each layer's score bias
        self.stale: torch.Tensor | None = None  # [S] bool
        self.key_bias: torch.Tensor | None = None  # [L, S]
        if engine.config.stored_bias:
            self.stale = torch.zeros(s, dtype=torch.bool)
            for m in plan.modules:
                if m.unit is not None and not m.exact:
                    self.stale[m.start : m.end] = True
            self.key_bias = torch.zeros(cfg.n_layers, s, device=dev, dtype=engine.dtype)

    # the KVCache protocol (the decoder layer only calls attend)
    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows, s = self.rows, self.prompt.n_tokens
        self.loader.wait(layer)
        k_pre = self.k_pre[layer]  # [Hkv, S, D]
        k_out, v_out = self.out.buffers(s)  # [L, 1, Hkv, S, D]: written in place, held from `run` on
        v_all = v_out[layer]  # [1, Hkv, S, D]
        v_stored = v_all[0][:, rows].clone() if layer in self.plan.stored_value_layers else None
        k_pre[:, rows] = k_raw[0]
        v_all[0][:, rows] = v[0]
        k_rot = apply_rope(k_pre[None], self.cos, self.sin)  # [1, Hkv, S, D]
        k_out[layer] = k_rot
        q_rot = apply_rope(q, self.cos[rows], self.sin[rows])
        mask = self.pos[None, :] <= rows[:, None]  # [T, S]
        bias = None
        if self.key_bias is not None:  # the stale keys of this layer: stored, not exact, not computed here
            self.key_bias[layer] = (self.stale & ~self.computed).to(self.key_bias) * -self.engine.config.stored_bias
            bias = self.key_bias[layer][None, :]  # [1, S]
        view = AttentionView(self, layer, rows, q_rot, k_rot, mask, v[0], v_stored)
        nxt = self.method.after_attention(layer, view)
        if nxt is not None:
            self._shrink(layer, nxt)
        self.out_index = self._read_rows(layer)
        if self.out_index is not None:  # only the rows the next layer reads need an output
            q_rot, rows = q_rot[:, :, self.out_index], rows[self.out_index]
        if bias is not None:
            return masked_attention(q_rot, k_rot, v_all, self.pos[None, :] <= rows[:, None], bias=bias)
        return self._causal_runs(q_rot, k_rot, v_all, rows)

    @staticmethod
    def _causal_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Causal attention by position for query rows at sorted positions ``pos: [T]`` (q: [1, Hq, T, D]) over
        keys k, v: [1, Hkv, S, D]. Each run of consecutive positions ``a..b`` attends to keys ``0..b`` only (one
        ``causal_attention`` per run): the same result as a ``[T, S]`` mask without the keys a run cannot see."""
        t = pos.numel()
        breaks = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
        starts = [0, *breaks]
        ends = [*breaks, t]
        first = pos[starts].tolist()
        outs = []
        for a, b, p in zip(starts, ends, first):
            n = p + (b - a)  # keys the run sees: 0 .. its last position
            outs.append(causal_attention(q[:, :, a:b], k[:, :, :n], v[:, :, :n], past=p))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def end_forward(self, *, pin: bool = False) -> None:
        pass

    def _read_rows(self, layer: int) -> torch.Tensor | None:
        """Indices into this layer's rows whose output a later step reads: [T'], or None = every row. At the last
        layer only the prompt's last position (the logits'); before it, the rows the next layer computes."""
        if layer == self.n_layers - 1:
            return None if len(self.rows) == 1 else torch.tensor([len(self.rows) - 1], device=self.rows.device)
        if self.next_computed is None:
            return None
        return torch.searchsorted(self.rows, torch.nonzero(self.next_computed).flatten().to(self.rows.device))

    def needed_from_stored(self, computed: torch.Tensor) -> set[str]:
        """Modules that read stored KV when ``computed: [S] bool`` positions are computed."""
        return {m.id for m in self.plan.modules if m.unit is not None and not bool(computed[m.start : m.end].all())}

    def _shrink(self, layer: int, nxt: torch.Tensor) -> None:
        if bool((nxt & ~self.computed).any()):
            raise AssertionError(f"{self.method.name}: layer {layer + 1} would compute rows layer {layer} did not")
        newly = self.needed_from_stored(nxt) - self.needed_from_stored(self.computed)
        self.loader.need(sorted(newly, key=lambda m: self.modules[m].start), range(layer + 1, self.n_layers))
        self.next_computed = nxt

    def record(self) -> None:
        """This layer's statistics (the computed set changes at few layers: the last layer's are reused until it does)."""
        if self.stats_rows and self._recorded is self.computed:
            self.stats_rows.append(self.stats_rows[-1])
            self.stats_total.append(self.stats_total[-1])
            self.stats_modules.append(self.stats_modules[-1])
            return
        p, m_end = self.prompt.n_prefix, self.prompt.memory_end
        self.stats_rows.append(int(self.computed[p:m_end].sum()))
        self.stats_total.append(int(self.computed.sum()))
        self.stats_modules.append(tuple(m.id for m in self.plan.modules if bool(self.computed[m.start : m.end].any())))
        self._recorded = self.computed

    def layer_step(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Decoder layer ``layer`` (our LLaMA block) on this layer's computed rows, ``x: [1, T, dim]`` -> the rows the
        next layer computes ``[1, T', dim]`` (at the last layer: the prompt's last row). The same arithmetic as
        ``DecoderLayer.forward``; rows whose output nobody reads leave after the attention."""
        attn = layer.self_attn
        t = x.shape[1]
        q, k, v = attn.project(layer.input_layernorm(x))
        q = q.view(1, t, attn.n_heads, attn.head_dim).transpose(1, 2)  # [1, Hq, T, D]
        k = k.view(1, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # [1, Hkv, T, D]
        v = v.view(1, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        out = self.attend(attn.layer, q, k, v)  # [1, Hq, T', D]
        if self.out_index is not None:
            x = x[:, self.out_index]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(1, x.shape[1], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if self.next_computed is not None:  # the rows read are the next layer's
            self.computed, self.next_computed, self.rows = self.next_computed, None, self.rows[self.out_index]
        return x

    def importance_evaluation(self, layer_id: int, memory_ids: list[str], attention: SegmentAttention) -> list[str]:
        return self.engine.importance_evaluation(layer_id, memory_ids, attention)

    def store_prompt_kv(self, key: str, n: int) -> None:
        """Put the first ``n`` prompt tokens' KV (pre-RoPE keys, values) into the store as a unit."""
        kv = UnitKV(self.k_pre[:, :, :n].clone(), self.out.buffers(n)[1][:, 0].clone())
        self.engine.store.put(key, kv)
