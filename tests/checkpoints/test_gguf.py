"""GGUF -> HF directory: q/k un-permutation, names, and the real SmolLM2-135M-Instruct against transformers."""

import json

import numpy as np
import pytest
import torch

from vla_runtime.checkpoints.gguf import hf_tensor_name, unpermute_qk
from vla_runtime.cli import main as cli_main


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The permutation llama.cpp's convert_hf_to_gguf.py applies to q/k rows (written from its formula)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_heads), w)
    # rows of one head stay within that head
    np.testing.assert_array_equal(unpermute_qk(permuted, n_heads)[:head_dim], w[:head_dim])


def test_tensor_names_map_to_hf_and_unknown_names_fail():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        hf_tensor_name("blk.0.attn_qkv.weight")


def test_cli_reports_a_missing_gguf(tmp_path, capsys):
    assert cli_main(["convert-gguf", "--gguf", str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
    assert "none.gguf does not exist" in capsys.readouterr().err


def test_converted_directory_is_a_standard_hf_checkpoint(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    tok_cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "chat_template" in tok_cfg


def test_our_decoder_matches_transformers_on_converted_smollm2(smollm2_dir, hf_cache):
    """Prefill + 4 greedy decode steps in fp32; the greedy answer also shows the dequantised,
    un-permuted weights are right (a wrong q/k permutation does not answer "Paris")."""
    import transformers

    from vla_runtime.checkpoints.causal_lm import load_causal_lm
    from vla_runtime.kv import FullCache, FullParams

    torch.set_num_threads(2)
    lm = load_causal_lm(smollm2_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([lm.tokenizer(prompt)["input_ids"]])
    cache, past = FullCache(lm.cfg.geometry, FullParams(capacity=64)), transformers.DynamicCache(config=hf.config)
    generated = []
    with torch.no_grad():
        tok = ids
        for step in range(8):
            ours = lm.model(tok, cache=cache)
            ref = hf(tok, **hf_cache(hf, past), use_cache=True).logits
            if step < 5:
                torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
            tok = ref[:, -1:].argmax(-1)
            generated.append(int(tok))
    assert "Paris" in lm.tokenizer.decode(generated)


def test_converted_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    from vla_runtime.checkpoints.gguf import SMOLLM2_FILE, default_gguf_path

    ours = AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    ref = AutoTokenizer.from_pretrained(str(default_gguf_path().parent), gguf_file=SMOLLM2_FILE)
    chat = [
        {"role": "system", "content": "You plan tasks for a kitchen robot."},
        {"role": "user", "content": "Goal: put the 2 apples in the fridge.\n{'object': 'Apple', 'position': 'on the table'}"},
    ]
    text = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = ours(text)["input_ids"]
    assert ids == ref(text)["input_ids"]
    assert ids[0] == ours.convert_tokens_to_ids("<|im_start|>")  # control tokens stay whole
    assert ours.decode(ids) == text
    assert ours("room 12")["input_ids"][-2:] == [ours.convert_tokens_to_ids("1"), ours.convert_tokens_to_ids("2")]


def write_gguf(path, *, merges: bool) -> None:
    """A small LLaMA GGUF (2 layers of 64) whose byte-level BPE has, or lacks, its merges."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    d, ff, layers, vocab = 64, 128, 2, 260
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_block_count(layers)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([bytes([i]).decode("latin-1") if i < 256 else f"tok{i}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["a b"] if merges else [])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "output.weight": (vocab, d)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (d, d),
                   f"blk.{i}.attn_k.weight": (32, d), f"blk.{i}.attn_v.weight": (32, d), f"blk.{i}.attn_output.weight": (d, d),
                   f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d), f"blk.{i}.ffn_down.weight": (d, ff)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_the_converter_cannot_read_is_refused_before_anything_is_written(tmp_path, capsys):
    from vla_runtime.cli import main

    write_gguf(tmp_path / "nomerge.gguf", merges=False)
    (tmp_path / "half.gguf").write_bytes((tmp_path / "nomerge.gguf").read_bytes()[:2000])
    for name, message in (("nomerge", "has no tokenizer.ggml.merges"), ("half", "half.gguf: ")):
        assert main(["convert-gguf", str(tmp_path / f"out-{name}"), "--gguf", str(tmp_path / f"{name}.gguf")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / f"out-{name}").exists()  # no config.json or weights without their tokenizer
