"""Diffusion utilities: golden schedule values, DDIM timestep sets, and the sampler against upstream's respaced form."""

import math

import numpy as np
import pytest
import torch

from vla_runtime.models.diffusion import (
    DiffusionConfig,
    GaussianDiffusion,
    Inpaint,
    TimestepEmbedder,
    ddim_timestep_set,
    rtc_weights,
    squaredcos_cap_v2_betas,
    timestep_embedding,
)

# abar_t of the 100-step squaredcos_cap_v2 schedule, as published with the CogACT/HybridVLA analysis
ABAR_GOLDEN = {0: 0.99937, 10: 0.96672, 25: 0.83562, 50: 0.47826, 75: 0.13349, 90: 0.019544, 99: 2.43e-7}


def test_squaredcos_cap_v2_golden_values():
    betas = squaredcos_cap_v2_betas(100)
    assert betas.dtype == np.float64 and betas.shape == (100,)
    assert betas[0] == pytest.approx(6.31e-4, rel=1e-3)
    assert betas[99] == 0.999  # capped
    abar = np.cumprod(1 - betas)
    for t, value in ABAR_GOLDEN.items():
        assert abar[t] == pytest.approx(value, rel=2e-3), t
    np.testing.assert_allclose(GaussianDiffusion().alphas_cumprod, abar)


@pytest.mark.parametrize(
    "n, expected",
    [
        (10, list(range(0, 100, 10))),
        (4, [0, 25, 50, 75]),
        (5, [0, 20, 40, 60, 80]),
        (1, [50]),
        (3, [0, 34, 68]),
        (100, list(range(100))),
    ],
)
def test_ddim_timestep_sets(n, expected):
    assert ddim_timestep_set(100, n) == expected
    assert GaussianDiffusion(DiffusionConfig(sample_steps=n)).ddim_timesteps() == expected[::-1]


def test_unrealisable_ddim_step_count_is_rejected():
    with pytest.raises(ValueError, match="no integer stride"):
        DiffusionConfig(sample_steps=30)
    with pytest.raises(KeyError, match="squaredcos_cap_v2"):
        DiffusionConfig(schedule="linear")


def _upstream_style_ddim(eps_fn, noise, n_steps):
    """Reference: upstream's SpacedDiffusion (betas rebuilt from the kept abar) + ddim_sample with eta = 0,
    re-deriving eps from pred_xstart, written from the formulas in float64."""
    base = np.cumprod(1 - squaredcos_cap_v2_betas(100))
    kept = ddim_timestep_set(100, n_steps)
    new_betas, last = [], 1.0
    for i, a in enumerate(base):
        if i in kept:
            new_betas.append(1 - a / last)
            last = a
    ac = np.cumprod(1 - np.array(new_betas))
    ac_prev = np.append(1.0, ac[:-1])
    x = noise.double()
    for idx in reversed(range(len(kept))):
        t = torch.full((x.shape[0],), kept[idx], dtype=torch.long)
        eps = eps_fn(x.float(), t).double()
        pred_x0 = math.sqrt(1 / ac[idx]) * x - math.sqrt(1 / ac[idx] - 1) * eps
        eps2 = (math.sqrt(1 / ac[idx]) * x - pred_x0) / math.sqrt(1 / ac[idx] - 1)
        x = pred_x0 * math.sqrt(ac_prev[idx]) + math.sqrt(1 - ac_prev[idx]) * eps2
    return x.float()


@pytest.mark.parametrize("n_steps", [10, 4])
def test_ddim_matches_upstream_respaced_sampler(n_steps):
    torch.manual_seed(0)
    w = torch.randn(7, 7) * 0.3

    def eps_fn(x, t):  # a nonlinear, timestep-dependent stand-in for the network
        return torch.tanh(x @ w) * (1 + t[:, None, None].float() / 100)

    noise = torch.randn(2, 16, 7)
    ours = GaussianDiffusion(DiffusionConfig(sample_steps=n_steps)).ddim_sample(eps_fn, noise)
    torch.testing.assert_close(ours, _upstream_style_ddim(eps_fn, noise, n_steps), atol=1e-4, rtol=1e-4)


