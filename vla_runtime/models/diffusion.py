"""Diffusion pieces shared by CogACT (DiT action head) and HybridVLA (diffusion inside the LLM).

Both upstreams use the same process (OpenAI improved-diffusion, as vendored by CogACT): 100 training
steps on the ``squaredcos_cap_v2`` schedule, epsilon prediction, MSE loss, and DDIM sampling with
eta = 0 on the "ddimN" timestep striding. The model sees the *original* integer timesteps (0..99).

    diffusion = GaussianDiffusion(DiffusionConfig(sample_steps=10))
    diffusion.ddim_timesteps()            # [90, 80, ..., 0]
    actions = diffusion.ddim_sample(eps_fn, noise)   # eps_fn(x_t [B,T,A], t [B]) -> eps [B,T,A]

Also here: the sinusoidal ``TimestepEmbedder`` and the two-layer ``Mlp`` both heads build on
(parameter names are timm's / DiT's, so upstream state dicts load strictly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

EpsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def squaredcos_cap_v2_betas(n_steps: int = 100, *, max_beta: float = 0.999) -> np.ndarray:
    """Betas of the cosine schedule (Nichol & Dhariwal): ``beta_i = min(1 - abar((i+1)/n) / abar(i/n), max_beta)``
    with ``abar(s) = cos((s + 0.008) / 1.008 * pi / 2) ** 2``. Returns float64 ``[n_steps]``."""

    def abar(s: float) -> float:
        return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2

    return np.array([min(1 - abar((i + 1) / n_steps) / abar(i / n_steps), max_beta) for i in range(n_steps)])


NOISE_SCHEDULES: dict[str, Callable[[int], np.ndarray]] = {"squaredcos_cap_v2": squaredcos_cap_v2_betas}


def ddim_timestep_set(train_steps: int, sample_steps: int) -> list[int]:
    """The timesteps upstream's ``"ddimN"`` respacing keeps, ascending.

    The smallest integer stride ``s`` with ``len(range(0, train_steps, s)) == sample_steps``
    (``N = 1`` keeps ``{train_steps // 2}``, as upstream does for 100 steps). ``ValueError`` when
    no stride gives exactly ``sample_steps`` steps.
    """
    if sample_steps == 1:
        return [train_steps // 2]
    for stride in range(1, train_steps):
        if len(range(0, train_steps, stride)) == sample_steps:
            return list(range(0, train_steps, stride))
    valid = sorted({len(range(0, train_steps, s)) for s in range(1, train_steps)})
    raise ValueError(
        f"`sample_steps` = {sample_steps}: no integer stride over {train_steps} training steps gives exactly that many "
        f"DDIM steps; valid counts: {valid}"
    )


@dataclass(frozen=True)
class DiffusionConfig:
    """The diffusion process and the sampler.

    Args:
        train_steps: steps of the training process (100 in both upstreams).
        schedule: beta schedule, a key of ``NOISE_SCHEDULES``.
        sample_steps: DDIM steps at inference (CogACT 10 -> t in {90, ..., 0}; HybridVLA 4 -> {75, 50, 25, 0}).
    """

    train_steps: int = 100
    schedule: str = "squaredcos_cap_v2"
    sample_steps: int = 10

    def __post_init__(self) -> None:
        if self.schedule not in NOISE_SCHEDULES:
            raise KeyError(f"unknown noise schedule {self.schedule!r}; known: {', '.join(sorted(NOISE_SCHEDULES))}")
        if self.train_steps < 2:
            raise ValueError(f"`train_steps` must be >= 2, got {self.train_steps}")
        if not 1 <= self.sample_steps <= self.train_steps:
            raise ValueError(f"`sample_steps` must be in [1, {self.train_steps}], got {self.sample_steps}")
        ddim_timestep_set(self.train_steps, self.sample_steps)  # raises when not realisable


@dataclass(frozen=True)
class Inpaint:
    """Known leading rows of a sample, for guided inpainting (real-time chunking).

    target: [B, n, A] normalised actions the first ``n`` rows should match; weight: [n] in [0, 1], how hard
    each row is pulled to its target (1: replaced, 0: free).
    """

    target: torch.Tensor
    weight: torch.Tensor


def rtc_weights(n: int, frozen: int) -> np.ndarray:
    """Real-time chunking's soft mask over ``n`` known rows: 1 for the ``frozen`` rows that execute before the
    new chunk can land, then an exponential decay ``c (e^c - 1) / (e - 1)``, ``c`` going linearly from 1 towards 0
    over the rest (arXiv 2506.07339, eq. 5). Returns float64 [n]."""
    frozen = min(max(frozen, 0), n)
    rest = n - frozen
    c = (rest - np.arange(rest)) / (rest + 1)  # (rest / (rest + 1)) ... (1 / (rest + 1))
    return np.concatenate([np.ones(frozen), c * np.expm1(c) / math.expm1(1.0)])


class GaussianDiffusion:
    """Forward process, epsilon-MSE training loss and the eta = 0 DDIM sampler.

    Coefficients are computed in float64 and applied in float32 (as upstream's numpy tables are).
    """

    def __init__(self, cfg: DiffusionConfig = DiffusionConfig()) -> None:
        self.cfg = cfg
        self.betas = NOISE_SCHEDULES[cfg.schedule](cfg.train_steps)  # float64 [T]
        self.alphas_cumprod = np.cumprod(1.0 - self.betas)  # float64 [T]

    @property
    def num_timesteps(self) -> int:
        return self.cfg.train_steps

    def _coef(self, values: np.ndarray, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """values[t] as float32 on t's device, shaped [B, 1, ...] to broadcast over ``ndim`` dims."""
        out = torch.as_tensor(values, device=t.device)[t].float()
        return out.view(-1, *([1] * (ndim - 1)))

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise. x0, noise: [B, ...]; t: [B] long."""
        a = self._coef(np.sqrt(self.alphas_cumprod), t, x0.ndim)
        s = self._coef(np.sqrt(1.0 - self.alphas_cumprod), t, x0.ndim)
        return (a * x0.float() + s * noise.float()).to(x0.dtype)

    def training_loss(self, eps_fn: EpsFn, x0: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """DDPM loss: t ~ U{0..T-1} per sample, noise ~ N(0, I), MSE(eps_fn(x_t, t), noise) over every entry.

        x0: [B, T, A] normalised actions. Returns a scalar.
        """
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        t = torch.randint(0, self.num_timesteps, (x0.shape[0],), generator=generator, device=x0.device)
        eps = eps_fn(self.q_sample(x0, t, noise), t)
        if eps.shape != noise.shape:
            raise ValueError(f"eps_fn returned shape {tuple(eps.shape)}; expected {tuple(noise.shape)}")
        return (eps.float() - noise.float()).pow(2).mean()

    def ddim_timesteps(self) -> list[int]:
        """The sampler's timesteps in the order they run (descending): e.g. ``[90, 80, ..., 0]``."""
        return ddim_timestep_set(self.cfg.train_steps, self.cfg.sample_steps)[::-1]

    def ddim_sample(self, eps_fn: EpsFn, noise: torch.Tensor, *, inpaint: Inpaint | None = None) -> torch.Tensor:
        """Deterministic DDIM (eta = 0) from ``noise`` at the largest kept timestep down to t = 0.

        Per step: ``x0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)``, then
        ``x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev) eps`` with ``abar_prev = 1`` after the last step.
        No clipping of x0 (``clip_denoised=False`` upstream). noise: [B, T, A]. Returns x0 [B, T, A] in noise's dtype.

        ``inpaint``: at every step the predicted ``x0``'s first rows are pulled to the known ones,
        ``x0 <- w target + (1 - w) x0``, before ``x_prev`` is formed: the rest of the chunk is denoised
        around them (guidance by replacement; real-time chunking's ΠGDM gradient guidance is not used).
        Rows with weight 1 come out equal to their target.
        """
        steps = self.ddim_timesteps()
        x = noise.float()
        for i, t in enumerate(steps):
            abar = float(self.alphas_cumprod[t])
            abar_prev = float(self.alphas_cumprod[steps[i + 1]]) if i + 1 < len(steps) else 1.0
            t_batch = torch.full((x.shape[0],), t, device=x.device, dtype=torch.long)
            eps = eps_fn(x.to(noise.dtype), t_batch).float()
            x0 = (x - math.sqrt(1.0 - abar) * eps) / math.sqrt(abar)
            if inpaint is not None:
                x0 = _pull(x0, inpaint)
            x = math.sqrt(abar_prev) * x0 + math.sqrt(1.0 - abar_prev) * eps
        return x.to(noise.dtype)


def _pull(x0: torch.Tensor, inpaint: Inpaint) -> torch.Tensor:
    """x0 [B, T, A] with its first n rows moved to ``inpaint.target`` by ``inpaint.weight``."""
    n = inpaint.target.shape[1]
    if n > x0.shape[1] or inpaint.weight.shape != (n,):
        raise ValueError(f"inpaint target has {n} rows and weight {tuple(inpaint.weight.shape)}; the sample has {x0.shape[1]} rows")
    w = inpaint.weight.to(x0.device, torch.float32)[None, :, None]
    head = w * inpaint.target.to(x0.device, torch.float32) + (1.0 - w) * x0[:, :n]
    return torch.cat((head, x0[:, n:]), dim=1)


def timestep_embedding(t: torch.Tensor, dim: int = 256, *, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding, cosine half first: ``[cos(t f_k), sin(t f_k)]`` with ``f_k = max_period^(-k / (dim/2))``.

    t: [N] (integer or fractional). Returns float32 [N, dim] (a zero column is appended for odd ``dim``).
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    """DiT's timestep embedder: sinusoid(256) -> Linear -> SiLU -> Linear. Keys ``mlp.0.*``, ``mlp.2.*``."""

    def __init__(self, hidden: int, frequency_dim: int = 256) -> None:
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: [N] -> [N, hidden]."""
        return self.mlp(timestep_embedding(t, self.frequency_dim).to(self.mlp[0].weight.dtype))


class Mlp(nn.Module):
    """timm's ``Mlp`` layout (``fc1`` -> GELU(tanh) -> ``fc2``), the MLP of DiT blocks and HybridVLA's heads."""

    def __init__(self, in_features: int, hidden: int, out_features: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, out_features or in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        return self.fc2(self.act(self.fc1(x)))
