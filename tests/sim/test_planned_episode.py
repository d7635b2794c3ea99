"""The planner drives the policy in Meta-World: the planner's subtasks are the instructions the policy runs,
and the episode's events reach the planner's memory and its next prompt (a tiny random planner LLM with a
word-level tokenizer, the real all-MiniLM-L6-v2 encoder, a tiny OpenVLA)."""

import importlib.util

import pytest
import torch

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.causal_lm import CausalLM
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.memory import EmbodiedMemory, MemoryConfig
from vla_runtime.memory.planner import Planner, PlannerConfig
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM
from vla_runtime.sim import MetaWorldConfig, make_env
from vla_runtime.sim.planned import PlannedConfig, run_planned_episode

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed"),
]
WORDS = "Episode start the goal is to press button top down hand at x y z Subtask ran steps not done yet Memory Human Robot 1 2 3 4 ; : , ."


def planner_llm() -> CausalLM:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>"]
    split = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), "isolated")
    vocab = {t: i for i, t in enumerate(specials)}
    for word, _ in split.pre_tokenize_str(WORDS):
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = split, decoders.Fuse()
    tok.add_special_tokens(specials[1:])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny", n_layers=2, vocab_size=len(vocab))).eval()
    return CausalLM(model, tokenizer, "tiny")


@pytest.fixture(scope="module")
def encoder():
    from vla_runtime.memory.encoder import SentenceEncoder

    try:
        return SentenceEncoder()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_the_planners_subtasks_are_the_policys_instructions(tmp_path, encoder):
    policy = load_policy(make_tiny_openvla(tmp_path / "ckpt", dtype=torch.float32), device="cpu")
    planner = Planner(planner_llm(), EmbodiedMemory(encoder, MemoryConfig(top_k=20)),
                      PlannerConfig(max_new_tokens=4, stop=(",", "\n", ";")))  # fmt: skip
    planned, ran = [], []
    plan = planner.next_subtask
    planner.next_subtask = lambda goal, done: planned.append(plan(goal, done)) or planned[-1]
    new_session = policy.new_session

    def spy_session(instruction, config=None):
        ran.append(instruction)
        session = new_session(instruction, config)
        reset = session.reset
        session.reset = lambda instruction=None: ran.append(instruction) or reset(instruction)
        return session

    policy.new_session = spy_session
    env = make_env("metaworld", MetaWorldConfig(resolution=(56, 56)))
    try:
        result = run_planned_episode(env, policy, planner, "button-press-topdown-v3", seed=3,
                                     config=PlannedConfig(subtask_steps=4, max_subtasks=3))  # fmt: skip
    finally:
        env.close()
    assert len(planned) == len(result.subtasks) == 3 and result.steps == 12
    assert ran == [p.instruction.strip() or result.goal for p in planned] == [s.instruction for s in result.subtasks]
    assert [s.first_step for s in result.subtasks] == [0, 4, 8]
    # each subtask's event went into the memory, and the next plan's prompt held it
    assert len(result.events) == 4 and "Subtask 1" in result.events[1] and "ran 4 steps" in result.events[1]
    assert "event:start" in planned[0].retrieved and "event:1" not in planned[0].retrieved
    assert "event:1" in planned[1].retrieved and "event:2" in planned[2].retrieved
    assert planner.memory.get("event:3").text == result.events[3]
