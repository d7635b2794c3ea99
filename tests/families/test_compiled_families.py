"""``SessionConfig.compile`` for the action-head families. CogACT: vision, the decoder's layer pass and the DiT
compiled; HybridVLA: vision and every LLM forward of its step (prefill, DDIM steps, AR decode). A compiled session
samples the eager session's chunks (same seed, so the same noise) up to float rounding, with every graph compiled
while the session is created; a session that does not compile says which families do."""

from dataclasses import replace

import numpy as np
import pytest
from torch._dynamo.utils import counters

from vla_runtime.api import Observation, load_policy
from vla_runtime.policies.base import EpisodeSession
from vla_runtime.config import CompileMode, SessionConfig
from vla_runtime.kv import KVConfig, KVMode
from vla_runtime.models.llama import LlamaModel
from vla_runtime.policies.compiled import CompiledDecoder, CompiledDiT

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
    observations = [Observation(images={"primary": frame(i)}) for i in range(6)]
    side_by_side(eager, compiled, observations, "Put the eggplant in the basket, then close the lid of the basket")


@pytest.mark.slow  # ~1 min per case on 2 cores
@pytest.mark.parametrize(("kv", "history"), [("full", "single"), ("chunked", "history")])
def test_compiled_hybridvla_acts_as_eager_and_compiles_nothing_after_creation(
    tiny_hybridvla, frame, kv, history, monkeypatch
):
    """Both branches (diffusion chunk and AR tokens, ensembled): the AR tokens are identical, the actions equal up
    to float rounding, and every LLM forward of a compiled step (prefill, DDIM steps, AR tokens) is a compiled one."""
    hybrid = load_policy(tiny_hybridvla)
    config = SessionConfig(kv=KVConfig(mode=kv), history=history, seed=3)
    eager = hybrid.new_session("pick up the cup", config)
    compiled = hybrid.new_session("pick up the cup", replace(config, compile=CompileMode.DEFAULT))
    assert compiled._skip_guards and compiled.cache.stats().tokens_seen == 0
    state = np.array([0.1, -0.2, 0.3, 0.0, 0.1, -0.1, 1.0])
    observations = [Observation(images={"primary": frame(i)}, state=state) for i in range(6)]
    side_by_side(eager, compiled, observations, "pick up the cup and put it on the saucer",
                 same_tokens=lambda: np.testing.assert_array_equal(compiled.last_tokens, eager.last_tokens))  # fmt: skip
    obs = observations[-1]
    eager_calls, compiled_calls = llm_forwards(monkeypatch, eager, obs), llm_forwards(monkeypatch, compiled, obs)
    assert eager_calls == {"eager": eager_calls["eager"], "compiled": 0} and eager_calls["eager"] > 2
    assert compiled_calls == {"eager": 0, "compiled": eager_calls["eager"]}, "an LLM forward of the step ran eager"


def side_by_side(eager, compiled, observations, new_instruction: str, same_tokens=lambda: None) -> None:
    """Step both sessions on every observation, switching both to ``new_instruction`` (a new prompt and cache) before
    the fifth: actions within 1e-4, equal KV stats (and ``same_tokens()`` after each step), no graph compiled. A
    chunked cache must have compressed before the switch, so the check covers a compression."""
    before = counters["stats"]["unique_graphs"]
    for i, obs in enumerate(observations):
        if i == 4:
            if compiled.config.kv.mode is KVMode.CHUNKED:
                assert compiled.cache.chunks_formed > 0, "no compression: the check would not cover one"
            for session in (eager, compiled):
                session.reset(new_instruction)
        want, got = eager.step(obs), compiled.step(obs)  # the same noise: reset re-seeded the generator
        same_tokens()
        np.testing.assert_allclose(got.actions, want.actions, rtol=0, atol=1e-4)
        assert got.kv == want.kv
    assert counters["stats"]["unique_graphs"] == before, "a graph was compiled in a control step"


def llm_forwards(monkeypatch, session, obs) -> dict[str, int]:
    """LLM forwards one step of ``session`` runs, eager (``LlamaModel.forward``) and compiled (``CompiledDecoder``)."""
    calls = {"eager": 0, "compiled": 0}
    for kind, cls in (("eager", LlamaModel), ("compiled", CompiledDecoder)):
        original = cls.__call__ if cls is CompiledDecoder else cls.forward

        def counted(*args, _original=original, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "__call__" if cls is CompiledDecoder else "forward", counted)
    session.step(obs)
    monkeypatch.undo()
    return calls


class EagerSession(EpisodeSession):
    """A session of someone else's family that does not compile (a plain ``EpisodeSession``)."""

    def step(self, obs):
        raise AssertionError("not stepped")

    def reset(self, instruction=None):
        pass


def test_a_session_that_does_not_compile_refuses_a_compile_mode_naming_the_families_that_do():
    families = "OpenVLA, OpenVLA-OFT, CogACT, HybridVLA"
    with pytest.raises(ValueError, match=f"EagerSession runs eager only.*{families}.*'off'"):
        EagerSession("pick up the cup", SessionConfig(compile=CompileMode.DEFAULT))
    assert EagerSession("pick up the cup", SessionConfig()).config.compile is CompileMode.OFF
