"""A LLaMA-family decoder in one file (LLaMA-2, LLaMA-3/SmolLM2 GQA, Qwen2 with q/k/v bias).

Module and parameter names equal Hugging Face's (``model.layers.N.self_attn.q_proj`` ...), so
HF state dicts load with ``load_state_dict(strict=True)`` and peft ``target_modules`` work.
The model never sees RoPE, masks or positions: attention projects q/k/v (k un-rotated) and
hands them to ``cache.attend(layer, q, k, v)`` (DESIGN §3). Mirrors transformers'
``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, which the tests use as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..json_fields import ConfigFields
from ..kv.base import AttendSeam
from ..kv.geometry import CacheGeometry
from ..kv.rope import RopeConfig


@dataclass(frozen=True)
class LlamaConfig:
    """Decoder geometry.

    Args:
        dim: hidden size. n_layers: decoder layers. n_heads / n_kv_heads: query / key-value heads (GQA).
        head_dim: per-head size (``dim // n_heads`` unless the checkpoint says otherwise).
        ffn_dim: SwiGLU intermediate size. vocab_size: embedding rows (OpenVLA pads to 32064).
        norm_eps: RMSNorm epsilon. qkv_bias: Qwen2-style q/k/v biases.
        max_position: position limit the model was trained for. tie_embeddings: ``lm_head`` shares ``embed_tokens``.
        rope: the RoPE frequency schedule (theta and scaling).
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    ffn_dim: int = 11008
    vocab_size: int = 32064
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    max_position: int = 2048
    tie_embeddings: bool = False
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(head_dim=128))

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"`n_heads` ({self.n_heads}) must be a multiple of `n_kv_heads` ({self.n_kv_heads})")
        if self.rope.head_dim != self.head_dim:
            raise ValueError(f"`rope.head_dim` ({self.rope.head_dim}) must equal `head_dim` ({self.head_dim})")

    @property
    def geometry(self) -> CacheGeometry:
        """What a KV cache needs to know about this decoder (``kv`` never sees the model config)."""
        return CacheGeometry(
            n_layers=self.n_layers,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            max_position=self.max_position,
            rope=self.rope,
        )

    @classmethod
    def from_hf(cls, hf: dict, *, where: str = "config.json") -> "LlamaConfig":
        """From a transformers ``config.json`` dict (``llama``/``qwen2``); missing keys default as
        transformers' ``LlamaConfig`` does (so OpenVLA's tiny ``text_config`` works). A field of the wrong type
        is a ``ValueError`` naming ``where`` and the key."""
        f = ConfigFields(hf, where)
        model_type = f.str("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"text model_type {model_type!r} is not a LLaMA-family decoder (llama, qwen2, mistral)")
        dim = f.int("hidden_size", 4096)
        n_heads = f.int("num_attention_heads", 32)
        if dim < 1 or n_heads < 1:
            raise ValueError(f"{where}: `hidden_size` {dim} and `num_attention_heads` {n_heads} must be >= 1")
        head_dim = f.int("head_dim", 0) or dim // n_heads
        max_position = f.int("max_position_embeddings", 2048)
        default_ffn = 11008 if model_type == "llama" else 22016
        return cls(
            dim=dim,
            n_layers=f.int("num_hidden_layers", 32),
            n_heads=n_heads,
            n_kv_heads=f.int("num_key_value_heads", 0) or n_heads,
            head_dim=head_dim,
            ffn_dim=f.int("intermediate_size", default_ffn),
            vocab_size=f.int("vocab_size", 32000),
            norm_eps=f.float("rms_norm_eps", 1e-6),
            qkv_bias=f.bool("attention_bias", model_type == "qwen2"),
            max_position=max_position,
            tie_embeddings=f.bool("tie_word_embeddings", False),
            rope=RopeConfig.from_hf(hf, head_dim=head_dim, max_position=max_position, where=where),
        )

    def to_hf(self) -> dict:
        """A transformers-style config dict (``model_type`` llama, or qwen2 when q/k/v have biases)."""
        rope = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type != "default":
            rope["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope.update(
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position,
            )
        return {
            "model_type": "qwen2" if self.qkv_bias else "llama",
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.norm_eps,
            "attention_bias": self.qkv_bias,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "rope_theta": self.rope.theta,
            "rope_scaling": None if self.rope.rope_type == "default" else {**rope, "type": self.rope.rope_type},
            "hidden_act": "silu",
        }

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LlamaConfig":
        if name not in LLAMA_CONFIGS:
            raise KeyError(f"unknown LLaMA config {name!r}; known: {', '.join(sorted(LLAMA_CONFIGS))}")
        return replace(LLAMA_CONFIGS[name], **overrides)


def _cfg(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, *, theta=10000.0, max_position=2048, **kw):
    head_dim = dim // n_heads
    return LlamaConfig(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim,
        vocab_size=vocab_size, max_position=max_position,
        rope=RopeConfig(head_dim=head_dim, theta=theta, original_max_position=max_position), **kw,
    )  # fmt: skip


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": _cfg(64, 2, 4, 2, 128, 32064, max_position=1024),
    "smollm2-135m": _cfg(576, 30, 9, 3, 1536, 49152, theta=100000.0, max_position=8192, norm_eps=1e-5, tie_embeddings=True),
    "llama2-7b": _cfg(4096, 32, 32, 32, 11008, 32064, max_position=2048),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.qkv_proj: nn.Module | None = None  # q, k, v as one GEMM in their place (``models.fuse``; inference)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, dim] -> q [B, T, Hq * D], k and v [B, T, Hkv * D]."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.n_kv_heads * self.head_dim
        return self.qkv_proj(x).split((self.n_heads * self.head_dim, kv, kv), dim=-1)

    def forward(self, x: torch.Tensor, cache: AttendSeam) -> torch.Tensor:
        """x: [B, T, dim] -> [B, T, dim]."""
        b, t, _ = x.shape
        q, k, v = self.project(x)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        out = cache.attend(self.layer, q, k, v)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, dim]


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one GEMM in their place (``models.fuse``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, dim] -> [B, T, dim] (SwiGLU)."""
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cache: AttendSeam) -> torch.Tensor:
        """Pre-norm residual block. x: [B, T, dim] -> [B, T, dim]."""
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        cache: AttendSeam,
        pin: bool = False,
    ) -> torch.Tensor:
        """input_ids: [B, T] or inputs_embeds: [B, T, dim] -> final-normed hidden states [B, T, dim].

        ``layers_forward`` then ``cache.end_forward(pin=pin)`` once.
        """
        hidden = self.layers_forward(input_ids, inputs_embeds, cache=cache)
        cache.end_forward(pin=pin)
        return hidden

    def layers_forward(
        self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None, *, cache: AttendSeam
    ) -> torch.Tensor:
        """``forward`` without ``cache.end_forward``: the layers attend (the cache stores the new tokens) but the
        forward is not committed. What ``torch.compile`` captures (``policies.compiled``): the cache's commit and
        compression run eagerly after it, between forwards. Returns final-normed hidden states [B, T, dim]."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of `input_ids` and `inputs_embeds`")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(x, cache)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        cache: AttendSeam,
        pin: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Returns float32 logits [B, T, vocab] (``[B, 1, vocab]`` with ``last_only``)."""
        h = self.model(input_ids, inputs_embeds, cache=cache, pin=pin)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h).float()
