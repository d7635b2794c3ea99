"""A tiny planner LLM for the ROS tests: a random LLaMA whose word-level tokenizer covers the test memory,
so every id it emits decodes to a word (the real SmolLM2 path is tested in tests/memory)."""

from __future__ import annotations

import json

import torch

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
