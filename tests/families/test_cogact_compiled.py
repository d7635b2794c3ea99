"""``SessionConfig.compile`` for CogACT: vision, the decoder's layer pass and the DiT compiled. The compiled session
samples the eager session's chunks (same seed, so the same noise) up to float rounding, with every graph compiled
while the session is created; the families that run eager only say so."""

from dataclasses import replace

import numpy as np
import pytest
from torch._dynamo.utils import counters

from vla_runtime.api import Observation, load_policy
from vla_runtime.config import CompileMode, SessionConfig
from vla_runtime.kv import KVConfig
from vla_runtime.policies.compiled import CompiledDiT

INSTRUCTION = "Put the eggplant in the basket"


@pytest.fixture(scope="module")
def policy(tiny_cogact):
    return load_policy(tiny_cogact)


@pytest.mark.slow  # inductor compiles vision, two layer passes and the DiT: ~1 min per case on 2 cores
@pytest.mark.parametrize(("kv", "history"), [("full", "single"), ("chunked", "history")])
def test_compiled_cogact_samples_the_eager_chunks_and_compiles_nothing_after_creation(policy, frame, kv, history):
    config = SessionConfig(kv=KVConfig(mode=kv), history=history, seed=3)
    eager = policy.new_session(INSTRUCTION, config)
    compiled = policy.new_session(INSTRUCTION, replace(config, compile=CompileMode.DEFAULT))
    assert isinstance(compiled.denoiser, CompiledDiT) and compiled._skip_guards
    assert compiled.cache.stats().tokens_seen == 0  # the warm-up's steps were reset away
    before = counters["stats"]["unique_graphs"]
    for i in range(6):
        obs = Observation(images={"primary": frame(i)})
        want, got = eager.step(obs), compiled.step(obs)  # the same noise: reset re-seeded the generator
        np.testing.assert_allclose(got.actions, want.actions, rtol=0, atol=1e-4)
        assert got.kv == want.kv
    if kv == "chunked":
        assert compiled.cache.chunks_formed > 0, "no compression: the check would not cover one"
    assert counters["stats"]["unique_graphs"] == before, "a graph was compiled in a control step"


def test_an_eager_only_family_names_the_ones_that_compile(tiny_hybridvla):
    hybrid = load_policy(tiny_hybridvla)
    with pytest.raises(ValueError, match="HybridVLASession runs eager only.*OpenVLA, CogACT.*'off'"):
        hybrid.new_session("pick up the cup", SessionConfig(compile=CompileMode.DEFAULT))
