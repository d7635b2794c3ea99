"""OFT history mode: streaming N steps through a cache equals one forward over the flat sequence with the mask
written here (prompt and observations causal; the last step's query block sees everything, both ways), for the
full cache; the query block never stays in the cache. For both variants (the L1 head and the diffusion head,
whose exact streaming test is ``test_diffusion_history``): sink-window and chunked caches that evict nothing
give the full cache's chunks; the chunked and sink-window caches keep their budgets over a long episode."""

import numpy as np
import pytest
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.config import SessionConfig
from vla_runtime.kv import KVConfig

from oft_reference import head_actions, llama_hidden, proprio_token, strip_ddp

INSTRUCTION = "put the bowl on the plate"
STOP_ID = 2


@pytest.fixture(scope="module")
def libero(oft_libero):
    return load_policy(oft_libero, device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=["l1", "diffusion"])
def variant(request):
    """Each OFT variant's policy: the L1 head (``libero``), the diffusion head at 2 DDIM steps per chunk."""
    if request.param == "l1":
        return request.getfixturevalue("libero")
    return load_policy(request.getfixturevalue("oft_diffusion"), device="cpu", dtype="float32", diffusion_steps=2)


def observations(frame, n):
    rng = np.random.default_rng(7)
    return [Observation(images={"primary": frame(10 + i)}, state=rng.uniform(-0.5, 0.5, 8)) for i in range(n)]


def flat_mask(kept: int, query: int) -> torch.Tensor:
    """Additive [T, T] mask, T = kept + query: rows of the kept tokens (pinned prompt and every observation) are
    causal; the query block's rows see every token, the block's own both ways."""
    t = kept + query
    mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
    mask[kept:] = 0.0
    return mask


def reference_history(policy, path, session, obs, *, keep_queries=False, causal_query=False):
    """Normalised chunk [K, A] (float64) of the last of ``obs`` from one explicit-LLaMA forward over the flat
    sequence ``[BOS] + prompt | images_1 + proprio_1 | ... | images_n + proprio_n | "\\nOut:" 29871 zeros </s>``.
    ``keep_queries``/``causal_query``: wrong variants (earlier steps' query blocks left in; a causal query)."""
    model, cfg = policy.model, policy.config
    lm_state = model.vla.language_model.state_dict()
    emb = lm_state["model.embed_tokens.weight"].double()
    prompt = policy.tokenizer.prompt(INSTRUCTION)
    head = strip_ddp(torch.load(next(path.glob("action_head--*checkpoint.pt")), weights_only=True))
    projector = strip_ddp(torch.load(next(path.glob("proprio_projector--*checkpoint.pt")), weights_only=True))
    text = lambda ids: emb[torch.tensor(ids)][None]  # noqa: E731  [1, n, dim]
    query = torch.cat([text([*prompt.out, prompt.empty]), torch.zeros(1, cfg.action_tokens, emb.shape[1], dtype=torch.float64),
                       text([STOP_ID])], dim=1)  # fmt: skip
    parts = [text([prompt.bos, *prompt.instruction])]
    with torch.no_grad():
        for i, o in enumerate(obs):
            patches = model.vla.embed_image(policy.image_processor(o.images["primary"])[None]).double()
            state = torch.as_tensor(session.proprio_stats.normalize(o.state))
            parts.append(torch.cat([patches, proprio_token(projector, state)], dim=1))
            if keep_queries and i < len(obs) - 1:
                parts.append(query)
    kept = torch.cat(parts, dim=1)
    seq = torch.cat([kept, query], dim=1)
    mask = flat_mask(kept.shape[1], query.shape[1])
    if causal_query:
        mask = torch.triu(torch.full(mask.shape, float("-inf")), diagonal=1)
    hidden = llama_hidden(lm_state, model.vla.cfg.llm, seq, mask)
    first = kept.shape[1] + len(prompt.out) + 1  # first action position; the head reads from one before
    return head_actions(head, hidden[:, first - 1 : first - 1 + cfg.action_tokens], cfg.chunk_size)


def run(policy, obs, kv):
    session = policy.new_session(INSTRUCTION, SessionConfig(history="history", kv=kv))
    return session, [session.step(o) for o in obs]


def test_full_cache_streaming_equals_the_flat_masked_forward(libero, oft_libero, frame):
    obs = observations(frame, 3)
    session, results = run(libero, obs, KVConfig.of("full"))
    for n in (1, 3):
        normalized = reference_history(libero, oft_libero, session, obs[:n]).numpy()
        np.testing.assert_allclose(results[n - 1].actions, session.action_stats.unnormalize(normalized), atol=1e-4, rtol=1e-4)
    # the test tells the layout apart: leaving earlier query blocks in, or a causal query, gives other chunks
    for wrong in ({"keep_queries": True}, {"causal_query": True}):
        other = session.action_stats.unnormalize(reference_history(libero, oft_libero, session, obs, **wrong).numpy())
        assert np.abs(other - results[2].actions).max() > 1e-2, wrong
    # the cache holds the prompt and three observations (16 image tokens + proprio each), no query tokens
    prompt = libero.tokenizer.prompt(INSTRUCTION)
    assert results[2].kv.tokens_seen == 1 + len(prompt.instruction) + 3 * (16 + 1)
    session.reset()
    again = session.step(obs[0])
    np.testing.assert_allclose(again.actions, results[0].actions, atol=1e-6)


def test_caches_that_evict_nothing_equal_the_full_cache(variant, frame):
    obs = observations(frame, 3)
    _, full = run(variant, obs, KVConfig.of("full"))
    for kv in (KVConfig.of("sink_window", window=400), KVConfig.of("chunked", window=400, chunk=8, max_chunks=4)):
        _, other = run(variant, obs, kv)
        for a, b in zip(full, other):
            np.testing.assert_allclose(b.actions, a.actions, atol=1e-4, rtol=1e-4, err_msg=kv.mode.value)
        assert other[-1].kv.tokens_raw == full[-1].kv.tokens_raw


def test_chunked_and_sink_window_keep_their_budgets(variant, frame):
    """10 steps of 17 kept tokens: the caches evict, hold what their budgets allow and still give finite chunks."""
    obs = observations(frame, 10)
    prompt_tokens = 1 + len(variant.tokenizer.prompt(INSTRUCTION).instruction)
    window, chunk, max_chunks = 20, 8, 3
    session, results = run(variant, obs, KVConfig.of("chunked", window=window, chunk=chunk, max_chunks=max_chunks))
    for r in results:
        assert np.isfinite(r.actions).all() and r.actions.shape == (8, 7)
        assert r.kv.tokens_raw <= prompt_tokens + window + chunk - 1
        assert r.kv.tokens_compressed <= max_chunks
    last = results[-1].kv
    assert last.tokens_seen == prompt_tokens + 10 * 17 and last.chunks_dropped > 0
    assert all(n <= max_chunks for n in session.cache.retained_per_layer())
    _, sink = run(variant, obs, KVConfig.of("sink_window", window=window, n_sink=4))
    assert all(r.kv.tokens_raw <= prompt_tokens + 4 + window for r in sink)
    assert sink[-1].kv.tokens_seen == prompt_tokens + 10 * 17
