"""The KEEP planner node over real rclpy: memory updates (good and bad) and a goal in, the next
subtask out on `instruction` only when it changes. A tiny random LLaMA with a word-level tokenizer
stands in for the planner LLM (the real SmolLM2 path is tested in tests/memory)."""

import json

import pytest

pytest.importorskip("rclpy")

import torch  # noqa: E402
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from ros_harness import Diagnostics, wait_for  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from vla_runtime_ros.planner_node import LATCHED_QOS, UPDATE_QOS, PlannerNode  # noqa: E402

pytestmark = pytest.mark.ros

NS = "/keep"
MEMORY = {
    "obj:Apple": "{'object': 'Apple', 'state': 'none', 'position': 'in the fridge'}",
    "obj:Fridge": "{'object': 'Fridge', 'state': 'closed', 'position': 'in the kitchen'}",
    "example:0": "Human: put the book on the shelf. Robot: 1. find a book, 2. pick up the book, 3. done.",
}


def write_tiny_planner(root):
    """A tiny random LLaMA HF directory (config.json, model.safetensors, tokenizer files)."""
    from safetensors.torch import save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM

    root.mkdir(parents=True)
    specials = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    split = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), "isolated")
    vocab = {t: i for i, t in enumerate(specials)}
    for text in [*MEMORY.values(), "Memory: Human: Robot: 1. 2. 3. put the apple on the table; open close pick up"]:
        for word, _ in split.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = split, decoders.Fuse()
    tok.add_special_tokens(specials[1:])
    cfg = LlamaConfig.from_name("tiny", vocab_size=len(vocab))  # every id the model can emit is a word
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    (root / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", chat_template=template).save_pretrained(root)
    return root


def test_planner_node_plans_from_goal_and_memory_and_rejects_bad_updates(harness, tmp_path):
    model = write_tiny_planner(tmp_path / "tiny-planner")
    node = PlannerNode(
        context=harness.context, namespace=NS,
        parameter_overrides=[Parameter("model", value=str(model)), Parameter("tick_hz", value=20.0),
                             Parameter("diagnostics_rate_hz", value=10.0), Parameter("torch_threads", value=1),
                             Parameter("max_new_tokens", value=6), Parameter("max_update_bytes", value=4096)],
    )  # fmt: skip
    diag = Diagnostics(harness, f"{NS}/vla_planner")
    instructions = harness.subscribe(String, f"{NS}/instruction", LATCHED_QOS)
    plans = harness.subscribe(String, f"{NS}/vla_planner/plan", 10)
    harness.add(node)
    try:
        updates = harness.publisher(String, f"{NS}/memory_update", UPDATE_QOS)
        goals = harness.publisher(String, f"{NS}/goal", LATCHED_QOS)
        updates.publish(String(data=json.dumps({"updates": [{"id": k, "text": v} for k, v in MEMORY.items()]})))
        diag.wait(lambda s, v: v["updates_applied"] == "1" and v["memory_segments"] == "3", 60, what="the memory")

        bad = [
            ("{not json", "not valid JSON"),
            ('{"updates": [{"id": "obj:Mug"}]}', "exactly the keys id and text"),
            (json.dumps({"updates": [{"id": "x", "text": "y" * 5000}]}), "bytes; the limit is 4096"),
            (json.dumps({"deletes": ["obj:Nope"]}), "no such segments"),  # valid schema, fails when applied
        ]
        for count, (raw, message) in enumerate(bad, start=1):
            updates.publish(String(data=raw))
            status, _ = diag.wait(lambda s, v, n=count: v["updates_rejected"] == str(n), 30, what=f"rejection {count}")
            assert status.level == DiagnosticStatus.ERROR and message in status.message, status.message
        assert len(node.memory) == 3  # nothing of the bad updates was applied

        goal = "put the apple on the table"
        goals.publish(String(data=goal))
        first = instructions.wait(1, 60, "the first subtask")[0].data
        plan = json.loads(plans.wait(1, 10, "the plan report")[0].data)
        assert plan["instruction"] == first and plan["changed"] is True
        assert set(plan["retrieved"]) == set(MEMORY)

        # the node plans exactly what the library planner plans on the same memory
        from vla_runtime.memory.planner import Planner, PlannerConfig

        expected = Planner(node.planner.llm, node.memory, PlannerConfig(max_new_tokens=6)).next_subtask(goal)
        assert first == expected.instruction

        # memory changes re-plan; an instruction goes out only for a changed subtask
        for i in range(3):
            updates.publish(String(data=json.dumps({"updates": [{"id": "obj:Apple", "text": MEMORY["obj:Apple"].replace("none", f"state{i}")}], "advance": 1})))
            plans.wait(2 + i, 60, f"plan {2 + i}")
        reports = [json.loads(m.data) for m in plans.wait(4, 1)]
        published = [m.data for m in instructions.wait(1, 1)]
        wait_for(lambda: len(instructions) == sum(r["changed"] for r in reports), 5, "every changed plan published")
        published = [r.msg.data for r in instructions.items]
        assert published == [r["instruction"] for r in reports if r["changed"]]
        assert all(a.lower() != b.lower() for a, b in zip(published, published[1:]))
        _, values = diag.wait(lambda s, v: v["plans"] == "4", 10, what="four plans")
        assert values["published"] == str(len(published)) and values["goal"] == goal
    finally:
        harness.remove(node)
