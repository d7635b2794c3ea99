"""CogACT's DiT action model, with upstream's parameter names (``action_model`` -> ``net.*``).

What the upstream code really does (not what the paper text says): there is no adaLN and no
cross-attention. The cognition feature goes through ``z_embedder.linear``, is *added* to the
timestep embedding, and that sum is prepended as one token ``c`` before the embedded noisy
actions; a learned positional table is added; pre-LayerNorm blocks (no affine) attend
bidirectionally; the output drops the ``c`` position. ``history_embedder`` exists in every
checkpoint but is never used (upstream asserts ``past_action_window_size == 0``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..diffusion import DiffusionConfig, GaussianDiffusion, Inpaint, Mlp, TimestepEmbedder
from ..prismatic.modeling_prismatic import PrismaticVLM
from .configuration_cogact import DiTConfig


class Attention(nn.Module):
    """timm ``Attention`` layout: fused ``qkv`` (with bias) and ``proj``; no mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, N, dim] -> [B, N, dim]."""
        b, n, c = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)  # [3, B, H, N, hd]
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, H, N, hd]
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class DiTBlock(nn.Module):
    """Pre-LN block: ``x + attn(LN(x))``, ``x + mlp(LN(x))``; both LayerNorms have no parameters (eps 1e-6)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(cfg.hidden, cfg.heads)
        self.norm2 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(cfg.hidden, int(cfg.hidden * cfg.mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LinearEmbedder(nn.Module):
    """``linear`` only (upstream's ActionEmbedder / HistoryEmbedder)."""

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class ConditionEmbedder(nn.Module):
    """Upstream's LabelEmbedder: ``linear`` over the cognition feature, plus the learned ``uncondition``
    [1, token_size] that replaces it for classifier-free guidance (and with probability ``dropout`` in training)."""

    def __init__(self, token_size: int, hidden: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.dropout = dropout
        self.linear = nn.Linear(token_size, hidden)
        self.uncondition = nn.Parameter(torch.zeros(1, token_size))

    def forward(self, z: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """z: [B, 1, token_size]; drop: optional [B] bool (True = use ``uncondition``). Returns [B, 1, hidden]."""
        if drop is not None:
            z = torch.where(drop[:, None, None], self.uncondition.to(z.dtype).expand_as(z), z)
        return self.linear(z)


class FinalLayer(nn.Module):
    """LayerNorm (no affine, eps 1e-6) -> ``linear`` to the action dim."""

    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm_final(x))


class DiT(nn.Module):
    """Noise predictor over an action chunk, conditioned on the cognition feature.

    Sequence: ``[c, x_1 .. x_T] + positional_embedding`` with ``c = t_embedder(t) + z_embedder(z)``,
    length ``T + 1`` (17 for the 16-action chunk).
    """

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.x_embedder = LinearEmbedder(cfg.action_dim, cfg.hidden)
        self.history_embedder = LinearEmbedder(cfg.action_dim, cfg.hidden)  # in upstream checkpoints, unused
        self.t_embedder = TimestepEmbedder(cfg.hidden)
        self.z_embedder = ConditionEmbedder(cfg.token_size, cfg.hidden)
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.chunk + 1, cfg.hidden))
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.hidden, cfg.action_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Upstream's initialisation (xavier linears, N(0, 0.02) embedders, zero final layer)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for linear in (self.x_embedder.linear, self.history_embedder.linear, self.z_embedder.linear):
            nn.init.normal_(linear.weight, std=0.02)
        nn.init.normal_(self.z_embedder.uncondition, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=self.cfg.hidden**-0.5)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, z: torch.Tensor, *, drop: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [B, T, action_dim] noisy actions; t: [B] timesteps; z: [B, 1, token_size] cognition feature;
        drop: optional [B] bool condition dropout. Returns eps [B, T, action_dim]."""
        c = self.t_embedder(t).unsqueeze(1) + self.z_embedder(z, drop)  # [B, 1, H]
        h = torch.cat([c, self.x_embedder(x)], dim=1) + self.positional_embedding  # [B, T+1, H]
        for block in self.blocks:
            h = block(h)
        return self.final_layer(h)[:, 1:]

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, z: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance in one doubled batch: ``eps_u + scale (eps_c - eps_u)``.

        x: [B, T, A]; t: [B]; z: [B, 1, token_size]. Returns [B, T, A].
        """
        b = x.shape[0]
        uncond = self.z_embedder.uncondition.to(z.dtype).expand(b, 1, -1)
        eps = self.forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([z, uncond]))
        cond_eps, uncond_eps = eps[:b], eps[b:]
        return uncond_eps + scale * (cond_eps - uncond_eps)


