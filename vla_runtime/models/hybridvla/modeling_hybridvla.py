"""HybridVLA: diffusion inside the LLM, with upstream's module and parameter names.

There is no separate action network. Four small modules, each its own entry of the checkpoint's
``model`` dict, turn diffusion state into LLM tokens and back:

- ``proprio_embedder``: robot state [A] -> one token (timm ``Mlp`` A -> dim -> dim, GELU-tanh);
- ``t_embedder``: DDIM timestep -> one token (DiT's sinusoid + MLP);
- ``x_embedder``: each noisy action [A] -> one token (same shape as ``proprio_embedder``);
- ``final_layer``: RMSNorm + ``Mlp`` dim -> dim -> A, read at the noisy-action positions -> eps.

Sequence (one view): ``[BOS] [patches] [prompt] 29871 <BOD> [proprio] [t] [x_0 .. x_fut]`` for the
diffusion branch; the AR branch continues ``... [x] <EOD> 29871`` and decodes 7 action tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ...kv.base import KVCache
from ..diffusion import GaussianDiffusion, Mlp, TimestepEmbedder
from ..generation import TokenHead, decode
from ..llama import LlamaForCausalLM, RMSNorm
from ..prismatic.modeling_prismatic import PrismaticVLM
from .configuration_hybridvla import DiffusionHeadConfig

DIFFUSION_MODULES = ("proprio_embedder", "x_embedder", "t_embedder", "final_layer")


class ActionEmbedder(nn.Module):
    """One token per action vector: ``mlp`` (``fc1`` A -> dim, GELU-tanh, ``fc2`` dim -> dim)."""

    def __init__(self, action_dim: int, dim: int) -> None:
        super().__init__()
        self.mlp = Mlp(action_dim, dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., A] -> [..., dim]."""
        return self.mlp(x)


