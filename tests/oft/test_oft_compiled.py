"""``SessionConfig.compile`` for OpenVLA-OFT: the vision (two cameras), every LLM forward (single mode's bidirectional
passes, history mode's pinned prompt, kept observations and query blocks) and the L1 head compiled. A compiled
session acts as an eager one with the same seed, up to float rounding, with every graph compiled while the session
is created, for the L1 and the diffusion variants."""

from dataclasses import replace

import numpy as np
import pytest
from torch._dynamo.utils import counters

from vla_runtime.api import Observation, load_policy
from vla_runtime.config import CompileMode, SessionConfig
from vla_runtime.kv import KVConfig
from vla_runtime.models.llama import LlamaModel
from vla_runtime.policies.compiled import CompiledDecoder

INSTRUCTION = "put the bowl on the plate"


@pytest.mark.slow  # inductor compiles vision, the LLM's passes and the head: ~30 s per case on 2 cores
@pytest.mark.parametrize(("variant", "kv", "history"), [
    ("oft_libero", "full", "single"), ("oft_libero", "chunked", "history"),
    ("oft_diffusion", "full", "single"), ("oft_diffusion", "full", "history"),
])  # fmt: skip
def test_compiled_oft_acts_as_eager_and_compiles_nothing_after_creation(
    request, frame, variant, kv, history, monkeypatch
):
    # 2 DDIM steps: this random tiny model's denoising multiplies a difference by ~3 per step (float rounding of
    # 1e-6 in one forward is 7e-5 after 5 steps, 0.07 after upstream's 50; measured), so 50 would test chaos
    steps = {"diffusion_steps": 2} if variant == "oft_diffusion" else {}
    path = request.getfixturevalue(variant)
    policy = load_policy(path, device="cpu", dtype="float32", cameras=("primary", "wrist"), **steps)
    config = SessionConfig(kv=KVConfig(mode=kv), history=history, seed=4)
    eager = policy.new_session(INSTRUCTION, config)
    compiled = policy.new_session(INSTRUCTION, replace(config, compile=CompileMode.DEFAULT))
    assert compiled._skip_guards and isinstance(compiled.modules.decoder, CompiledDecoder)
    before = counters["stats"]["unique_graphs"]
    state = np.linspace(-0.5, 0.5, policy.config.proprio_dim)
    for i in range(6):
        if i == 4:  # a new, longer instruction mid-episode: a new prompt (and cache), no new graph
            if kv == "chunked":
                assert compiled.cache.chunks_formed > 0, "no compression: the check would not cover one"
            for session in (eager, compiled):
                session.reset("put the bowl on the plate and then push the plate to the left")
        obs = Observation(images={"primary": frame(i), "wrist": frame(10 + i, (40, 40, 3))}, state=state)
        want, got = eager.step(obs), compiled.step(obs)
        np.testing.assert_allclose(got.actions, want.actions, rtol=0, atol=1e-4)
        assert got.kv == want.kv
    assert counters["stats"]["unique_graphs"] == before, "a graph was compiled in a control step"
    eager_forwards = []
    monkeypatch.setattr(LlamaModel, "forward", lambda *a, **k: eager_forwards.append(1) or pytest.fail("eager LLM forward"))
    compiled.step(obs)  # every LLM forward of a compiled step is a compiled one
