"""Planner (goal + memory -> next subtask) and the planner node's pure logic (update messages,
subtask changes). Tiny random model with a word-level tokenizer; one test on the real SmolLM2."""

import json

import pytest
import torch

from vla_runtime.checkpoints.causal_lm import CausalLM
from vla_runtime.memory import EmbodiedMemory, MemoryConfig, PrefillConfig
from vla_runtime.memory.messages import (
    MemoryUpdateError,
    SubtaskTracker,
    UpdateLimits,
    apply_memory_update,
    parse_memory_update,
)
from vla_runtime.memory.planner import Planner, PlannerConfig, cut_at_stop

SEGMENTS = {
    "obj:Apple": "{'object': 'Apple', 'state': 'sliced', 'position': 'in the fridge'}",
    "obj:Fridge": "{'object': 'Fridge', 'state': 'closed', 'position': 'in the kitchen'}",
    "obj:Mug": "{'object': 'Mug', 'state': 'dirty', 'position': 'on the countertop'}",
    "obj:Knife": "{'object': 'Knife', 'state': 'clean', 'position': 'in the drawer'}",
    "rule:0": "Rule: I can only hold one thing at a time.",
    "example:0": "Human: put the book on the shelf. Robot: 1. find a book, 2. pick up the book, 3. find a shelf, 4. put down the book, 5. done.",
}
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def word_tokenizer():
    """A real `tokenizers` word-level tokenizer over this file's texts, with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    split = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), "isolated")
    corpus = [*SEGMENTS.values(), "Memory: Human: Robot: 1. 2. 3. 4. put the apple on the table; open"]
    vocab = {t: i for i, t in enumerate(specials)}
    for text in corpus:
        for word, _ in split.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = split
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials[1:])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tiny_llm(tiny_lm):
    return CausalLM(tiny_lm, word_tokenizer(), "tiny")


@pytest.fixture
def memory(encoder):
    mem = EmbodiedMemory(encoder, MemoryConfig(static_after=2, top_k=4))
    for sid, text in SEGMENTS.items():
        mem.add(sid, text)
    return mem


def test_cut_at_stop():
    assert cut_at_stop("\nOpen the fridge.\nThen", ("\n",)) == ("Open the fridge.", True)
    assert cut_at_stop(" find a knife, 5. pick", (",", "\n")) == ("find a knife", True)
    assert cut_at_stop("pick up the mug<|end|>", ("<|end|>", "\n")) == ("pick up the mug", True)
    assert cut_at_stop("pick up", ("\n",)) == ("pick up", False)


def test_prompt_keeps_a_constant_prefix_and_puts_memory_before_the_goal(tiny_llm, memory):
    planner = Planner(tiny_llm, memory)
    prefix1, query1 = planner._texts("put the apple on the table", [])
    prefix2, query2 = planner._texts("open the fridge.", ["find a knife", "pick up the knife."])
    assert prefix1 == prefix2 and prefix1.startswith("<|system|>\n") and prefix1.endswith("Memory:\n")
    assert query1 == "Human: put the apple on the table.<|end|>\n<|assistant|>\nRobot: 1."
    assert query2.endswith("Human: open the fridge.<|end|>\n<|assistant|>\nRobot: 1. find a knife, 2. pick up the knife, 3.")
    short = Planner(tiny_llm, memory, PlannerConfig(history=1))._texts("g", ["a", "b", "c"])[1]
    assert short.endswith("Robot: 3. c, 4.")  # only the most recent, still numbered by their place


def test_keep_with_full_recompute_plans_exactly_like_text_memory(tiny_llm, memory):
    memory.advance(2)  # some groups are static now
    got = {}
    keep_all = PrefillConfig(method="keep", ratios=(1.0,))
    configs = {"full": (PrefillConfig(method="full"), ""), "keep": (keep_all, ""), "keep-ctx": (keep_all, "The lamp is off.\n")}
    for name, (prefill, context) in configs.items():
        config = PlannerConfig(prefill=prefill, max_new_tokens=6, stop=("<never>",), unit_context=context)
        planner = Planner(tiny_llm, memory, config)
        step = planner.next_subtask("put the apple on the table")
        got[name] = step
        assert step.new_tokens == 6 and step.ttft_ms <= step.total_ms
        assert set(step.retrieved) <= set(SEGMENTS) and len(step.retrieved) <= 4
    assert got["keep"].instruction == got["full"].instruction == got["keep-ctx"].instruction
    # with a context filler every unit is recomputed (none was prefilled where it sits) and the filler is built once
    assert got["keep-ctx"].prefill.units_built == got["keep"].prefill.units_built + 1
    assert got["keep"].prefill.recompute_share < 1.0 or got["keep"].prefill.units_built > 0


def test_planner_rejects_an_empty_goal(tiny_llm, memory):
    with pytest.raises(ValueError, match="goal"):
        Planner(tiny_llm, memory).next_subtask("  ")


def test_memory_update_messages_are_validated_whole_then_applied(memory):
    msg = json.dumps({"updates": [{"id": "obj:Apple", "text": SEGMENTS["obj:Apple"].replace("fridge", "sink")},
                                  {"id": "obj:Plate", "text": "{'object': 'Plate', 'state': 'clean', 'position': 'in the cabinet'}"},
                                  {"id": "obj:Mug", "text": SEGMENTS["obj:Mug"]}],
                      "deletes": ["rule:0"], "advance": 2})  # fmt: skip
    summary = apply_memory_update(memory, parse_memory_update(msg))
    assert (summary.changed, summary.unchanged, summary.deleted, summary.step) == (2, 1, 1, 2)
    assert "sink" in memory.get("obj:Apple").text and "obj:Plate" in memory and "rule:0" not in memory
    # a delete of an unknown id fails before anything is applied
    before = memory.get("obj:Mug").text
    bad = parse_memory_update(json.dumps({"updates": [{"id": "obj:Mug", "text": "x y"}], "deletes": ["nope"]}))
    with pytest.raises(MemoryUpdateError, match="no such segments"):
        apply_memory_update(memory, bad)
    assert memory.get("obj:Mug").text == before


@pytest.mark.parametrize(
    "raw,match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ("{}", "empty update"),
        ('{"upserts": []}', "unknown keys"),
        ('{"updates": [{"id": "a"}]}', r"updates\[0\]: expected an object with exactly the keys id and text"),
        ('{"updates": [{"id": "a", "text": ""}]}', r"updates\[0\].text: expected a non-empty string"),
        ('{"updates": [{"id": 3, "text": "x"}]}', r"updates\[0\].id"),
        ('{"deletes": "a"}', "deletes: expected a list"),
        ('{"advance": -1}', "advance"),
        ('{"advance": true}', "advance"),
        ('{"updates": [{"id": "a", "text": "x"}], "deletes": ["a"]}', "more than once"),
        ('{"updates": [{"id": "a", "text": "' + "x" * 3000 + '"}]}', "limit is 2000"),
        # a lone surrogate is valid JSON but no text: the encoder raised on it after the deletes had run
        ('{"updates": [{"id": "a", "text": "mug \\ud800"}], "deletes": []}', r"updates\[0\].text: not valid text"),
        ('{"updates": [{"id": "<prefix>", "text": "x"}]}', "ids starting with '<' are the prefill's own"),
        # under the size limit, yet each ended the ROS planner node: a RecursionError and a ValueError
        ('{"advance": ' + "[" * 20000 + "]" * 20000 + "}", "JSON nested too deeply"),
        ('{"advance": ' + "9" * 5000 + "}", "JSON value out of range"),
    ],
)
def test_bad_memory_updates_are_rejected_with_a_diagnostic(raw, match):
    with pytest.raises(MemoryUpdateError, match=match):
        parse_memory_update(raw)


def test_message_size_limit():
    raw = json.dumps({"updates": [{"id": f"s{i}", "text": "y" * 100} for i in range(50)]})
    with pytest.raises(MemoryUpdateError, match="bytes; the limit is 1000"):
        parse_memory_update(raw, UpdateLimits(max_bytes=1000))


def test_subtask_tracker_reports_only_changes():
    t = SubtaskTracker()
    assert t.update("Open the fridge.") is True
    assert t.update("open the  fridge") is False
    assert t.update("") is False and t.current == "Open the fridge."
    assert t.update("Pick up the apple") is True and t.current == "Pick up the apple"
    t.reset()
    assert t.update("Pick up the apple") is True
    assert t.update("Pick up the apple .") is False and t.update("pick up the apple!") is False


def test_planner_on_smollm2_keep_matches_text_memory(smollm2_dir, encoder):
    """The real SmolLM2-135M-Instruct: KEEP recomputing everything plans exactly like text memory, and
    the default KEEP plan is one step (stops at the comma that ends a LoTA step)."""
    from vla_runtime.checkpoints.causal_lm import load_causal_lm

    torch.set_num_threads(2)
    llm = load_causal_lm(smollm2_dir)
    mem = EmbodiedMemory(encoder, MemoryConfig(top_k=5))
    for sid, text in SEGMENTS.items():
        mem.add(sid, text)
    plans = {}
    for name, prefill in {"full": PrefillConfig(method="full"), "keep-all": PrefillConfig(method="keep", ratios=(1.0,)), "keep": PrefillConfig()}.items():
        planner = Planner(llm, mem, PlannerConfig(prefill=prefill, max_new_tokens=16))
        plans[name] = planner.next_subtask("put the apple on the dining table", ["find an apple"])
    assert plans["keep-all"].instruction == plans["full"].instruction
    for step in plans.values():
        assert step.instruction and not set("\n,") & set(step.instruction) and step.new_tokens <= 16
    assert plans["keep"].prefill.recompute_share < 1.0


def test_plan_cli_plans_like_the_library(tmp_path, encoder, capsys):
    """`vla-runtime plan` on an HF directory + a memory file gives the library planner's instruction."""
    from safetensors.torch import save_file

    from vla_runtime.checkpoints.causal_lm import load_causal_lm
    from vla_runtime.cli import main as cli_main
    from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM

    tok = word_tokenizer()
    cfg = LlamaConfig.from_name("tiny", vocab_size=len(tok))
    torch.manual_seed(0)
    model_dir = tmp_path / "planner"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in LlamaForCausalLM(cfg).state_dict().items()}, str(model_dir / "model.safetensors"))
    tok.save_pretrained(model_dir)
    memory_file = tmp_path / "memory.json"
    memory_file.write_text(json.dumps({"updates": [{"id": k, "text": v} for k, v in SEGMENTS.items()], "advance": 3}))
    args = ["plan", "--model", str(model_dir), "--memory", str(memory_file), "--goal", "open the fridge",
            "--done", "find a fridge", "--method", "keep", "--top-k", "4", "--max-new-tokens", "5", "--threads", "1"]  # fmt: skip
    assert cli_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    mem = EmbodiedMemory(encoder, MemoryConfig(top_k=4))
    apply_memory_update(mem, parse_memory_update(memory_file.read_text()))
    expected = Planner(load_causal_lm(model_dir), mem, PlannerConfig(max_new_tokens=5)).next_subtask("open the fridge", ["find a fridge"])
    assert out["instruction"] == expected.instruction and out["instruction"]
    assert out["method"] == "keep" and out["retrieved"] == list(expected.retrieved)
    assert cli_main(["plan", "--model", str(model_dir), "--memory", str(tmp_path / "none.json"), "--goal", "x"]) == 2
    assert "none.json does not exist" in capsys.readouterr().err


def test_retrieval_reads_the_finished_subtasks_too(tiny_llm, memory):
    """The next step depends on where the last one went ("go to the fridge" -> is it closed?): memory is
    retrieved by the goal and the finished subtasks the answer lists, not by the goal alone."""
    config = PlannerConfig(history=1, top_k=2, max_new_tokens=2)
    planner = Planner(tiny_llm, memory, config)
    query = planner.retrieval_query("put the book on the shelf.", ["find a knife", "go to the fridge,"])
    assert query == "put the book on the shelf. go to the fridge."  # history=1: the latest finished subtask
    by_goal = {s.id for u in memory.retrieve("put the book on the shelf.", 2) for s in u.segments}
    assert "obj:Fridge" not in by_goal
    step = planner.next_subtask("put the book on the shelf", ["find a knife", "go to the fridge"])
    assert "obj:Fridge" in step.retrieved