def test_ddim_with_oracle_noise_recovers_x0():
    diffusion = GaussianDiffusion(DiffusionConfig(sample_steps=10))
    x0 = torch.rand(3, 16, 7) * 2 - 1
    abar = torch.tensor(diffusion.alphas_cumprod, dtype=torch.float32)

    def oracle(x, t):  # the noise that maps x0 to x_t
        a = abar[t].view(-1, 1, 1)
        return (x - a.sqrt() * x0) / (1 - a).sqrt()

    torch.testing.assert_close(diffusion.ddim_sample(oracle, torch.randn(3, 16, 7)), x0, atol=1e-4, rtol=0)


def test_training_loss_is_zero_for_the_true_noise_and_one_for_zero_prediction():
    diffusion = GaussianDiffusion()
    x0 = torch.rand(64, 16, 7) * 2 - 1
    abar = torch.tensor(diffusion.alphas_cumprod, dtype=torch.float32)

    def oracle(x, t):
        a = abar[t].view(-1, 1, 1)
        return (x - a.sqrt() * x0) / (1 - a).sqrt()

    g = torch.Generator().manual_seed(0)
    assert diffusion.training_loss(oracle, x0, generator=g).item() < 1e-8
    zero = diffusion.training_loss(lambda x, t: torch.zeros_like(x), x0, generator=g).item()
    assert zero == pytest.approx(1.0, abs=0.05)  # E[noise^2] = 1
    with pytest.raises(ValueError, match="eps_fn returned shape"):
        diffusion.training_loss(lambda x, t: x[:, :1], x0)


def test_timestep_embedding_is_cos_first_with_dit_frequencies():
    t = torch.tensor([0, 7, 99])
    emb = timestep_embedding(t, 256)
    k = torch.arange(128, dtype=torch.float32)
    args = t[:, None].float() * torch.exp(-math.log(10000.0) * k / 128)
    torch.testing.assert_close(emb[:, :128], torch.cos(args))
    torch.testing.assert_close(emb[:, 128:], torch.sin(args))
    assert torch.equal(emb[0, :128], torch.ones(128)) and torch.equal(emb[0, 128:], torch.zeros(128))
    assert sorted(k for k, _ in TimestepEmbedder(16).state_dict().items()) == ["mlp.0.bias", "mlp.0.weight", "mlp.2.bias", "mlp.2.weight"]


def test_rtc_weights_are_one_on_frozen_rows_then_decay_exponentially():
    w = rtc_weights(5, frozen=2)
    c = np.array([3, 2, 1]) / 4
    assert w.tolist() == pytest.approx([1.0, 1.0, *(c * np.expm1(c) / math.expm1(1.0))])
    assert np.all(np.diff(w) <= 0) and w[-1] > 0
    assert rtc_weights(3, frozen=7).tolist() == [1.0, 1.0, 1.0] and rtc_weights(0, frozen=0).shape == (0,)


def test_ddim_inpainting_fixes_weight_one_rows_and_leaves_weight_zero_alone():
    diffusion = GaussianDiffusion(DiffusionConfig(sample_steps=5))
    torch.manual_seed(0)
    proj = torch.randn(3, 3)

    def eps_fn(x, t):  # an arbitrary smooth denoiser: the rows interact through the mean over the chunk
        return torch.tanh(x @ proj + x.mean(1, keepdim=True)) * (1 + t[:, None, None] / 100)

    noise = torch.randn(2, 6, 3)
    free = diffusion.ddim_sample(eps_fn, noise)
    target = torch.randn(2, 4, 3)
    fixed = diffusion.ddim_sample(eps_fn, noise, inpaint=Inpaint(target, torch.tensor([1.0, 1.0, 0.5, 0.0])))
    torch.testing.assert_close(fixed[:, :2], target[:, :2])  # weight 1: exactly the known rows
    assert not torch.allclose(fixed[:, 2], free[:, 2]) and not torch.allclose(fixed[:, 2], target[:, 2])
    assert not torch.allclose(fixed[:, 4:], free[:, 4:])  # the free rows are denoised around the known ones
    zero = diffusion.ddim_sample(eps_fn, noise, inpaint=Inpaint(target, torch.zeros(4)))
    torch.testing.assert_close(zero, free)  # weight 0 everywhere: the plain sample
    with pytest.raises(ValueError, match="inpaint target has 7 rows and weight \\(7,\\); the sample has 6 rows"):
        diffusion.ddim_sample(eps_fn, noise, inpaint=Inpaint(torch.zeros(2, 7, 3), torch.zeros(7)))