class NoiseHead(nn.Module):
    """Upstream's ``final_layer``: ``norm_final`` (RMSNorm, eps 1e-6) then ``mlp`` dim -> dim -> A."""

    def __init__(self, dim: int, action_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm_final = RMSNorm(dim, eps)
        self.mlp = Mlp(dim, dim, action_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., dim] final (post-norm) LLM hidden states -> eps [..., A]."""
        return self.mlp(self.norm_final(h))


class DiffusionHead(nn.Module):
    """The four diffusion modules; attribute names are the checkpoint's module keys (``DIFFUSION_MODULES``)."""

    def __init__(self, cfg: DiffusionHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.proprio_embedder = ActionEmbedder(cfg.action_dim, cfg.dim)
        self.x_embedder = ActionEmbedder(cfg.action_dim, cfg.dim)
        self.t_embedder = TimestepEmbedder(cfg.dim)
        self.final_layer = NoiseHead(cfg.dim, cfg.action_dim, cfg.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Upstream's initialisation: xavier linears, N(0, 0.02) embedders, zero last projection of the noise head."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for emb in (self.x_embedder, self.proprio_embedder):
            nn.init.normal_(emb.mlp.fc1.weight, std=0.02)
            nn.init.normal_(emb.mlp.fc2.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        nn.init.zeros_(self.final_layer.mlp.fc2.weight)
        nn.init.zeros_(self.final_layer.mlp.fc2.bias)

    @staticmethod
    def config_from_state_dicts(modules: dict[str, dict[str, torch.Tensor]], *, future_window: int) -> DiffusionHeadConfig:
        """Sizes from the checkpoint's per-module state dicts (``KeyError`` naming a missing module).

        ``future_window`` cannot be read from the weights (there is no positional table): take it from config.json.
        """
        missing = [m for m in DIFFUSION_MODULES if m not in modules]
        if missing:
            raise KeyError(f"HybridVLA checkpoint lacks diffusion module(s) {missing}; found: {sorted(modules)}")
        key = "mlp.fc1.weight"
        if key not in modules["proprio_embedder"]:
            raise KeyError(f"proprio_embedder has no {key!r}; keys: {sorted(modules['proprio_embedder'])}")
        dim, action_dim = modules["proprio_embedder"][key].shape
        return DiffusionHeadConfig(dim=int(dim), action_dim=int(action_dim), future_window=future_window)

    def load_module_state_dicts(
        self, modules: dict[str, dict[str, torch.Tensor]], *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        """Load every module strictly from the checkpoint layout, placing tensors on ``device`` in ``dtype``."""
        for name in DIFFUSION_MODULES:
            state = {k: v.to(device=device, dtype=dtype) for k, v in modules[name].items()}
            getattr(self, name).load_state_dict(state, strict=True, assign=True)

    def module_state_dicts(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-module state dicts in the checkpoint layout."""
        return {name: getattr(self, name).state_dict() for name in DIFFUSION_MODULES}

    def embed_proprio(self, state: torch.Tensor) -> torch.Tensor:
        """state: [B, A] normalised robot state -> [B, 1, dim]."""
        return self.proprio_embedder(state).unsqueeze(1)

    def embed_step(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The tokens of one diffusion step, ``[t, x_0 .. x_fut]``. x: [B, chunk, A]; t: [B]. Returns [B, 1 + chunk, dim]."""
        return torch.cat([self.t_embedder(t).unsqueeze(1), self.x_embedder(x)], dim=1)

    def eps(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, chunk, dim] final LLM states *at* the noisy-action positions (not shifted) -> eps [B, chunk, A]."""
        return self.final_layer(hidden)


@torch.no_grad()
def denoise_on_cache(
    lm: LlamaForCausalLM,
    head: DiffusionHead,
    cache: KVCache,
    diffusion: GaussianDiffusion,
    noise: torch.Tensor,
    *,
    prefix: torch.Tensor | None = None,
    decoder: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """DDIM inside the LLM, reusing the prefix KV.

    Each step appends ``[t, x_0 .. x_fut]`` (``1 + chunk`` tokens) after the prefix, reads eps at the x
    positions and rolls those tokens back, so no step re-runs the prefix and the trim is ``1 + chunk`` for
    any ``future_window`` (upstream hard-codes 2, right only for ``future_window = 0``).
    prefix: [B, P, dim] embeddings not yet in the cache; the first step runs them together with its own
    tokens in one forward (upstream's structure: one full forward, then short ones) and they stay cached.
    ``None``: the cache already holds the prefix. noise: [B, chunk, A]. Returns normalised actions [B, chunk, A].
    ``decoder``: what runs ``lm.model``'s forward (default ``lm.model``; a session's compiled one,
    ``policies.compiled.CompiledDecoder``).
    """
    pending = prefix
    decoder = lm.model if decoder is None else decoder

    def eps_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        nonlocal pending
        mark = cache.mark()  # a fresh mark per step: caches defer compression while one is open
        tokens = head.embed_step(x, t).to(lm.lm_head.weight.dtype)
        keep = 0
        if pending is not None:
            tokens, keep, pending = torch.cat([pending, tokens], dim=1), pending.shape[1], None
        h = decoder(inputs_embeds=tokens, cache=cache)
        cache.rollback(mark + keep)
        return head.eps(h[:, -x.shape[1] :].to(head.final_layer.norm_final.weight.dtype))

    return diffusion.ddim_sample(eps_fn, noise)


@torch.no_grad()
def denoise_by_reprefill(
    lm: LlamaForCausalLM,
    head: DiffusionHead,
    cache: KVCache,
    diffusion: GaussianDiffusion,
    noise: torch.Tensor,
    prefix: torch.Tensor,
) -> torch.Tensor:
    """The same DDIM loop without prefix reuse: every step runs ``prefix + [t, x]`` through the LLM from a
    rolled-back cache (what upstream does without its KV trick; the reference for ``denoise_on_cache``).

    prefix: [B, P, dim] embeddings; the cache's content at call time stays. Returns [B, chunk, A].
    """

    def eps_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        mark = cache.mark()
        tokens = torch.cat([prefix, head.embed_step(x, t).to(prefix.dtype)], dim=1)
        h = lm.model(inputs_embeds=tokens, cache=cache)
        cache.rollback(mark)
        return head.eps(h[:, -x.shape[1] :].to(head.final_layer.norm_final.weight.dtype))

    return diffusion.ddim_sample(eps_fn, noise)


@torch.no_grad()
def decode_ar_actions(
    lm: LlamaForCausalLM,
    head: DiffusionHead,
    cache: KVCache,
    *,
    noise: torch.Tensor,
    t: torch.Tensor,
    tail_ids: tuple[int, ...],
    n_tokens: int,
    decoder: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The autoregressive branch on the cached prefix: append ``[t, x_noise] + tail_ids`` (``<EOD>, 29871``)
    and greedily decode ``n_tokens`` tokens over the full vocabulary, as upstream (conditioned on a random-noise
    diffusion slot at a random t, which matches its training distribution). The cache keeps what was appended;
    roll back to drop it.

    noise: [B, chunk, A]; t: [B]. Returns ids [B, n_tokens] and confidences [B, n_tokens] (max softmax probability).
    ``decoder``: what runs ``lm.model``'s forward (as in ``denoise_on_cache``).
    """
    decoder = lm.model if decoder is None else decoder

    def last_logits(input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``lm(..., last_only=True)[:, -1]`` through ``decoder``: float32 logits [B, V] of the last position."""
        return lm.lm_head(decoder(input_ids, inputs_embeds, cache=cache)[:, -1:]).float()[:, -1]

    b = noise.shape[0]
    tail = torch.tensor(tail_ids, device=noise.device).expand(b, len(tail_ids))
    dtype = lm.lm_head.weight.dtype
    embeds = torch.cat([head.embed_step(noise, t).to(dtype), lm.model.embed_tokens(tail)], dim=1)
    head = TokenHead(lm.lm_head, record_confidence=True)
    ids = decode(
        last_logits,
        last_logits(inputs_embeds=embeds),  # [B, V] float32
        head.pick,
        max_new_tokens=n_tokens,
    )
    return ids, torch.stack(head.confidences, dim=1)


class HybridVLA(nn.Module):
    """The whole model: ``vlm`` (the shared Prismatic VLM; its ``lm_head`` decodes the AR tokens) and
    ``head`` (the four diffusion modules)."""

    def __init__(self, vlm: PrismaticVLM, head: DiffusionHead) -> None:
        super().__init__()
        self.vlm = vlm
        self.head = head

    @property
    def lm(self) -> LlamaForCausalLM:
        return self.vlm.language_model
