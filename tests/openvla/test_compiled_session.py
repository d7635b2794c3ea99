"""``SessionConfig.compile``: a compiled OpenVLA session decodes the same action tokens as an eager one (actions
equal up to float rounding), with every graph compiled while the session is created (its warm-up), none in
its control steps; misuse fails with a message naming what to use instead."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from vla_runtime.api import Observation, load_policy
from vla_runtime.config import CompileMode, SessionConfig
from vla_runtime.kv import KVConfig

INSTRUCTION = "put the red cube in the blue bowl"


@pytest.fixture(scope="module")
def policy(tiny_openvla):
    return load_policy(tiny_openvla, device="cpu")


@pytest.fixture
def fresh_dynamo():
    """Forgets the graphs compiled earlier in this process. A torch older than the pin (the GPU image's 2.11) lacks
    ``recompile_limit`` per ``torch.compile`` call: the limit (8) counts every compile of a code object in the
    process, and the cases before would use it up (seen on an H200: the chunked reduce-overhead case hit it)."""
    torch._dynamo.reset()


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # inductor compiles for 30-60 s per case on 2 cores (less once its on-disk cache holds the graphs)
# the stock step, and the chunked cache over a frames-only episode (the memory policies' mode: pinned prompt, growing
# history, compressions, the action tokens decoded under a mark); the other pairings compile the same graphs at
# other lengths (~50 s more each of CI's budget; `history: history` with the chunked cache is the test below)
@pytest.mark.parametrize(("kv", "history"), [("full", "single"), ("chunked", "observations")])
def test_compiled_session_decodes_the_eager_tokens_and_compiles_nothing_after_creation(policy, frame, kv, history):
    config = SessionConfig(kv=KVConfig(mode=kv), history=history)
    eager = policy.new_session(INSTRUCTION, config)
    compiled = policy.new_session(INSTRUCTION, replace(config, compile=CompileMode.DEFAULT))
    assert compiled.cache.stats().tokens_seen == 0  # the warm-up's steps were reset away
    before = graphs_compiled()
    assert compiled._skip_guards, "the default skips the guards that do not pick a graph after the warm-up"
    # an action's tokens are one compiled call (``CompiledTokenLoop``), which the warm-up compiled: the full cache's
    # decode takes it from the first step, the chunked cache's under its mark after its first compression
    assert compiled._loop_ran
    for i in range(8):  # history mode: past the chunked cache's first compressions; then a new, longer instruction
        if i == 6:
            eager.reset("open the top drawer and put the bowl inside it")
            compiled.reset("open the top drawer and put the bowl inside it")
        obs = Observation(images={"primary": frame(i)})
        want, got = eager.step(obs), compiled.step(obs)
        np.testing.assert_array_equal(compiled.last_tokens, eager.last_tokens)
        np.testing.assert_allclose(got.actions, want.actions, rtol=0, atol=1e-6)
        assert got.kv == want.kv
        if i == 5 and kv == "chunked":
            assert got.kv.chunks_retained > 0, "the episode should reach the chunked cache's compressions"
    assert graphs_compiled() == before, "a control step compiled: the warm-up at session creation missed a graph"


@pytest.mark.slow  # shares the chunked graphs compiled above when run after it; 30-60 s alone
def test_a_compiled_session_whose_keys_pass_256_positions_compiles_nothing(policy, frame):
    """A raw window long enough that the held keys pass 256 positions within 10 steps (the warm-up's three reach 99).
    A RoPE table grown on demand there becomes a larger tensor, a new graph input: the step recompiled, which with the
    guards skipped raises. Seen in closed loop with the memory policy at its 51st step (2026-11-30)."""
    config = SessionConfig(kv=KVConfig.from_dict({"mode": "chunked", "window": 512}), history="history")
    eager = policy.new_session(INSTRUCTION, config)
    compiled = policy.new_session(INSTRUCTION, replace(config, compile=CompileMode.DEFAULT))
    assert not compiled._loop_ran  # without a mark a chunked decode never takes the token loop: one call per token
    before = graphs_compiled()
    for i in range(10):
        obs = Observation(images={"primary": frame(i)})
        want, got = eager.step(obs), compiled.step(obs)
        np.testing.assert_array_equal(compiled.last_tokens, eager.last_tokens)
    assert got.kv.positions_used > 256 and got.kv == want.kv
    assert graphs_compiled() == before


@pytest.mark.slow  # the chunked graphs above, traced again (inductor's on-disk cache holds them): ~20 s
def test_a_wide_window_warms_up_until_the_token_loop_compiled(policy, frame):
    """A raw window of 512 tokens first compresses after about 20 steps, long after the 3 warm-up steps: the warm-up
    goes on (blank frames) until a decode took the token loop, so its graph is compiled at creation too."""
    config = SessionConfig(kv=KVConfig.from_dict({"mode": "chunked", "window": 512}), history="observations")
    eager = policy.new_session(INSTRUCTION, config)
    compiled = policy.new_session(INSTRUCTION, replace(config, compile=CompileMode.DEFAULT))
    assert compiled._loop_ran and compiled.cache.stats().tokens_seen == 0
    before = graphs_compiled()
    for i in range(3):
        obs = Observation(images={"primary": frame(i)})
        eager.step(obs), compiled.step(obs)
        np.testing.assert_array_equal(compiled.last_tokens, eager.last_tokens)
    assert graphs_compiled() == before


def test_compile_guards_keeps_every_guard_after_the_warm_up(policy, frame):
    """``compile_guards=True``: steps run with all of dynamo's guards (no skip), and decode the eager tokens."""
    eager = policy.new_session(INSTRUCTION)
    compiled = policy.new_session(INSTRUCTION, SessionConfig(compile=CompileMode.DEFAULT, compile_guards=True))
    assert not compiled._skip_guards
    obs = Observation(images={"primary": frame(0)})
    eager.step(obs), compiled.step(obs)
    np.testing.assert_array_equal(compiled.last_tokens, eager.last_tokens)


@pytest.mark.parametrize("kv", ["full", "chunked", "chunked-mass"])
def test_a_planned_decode_forward_is_one_graph_and_equals_eager(policy, frame, kv):
    """Capturability without inductor (``backend="eager"``, quick): after the cache has planned the forward, the
    layer pass of a one-token decode traces with ``fullgraph=True`` (a graph break raises) in an episode that
    already pinned its prompt and compressed chunks, and the captured graph computes eager's numbers exactly
    (``chunked-mass``: with ``chunk_mass``'s per-key score bias)."""
    cfg = KVConfig.from_dict({"mode": "chunked", "chunk_mass": True}) if kv == "chunked-mass" else KVConfig(mode=kv)
    session = policy.new_session(INSTRUCTION, SessionConfig(kv=cfg, history="history"))
    for i in range(3):
        session.step(Observation(images={"primary": frame(i)}))
    if kv.startswith("chunked"):
        assert session.cache.stats().chunks_retained > 0
    decoder, cache = policy.vlm.language_model.model, session.cache
    captured = torch.compile(decoder.layers_forward, fullgraph=True, backend="eager", dynamic=True)
    token = torch.tensor([[31800]])
    with torch.inference_mode():
        mark = cache.mark()
        want = decoder(token, cache=cache)
        cache.rollback(mark)
        cache.plan_forward(1)
        got = captured(token, cache=cache)
        cache.end_forward()
        cache.rollback(mark)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reduce_overhead_off_cuda_names_the_mode_to_use(policy):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device.*use 'default'"):
        policy.new_session(INSTRUCTION, SessionConfig(compile="reduce-overhead"))


def test_only_sessions_replaying_cuda_graphs_get_static_full_and_chunked_caches(policy):
    """``REDUCE_OVERHEAD`` (CUDA graphs) with a full or chunked cache: static shapes (``tests/kv/test_full_static.py``,
    ``tests/kv/test_chunked_static.py``), so a history episode records one graph per forward length; other modes
    keep dynamic shapes, and so does the sink window."""
    chunked = KVConfig.from_dict({"mode": "chunked", "window": 64})
    for kv in (KVConfig(), chunked):
        assert policy.new_cache(kv, CompileMode.REDUCE_OVERHEAD).static_shapes is True
        assert policy.new_cache(kv, CompileMode.DEFAULT).static_shapes is False
    window = KVConfig.from_dict({"mode": "sink_window", "window": 64})
    assert not hasattr(policy.new_cache(window, CompileMode.REDUCE_OVERHEAD), "static_shapes")


def test_an_unknown_compile_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="`compile` is 'max'; expected one of off, default, reduce-overhead"):
        SessionConfig(compile="max")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compiled_cuda_step_never_waits_for_the_host(tiny_openvla, frame, fresh_dynamo):
    """CUDA graphs, full cache, single mode: after the warm-up (which recorded this step's lengths), the vision
    towers, the step's prefill and decode forwards run without a host synchronisation (``set_sync_debug_mode
    ("error")`` raises on one), and inductor used CUDA graphs for every compiled graph (none skipped: the cache's
    K/V buffers, which the graphs write, are static addresses). Not run in CI here (no CUDA)."""
    gpu = load_policy(tiny_openvla, device="cuda")
    skipped = counters["inductor"]["cudagraph_skips"]
    session = gpu.new_session(INSTRUCTION, SessionConfig(compile=CompileMode.REDUCE_OVERHEAD))
    assert counters["inductor"]["cudagraph_skips"] == skipped, "inductor skipped CUDA graphs (see its warning)"
    session.step(Observation(images={"primary": frame(0)}))
    pixels, _ = session.inputs(Observation(images={"primary": frame(1)}))
    token = torch.tensor([[31800]], device="cuda")
    with torch.inference_mode():  # the prompt's ids go to the device here (a host copy), before the check
        embeds = session.context(session.modules.embed_image(pixels), [], {})  # resets the cache (single mode)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            session.modules.embed_image(pixels)
            session.modules.decoder(inputs_embeds=embeds, cache=session.cache)
            for _ in range(3):
                session.modules.decoder(token, cache=session.cache)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert session.cache.stats().tokens_seen > 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", [CompileMode.DEFAULT, CompileMode.REDUCE_OVERHEAD])
def test_a_compiled_chunked_forward_never_waits_for_the_host(tiny_openvla, frame, mode, fresh_dynamo):
    """The chunked cache in history mode, past its first compressions: the cache's plan and the compiled layer
    pass of a frame's prefill and of decode forwards run without a host synchronisation; only the commit after a
    forward (``end_forward``: compression, the gate's data-dependent admission) may wait, outside the check.
    Not run in CI here (no CUDA)."""
    gpu = load_policy(tiny_openvla, device="cuda")
    session = gpu.new_session(INSTRUCTION, SessionConfig(kv=KVConfig(mode="chunked"), history="history", compile=mode))
    for i in range(4):
        session.step(Observation(images={"primary": frame(i)}))
    assert session.cache.chunks_formed > 0, "no compression yet: the check would not cover one"
    pixels, _ = session.inputs(Observation(images={"primary": frame(4)}))
    token = torch.tensor([[31800]], device="cuda")
    cache, layers = session.cache, session.modules.decoder.layers
    with torch.inference_mode():
        embeds = session.context(session.modules.embed_image(pixels), [], {})
    for ids, x in [(None, embeds), *[(token, None)] * 3]:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                cache.plan_forward((ids if x is None else x).shape[1])
                layers(ids, x, cache=cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        cache.end_forward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("kv", "fuse"), [({"mode": "full"}, False), ({"mode": "chunked", "window": 16, "chunk": 8}, False),
                                        ({"mode": "full"}, True)], ids=["full", "chunked", "full-fused"])
def test_a_cuda_graphed_history_episode_acts_as_eager(tiny_openvla, frame, kv, fuse, fresh_dynamo):
    """CUDA graphs over a static cache (history mode: the held length grows every step and the chunked cache
    compresses, the graphs' shapes do not): the same tokens as an eager session, float32 on the GPU, over steps
    past the warm-up's lengths, no graph compiled after creation (``full-fused``: the fused projections of
    ``--fuse``, both sessions). Not run in CI here (no CUDA)."""
    gpu = load_policy(tiny_openvla, device="cuda", dtype="float32", fuse=fuse)
    config = SessionConfig(history="history", kv=KVConfig.from_dict(kv))
    eager = gpu.new_session(INSTRUCTION, config)
    graphed = gpu.new_session(INSTRUCTION, replace(config, compile=CompileMode.REDUCE_OVERHEAD))
    assert graphed.cache.static_shapes
    before = graphs_compiled()
    for i in range(8):
        obs = Observation(images={"primary": frame(i)})
        want, got = eager.step(obs), graphed.step(obs)
        np.testing.assert_array_equal(graphed.last_tokens, eager.last_tokens)
        np.testing.assert_allclose(got.actions, want.actions, atol=1e-6)
    assert graphs_compiled() == before, "a graph was compiled in a control step"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("kv", "history"), [("full", "single"), ("chunked", "observations")])
def test_the_token_loop_on_cuda_decodes_the_eager_tokens(tiny_openvla, frame, kv, history, fresh_dynamo):
    """The `default` mode's one compiled call per action (``CompiledTokenLoop``) on a GPU, float32: the stock step
    and the memory policies' mode take the loop and decode an eager GPU session's tokens, compiling nothing after
    creation. Not run in CI here (no CUDA)."""
    gpu = load_policy(tiny_openvla, device="cuda", dtype="float32")
    config = SessionConfig(kv=KVConfig(mode=kv), history=history)
    eager = gpu.new_session(INSTRUCTION, config)
    compiled = gpu.new_session(INSTRUCTION, replace(config, compile=CompileMode.DEFAULT))
    assert compiled._loop_ran
    before = graphs_compiled()
    for i in range(8):
        obs = Observation(images={"primary": frame(i)})
        want, got = eager.step(obs), compiled.step(obs)
        np.testing.assert_array_equal(compiled.last_tokens, eager.last_tokens)
        np.testing.assert_allclose(got.actions, want.actions, rtol=0, atol=1e-5)
    assert graphs_compiled() == before, "a control step compiled: the warm-up at session creation missed a graph"
