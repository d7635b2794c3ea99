"""OpenVLA-OFT's diffusion variant: the noise-predicting head, the noisy-action projector and its DDIM.

Upstream (``prismatic/models/action_heads.py``, ``projectors.py``): ``DiffusionActionHead.noise_predictor``
is an ``MLPResNet`` (2 blocks) from ``action_dim * llm_dim`` features per action to ``action_dim`` (keys
``noise_predictor.mlp_resnet.*``); ``time_encoder`` is a parameter-free sinusoid of width ``llm_dim``;
``NoisyActionProjector`` maps each scalar action entry to one LLM token (``fc1`` [llm_dim, 1] -> GELU ->
``fc2``). The scheduler is diffusers' ``DDIMScheduler(num_train_timesteps=50,
beta_schedule="squaredcos_cap_v2")`` with its defaults (epsilon prediction, ``clip_sample=True`` to
[-1, 1], ``set_alpha_to_one=True``, ``steps_offset=0``, ``timestep_spacing="leading"``, eta = 0), set to
``num_diffusion_steps_inference`` = 50 steps. ``OFTDDIM`` is that scheduler written out (no diffusers).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..diffusion import squaredcos_cap_v2_betas
from .configuration_oft import HEAD_BLOCKS, OFTConfig
from .mlp_resnet import MLPResNet


def sinusoidal_time(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Upstream's ``SinusoidalPositionalEncoding``: t [B] -> [sin(t f_k), cos(t f_k)] [B, dim] (sine half
    first), ``f_k = exp(-k log(10000) / (dim/2 - 1))``, k = 0 .. dim/2 - 1. Float32."""
    if dim % 2:
        raise ValueError(f"the timestep encoding needs an even width, got {dim}")
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device) * (-math.log(10000) / (half - 1)))  # [dim/2]
    args = t.float()[:, None] * freqs[None]  # [B, dim/2]
    return torch.cat((args.sin(), args.cos()), dim=-1)  # [B, dim]


class OFTDDIM:
    """diffusers' ``DDIMScheduler`` as upstream configures it, for sampling only.

    ``alphas_cumprod``: float32 cumulative product of ``1 - betas`` (``squaredcos_cap_v2``, max beta 0.999).
    ``timesteps``: ``leading`` spacing, ``arange(steps) * (train_steps // steps)`` descending.
    """

    def __init__(self, train_steps: int, steps: int) -> None:
        if not 1 <= steps <= train_steps:
            raise ValueError(f"diffusion `steps` must be in [1, {train_steps}] (the training steps), got {steps}")
        self.train_steps, self.steps = train_steps, steps
        betas = torch.tensor(squaredcos_cap_v2_betas(train_steps), dtype=torch.float32)
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)  # [train_steps] float32
        self.ratio = train_steps // steps
        self.timesteps = [i * self.ratio for i in range(steps)][::-1]

    def step(self, eps: torch.Tensor, t: int, x: torch.Tensor) -> torch.Tensor:
        """x_t -> x_{t - ratio} (eta = 0): ``x0 = clip((x - sqrt(1 - a_t) eps) / sqrt(a_t), -1, 1)``,
        ``x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps``, ``a_prev = 1`` past t = 0. eps, x: [B, K, A]."""
        prev = t - self.ratio
        a_t = self.alphas_cumprod[t]
        a_prev = self.alphas_cumprod[prev] if prev >= 0 else torch.tensor(1.0)
        x0 = ((x - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-1.0, 1.0)
        return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps


class NoisePredictionModel(nn.Module):
    """``mlp_resnet``: an action's ``action_dim * llm_dim`` features -> its predicted noise [action_dim]."""

    def __init__(self, cfg: OFTConfig) -> None:
        super().__init__()
        self.mlp_resnet = MLPResNet(HEAD_BLOCKS, cfg.llm_dim * cfg.action_dim, cfg.head_hidden, cfg.action_dim)


class DiffusionActionHead(nn.Module):
    """The chunk's action hidden states -> predicted noise. Parameters ``noise_predictor.mlp_resnet.*``."""

    def __init__(self, cfg: OFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.noise_predictor = NoisePredictionModel(cfg)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, chunk_size * action_dim, llm_dim] -> noise [B, chunk_size, action_dim]."""
        b = hidden.shape[0]
        rows = hidden.reshape(b, self.cfg.chunk_size, -1)  # [B, chunk, action_dim * llm_dim]
        return self.noise_predictor.mlp_resnet(rows)


class NoisyActionProjector(nn.Module):
    """Each noisy action entry (a scalar) -> one LLM token: ``fc1`` [llm_dim, 1] -> GELU -> ``fc2``."""

    def __init__(self, llm_dim: int) -> None:
        super().__init__()
        self.fc1, self.act_fn1, self.fc2 = nn.Linear(1, llm_dim), nn.GELU(), nn.Linear(llm_dim, llm_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, K * A, 1] -> [B, K * A, llm_dim]."""
        return self.fc2(self.act_fn1(self.fc1(x)))
