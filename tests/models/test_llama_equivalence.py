"""Our decoder vs transformers on the same tiny random weights (fp32): prefill + 20 cached decode steps."""

import pytest
import torch
import transformers

from vla_runtime.kv import FullCache, FullParams
from vla_runtime.models.generation import SamplingConfig, generate
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM

HF_CASES = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3-rope": (
        "llama",
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
        ),
    ),
    "linear-rope": ("llama", dict(num_key_value_heads=2, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "dynamic-rope": (
        "llama",
        dict(num_key_value_heads=2, max_position_embeddings=16, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    ),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=2)),
}


def make_hf(kind: str, overrides: dict):
    base = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, rms_norm_eps=1e-6,
    )
    base.update(overrides)
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**base)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**base)
        model = transformers.LlamaForCausalLM(cfg)
    # random (not zero) biases so the q/k/v bias path is exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def ours_from_hf(hf_model) -> LlamaForCausalLM:
    cfg = LlamaConfig.from_hf(hf_model.config.to_dict())
    ours = LlamaForCausalLM(cfg)
    state = hf_model.state_dict()
    ours.load_state_dict(state, strict=True)
    return ours.eval()


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_prefill_and_20_decode_steps_match_transformers(case, hf_cache):
    kind, overrides = HF_CASES[case]
    hf = make_hf(kind, overrides)
    ours = ours_from_hf(hf)
    torch.manual_seed(1)
    prompt = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        cache = FullCache(ours.cfg.geometry, FullParams(capacity=64))
        ours_logits = [ours(prompt, cache=cache)]
        past = transformers.DynamicCache(config=hf.config)
        hf_out = hf(prompt, **hf_cache(hf, past), use_cache=True)
        hf_logits = [hf_out.logits]
        tok = hf_out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            ours_logits.append(ours(tok, cache=cache))
            hf_out = hf(tok, **hf_cache(hf, past), use_cache=True)
            hf_logits.append(hf_out.logits)
            tok = hf_out.logits[:, -1:].argmax(-1)
    for step, (a, b) in enumerate(zip(ours_logits, hf_logits)):
        torch.testing.assert_close(a, b.float(), atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert cache.length == 32


def test_greedy_generate_matches_transformers_generate():
    hf = make_hf("llama", dict(num_key_value_heads=2))
    ours = ours_from_hf(hf)
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=15, do_sample=False, pad_token_id=0)[:, 9:]
    got = generate(ours, FullCache(ours.cfg.geometry, FullParams(capacity=64)), input_ids=prompt, max_new_tokens=15)
    assert torch.equal(got, expected)


def test_sampled_generate_is_seeded_and_respects_top_k():
    hf = make_hf("llama", dict(num_key_value_heads=2))
    ours = ours_from_hf(hf)
    prompt = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(4))
    sampling = SamplingConfig(temperature=1.5, top_k=3)

    def run(seed):
        return generate(
            ours, FullCache(ours.cfg.geometry, FullParams(capacity=64)), input_ids=prompt, max_new_tokens=10, sampling=sampling,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # with top_k=1 sampling degenerates to greedy
    greedy = generate(ours, FullCache(ours.cfg.geometry, FullParams(capacity=64)), input_ids=prompt, max_new_tokens=10)
    top1 = generate(
        ours, FullCache(ours.cfg.geometry, FullParams(capacity=64)), input_ids=prompt, max_new_tokens=10,
        sampling=SamplingConfig(temperature=2.0, top_k=1), generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(greedy, top1)


def test_full_cache_rollback_replays_identically():
    hf = make_hf("llama", dict(num_key_value_heads=2))
    ours = ours_from_hf(hf)
    cache = FullCache(ours.cfg.geometry, FullParams(capacity=64))
    with torch.no_grad():
        ours(torch.arange(1, 8)[None], cache=cache)
        mark = cache.mark()
        first = ours(torch.tensor([[5, 6, 7]]), cache=cache)
        cache.rollback(mark)
        again = ours(torch.tensor([[5, 6, 7]]), cache=cache)
    torch.testing.assert_close(first, again)
    assert cache.length == 10


def test_full_cache_overflow_is_a_clear_error():
    cfg = LlamaConfig.from_name("tiny")
    model = LlamaForCausalLM(cfg)
    cache = FullCache(cfg.geometry, FullParams(capacity=8))
    with pytest.raises(ValueError, match="capacity 8"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