class ActionModel(nn.Module):
    """The ``action_model`` checkpoint module: ``net`` (the DiT) plus its diffusion process (no weights)."""

    def __init__(self, cfg: DiTConfig, diffusion: DiffusionConfig = DiffusionConfig()) -> None:
        super().__init__()
        self.net = DiT(cfg)
        self.diffusion = GaussianDiffusion(diffusion)

    @property
    def cfg(self) -> DiTConfig:
        return self.net.cfg

    def loss(
        self, actions: torch.Tensor, cognition: torch.Tensor, *, repeats: int = 1, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """DDPM training loss (upstream ``ActionModel.loss``), with condition dropout while ``self.training``.

        actions: [B, T, A] normalised chunk (T = chunk); cognition: [B, 1, token_size]. ``repeats``:
        upstream's ``repeated_diffusion_steps`` (each sample drawn again with fresh t and noise). Returns a scalar.
        """
        if actions.shape[1:] != (self.cfg.chunk, self.cfg.action_dim):
            raise ValueError(f"actions must be [B, {self.cfg.chunk}, {self.cfg.action_dim}], got {tuple(actions.shape)}")
        actions, cognition = actions.repeat(repeats, 1, 1), cognition.repeat(repeats, 1, 1)
        drop = None
        if self.training and self.net.z_embedder.dropout > 0:
            u = torch.rand(actions.shape[0], generator=generator, device=actions.device)
            drop = u < self.net.z_embedder.dropout
        return self.diffusion.training_loss(lambda x, t: self.net(x, t, cognition, drop=drop), actions, generator=generator)

    def draw_noise(self, batch: int, generator: torch.Generator | None) -> torch.Tensor:
        """The sampler's starting noise [batch, chunk, action_dim], float32, drawn on the CPU (the same on every device)."""
        return torch.randn((batch, self.cfg.chunk, self.cfg.action_dim), generator=generator, dtype=torch.float32)

    @torch.no_grad()
    def sample(
        self, cognition: torch.Tensor, *, cfg_scale: float = 1.5, generator: torch.Generator | None = None,
        inpaint: Inpaint | None = None, noise: torch.Tensor | None = None, net: Callable | None = None,
    ) -> torch.Tensor:
        """DDIM (eta = 0) from N(0, I) noise drawn with ``generator`` (a CPU generator; or the given ``noise``
        [B, chunk, action_dim], e.g. rows drawn by several sessions' generators); CFG when ``cfg_scale > 1``;
        ``inpaint``: the chunk's first rows guided to known actions (``GaussianDiffusion.ddim_sample``).

        cognition: [B, 1, token_size] (cast to the DiT's dtype). Returns normalised actions [B, chunk, action_dim].
        ``net``: what predicts the noise instead of ``self.net`` (its compiled form, ``policies.compiled.CompiledDiT``:
        called as ``net(x, t, z)`` and ``net.forward_with_cfg(x, t, z, scale)``).
        """
        dtype = self.net.x_embedder.linear.weight.dtype
        net = self.net if net is None else net
        z = cognition.to(dtype)
        if noise is None:
            noise = self.draw_noise(z.shape[0], generator)
        noise = noise.to(z.device, dtype)
        if cfg_scale > 1.0:
            return self.diffusion.ddim_sample(lambda x, t: net.forward_with_cfg(x, t, z, cfg_scale), noise, inpaint=inpaint)
        return self.diffusion.ddim_sample(lambda x, t: net(x, t, z), noise, inpaint=inpaint)


class CogACT(nn.Module):
    """The whole model: ``vlm`` (the shared Prismatic VLM) and ``action_model`` (the DiT, float32).

    The cognition feature is the final (post-norm) hidden state at the last prompt position, which holds
    the appended EOS; it is the DiT's condition. One prefill, no decoding, no ``lm_head``.
    """

    def __init__(self, vlm: PrismaticVLM, action_model: ActionModel) -> None:
        super().__init__()
        self.vlm = vlm
        self.action_model = action_model

    @staticmethod
    def cognition(hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, T, dim] final hidden states of a prompt ending in EOS -> [B, 1, dim] (float32)."""
        return hidden[:, -1:].float()
