"""HybridVLA inside the LLM: prefix-KV-reusing DDIM equals re-prefilling for any window; AR decode equals a full forward."""

import pytest
import torch

from vla_runtime.kv import FullCache, FullParams
from vla_runtime.models.diffusion import DiffusionConfig, GaussianDiffusion
from vla_runtime.models.hybridvla.configuration_hybridvla import EOD_TOKEN_ID, DiffusionHeadConfig
from vla_runtime.models.hybridvla.modeling_hybridvla import (
    DiffusionHead,
    decode_ar_actions,
    denoise_by_reprefill,
    denoise_on_cache,
)
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM

LLM_CFG = LlamaConfig.from_name("tiny")


def build(future_window: int, seed: int = 0):
    torch.manual_seed(seed)
    lm = LlamaForCausalLM(LLM_CFG).eval()
    head = DiffusionHead(DiffusionHeadConfig(dim=LLM_CFG.dim, future_window=future_window)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prefix = torch.randn(1, 24, LLM_CFG.dim)
    return lm, head, prefix


@pytest.mark.parametrize("future_window", [0, 3, 15])
@pytest.mark.parametrize("fused", [False, True], ids=["prefilled", "fused-first-step"])
def test_prefix_reuse_equals_reprefill(future_window, fused):
    lm, head, prefix = build(future_window)
    diffusion = GaussianDiffusion(DiffusionConfig(sample_steps=4))
    noise = torch.randn(1, future_window + 1, 7, generator=torch.Generator().manual_seed(1))
    cache = FullCache(LLM_CFG.geometry, FullParams(capacity=128))
    if fused:  # the prefix goes in with the first step's [t, x]
        reused = denoise_on_cache(lm, head, cache, diffusion, noise, prefix=prefix)
    else:
        lm.model(inputs_embeds=prefix, cache=cache)
        reused = denoise_on_cache(lm, head, cache, diffusion, noise)
    assert cache.mark() == prefix.shape[1]  # every step's [t, x] was rolled back, the prefix stayed
    reference = denoise_by_reprefill(lm, head, FullCache(LLM_CFG.geometry, FullParams(capacity=128)), diffusion, noise, prefix)
    torch.testing.assert_close(reused, reference, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(reused, noise, atol=1e-3)


def test_upstream_fixed_trim_is_wrong_for_a_longer_window():
    """Trimming 2 tokens per step (upstream's ``[:-2]``) leaves stale noisy-action keys when future_window > 0."""
    lm, head, prefix = build(3)
    diffusion = GaussianDiffusion(DiffusionConfig(sample_steps=4))
    noise = torch.randn(1, 4, 7, generator=torch.Generator().manual_seed(1))
    cache = FullCache(LLM_CFG.geometry, FullParams(capacity=256))
    lm.model(inputs_embeds=prefix, cache=cache)
    steps = []

    def eps_fn(x, t):  # upstream: first step appends [t, x]; later steps trim 2 and append again
        if steps:
            cache.rollback(cache.mark() - 2)
        steps.append(t)
        h = lm.model(inputs_embeds=head.embed_step(x, t), cache=cache)
        return head.eps(h[:, 1:])

    fixed_trim = diffusion.ddim_sample(eps_fn, noise)
    reference = denoise_by_reprefill(lm, head, FullCache(LLM_CFG.geometry, FullParams(capacity=128)), diffusion, noise, prefix)
    assert not torch.allclose(fixed_trim, reference, atol=1e-4)


def test_ar_decode_matches_one_full_forward():
    lm, head, prefix = build(0)
    cache = FullCache(LLM_CFG.geometry, FullParams(capacity=128))
    lm.model(inputs_embeds=prefix, cache=cache)
    noise, t = torch.randn(1, 1, 7), torch.tensor([37])
    ids, conf = decode_ar_actions(lm, head, cache, noise=noise, t=t, tail_ids=(EOD_TOKEN_ID, 29871), n_tokens=7)
    assert ids.shape == conf.shape == (1, 7)
    tail = lm.model.embed_tokens(torch.tensor([[EOD_TOKEN_ID, 29871]]))
    with torch.no_grad():
        full = torch.cat([prefix, head.embed_step(noise, t), tail, lm.model.embed_tokens(ids[:, :-1])], dim=1)
        logits = lm(inputs_embeds=full, cache=FullCache(LLM_CFG.geometry, FullParams(capacity=128)))[:, -7:]
    assert torch.equal(logits.argmax(-1), ids)
    torch.testing.assert_close(logits.softmax(-1).amax(-1), conf, atol=1e-5, rtol=1e-4)
