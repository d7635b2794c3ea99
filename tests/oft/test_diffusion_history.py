"""The diffusion variant in history mode: streaming control steps through a cache, each running a DDIM loop of
query blocks, equals a flat explicit-mask loop written here (prompt and observations causal; every DDIM step a
fresh block ``[timestep] + "\\nOut:" + 29871 + projected noisy entries + </s>`` that sees everything and itself
both ways; the eps -> x update by hand), for the full cache; leaving the timestep token out or a causal block
gives other chunks; no query token stays in the cache. The cache matrix (caches that evict nothing, budgets) runs
for both variants in ``test_history``."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_runtime.api import load_policy
from vla_runtime.config import SessionConfig
from vla_runtime.kv import KVConfig

from oft_reference import head_actions, llama_hidden, proprio_token, strip_ddp
from test_oft_diffusion import ddim_alphas_cumprod
from test_history import INSTRUCTION, STOP_ID, flat_mask, observations

STEPS, SEED = 2, 4  # DDIM steps per chunk, the sessions' seed


@pytest.fixture(scope="module")
def policy(oft_diffusion):
    return load_policy(oft_diffusion, device="cpu", dtype="float32", diffusion_steps=STEPS)


def session_noise(n):
    """The first ``n`` draws of a session seeded with SEED: one [1, K, A] per control step."""
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randn((1, 8, 7), generator=generator) for _ in range(n)]


def reference(policy, path, session, obs, noise, *, timestep=True, causal=False):
    """Normalised chunk [K, A] (float64) of the last of ``obs``: the kept tokens ``[BOS] + prompt | images_1 +
    proprio_1 | ... | images_n + proprio_n`` and per DDIM step one explicit-LLaMA forward over them + the query
    block, then upstream's DDIM update (leading spacing, x0 clipped, alpha_prev = 1 past t = 0). noise:
    [1, K, A]. ``timestep=False`` / ``causal=True``: wrong variants (no timestep token; a causal block)."""
    model, cfg = policy.model, policy.config
    lm = model.vla.language_model.state_dict()
    emb = lm["model.embed_tokens.weight"].double()
    prompt = policy.tokenizer.prompt(INSTRUCTION)
    load = lambda name: strip_ddp(torch.load(next(path.glob(f"{name}--*checkpoint.pt")), weights_only=True))  # noqa: E731
    head = {k.replace("noise_predictor.mlp_resnet.", "model."): v for k, v in load("action_head").items()}
    noisy, projector = load("noisy_action_projector"), load("proprio_projector")
    text = lambda ids: emb[torch.tensor(ids)][None]  # noqa: E731  [1, n, dim]
    parts = [text([prompt.bos, *prompt.instruction])]
    with torch.no_grad():
        for o in obs:
            patches = model.vla.embed_image(policy.image_processor(o.images["primary"])[None]).double()
            state = torch.as_tensor(session.proprio_stats.normalize(o.state))
            parts.append(torch.cat([patches, proprio_token(projector, state)], dim=1))
    kept = torch.cat(parts, dim=1)
    dim, k, a = emb.shape[1], cfg.chunk_size, cfg.action_dim
    alphas, ratio = ddim_alphas_cumprod(50), 50 // STEPS
    x = noise.double().reshape(k, a)
    for t in (np.arange(STEPS) * ratio)[::-1]:
        half = dim // 2
        args = float(t) * torch.exp(torch.arange(half, dtype=torch.float64) * -math.log(10000) / (half - 1))
        temb = torch.cat((args.sin(), args.cos()))[None, None]  # [1, 1, dim]
        feats = F.gelu(x.reshape(-1, 1) @ noisy["fc1.weight"].T + noisy["fc1.bias"]) @ noisy["fc2.weight"].T + noisy["fc2.bias"]
        query = torch.cat([temb] * timestep + [text([*prompt.out, prompt.empty]), feats[None], text([STOP_ID])], dim=1)
        seq = torch.cat([kept, query], dim=1)
        mask = flat_mask(kept.shape[1], query.shape[1])
        if causal:
            mask = torch.triu(torch.full(mask.shape, float("-inf")), diagonal=1)
        hidden = llama_hidden(lm, model.vla.cfg.llm, seq, mask)
        first = kept.shape[1] + timestep + len(prompt.out) + 1  # first noisy-action position; the head reads from one before
        eps = head_actions(head, hidden[:, first - 1 : first - 1 + k * a], k)  # [K, A]
        a_t = alphas[t]
        a_prev = alphas[t - ratio] if t - ratio >= 0 else torch.tensor(1.0, dtype=torch.float64)
        x0 = ((x - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-1, 1)
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return x


def run(policy, obs, kv):
    session = policy.new_session(INSTRUCTION, SessionConfig(history="history", kv=kv, seed=SEED))
    return session, [session.step(o) for o in obs]


def test_full_cache_streaming_equals_the_flat_masked_loop(policy, oft_diffusion, frame):
    obs, noise = observations(frame, 3), session_noise(3)
    session, results = run(policy, obs, KVConfig.of("full"))
    robot = lambda x: session.action_stats.unnormalize(x.numpy())  # noqa: E731
    for n in (1, 3):
        expected = robot(reference(policy, oft_diffusion, session, obs[:n], noise[n - 1]))
        np.testing.assert_allclose(results[n - 1].actions, expected, atol=1e-4, rtol=1e-4, err_msg=f"step {n}")
    # the comparison tells the layout apart: no timestep token, or a causal block, gives other chunks
    for wrong in ({"timestep": False}, {"causal": True}):
        other = robot(reference(policy, oft_diffusion, session, obs, noise[2], **wrong))
        assert np.abs(other - results[2].actions).max() > 1e-3, wrong
    # the cache holds the prompt and three observations (16 image tokens + proprio each), no query tokens
    held = 1 + len(policy.tokenizer.prompt(INSTRUCTION).instruction) + 3 * (16 + 1)
    assert results[2].kv.tokens_seen == held and results[2].kv.tokens_raw == held
    session.reset()  # re-seeds and forgets the history
    np.testing.assert_allclose(session.step(obs[0]).actions, results[0].actions, atol=1e-6)
