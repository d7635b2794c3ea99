"""The torch references are trustworthy oracles: checked against an independent composition.

``attention_ref.chunked_attention`` vs the runtime's own pieces (``vla_runtime.kv.rope`` cos/sin tables and
``apply_rope`` from a ``RopeConfig``, an explicit gather, ``masked_attention`` with an explicit [T, N] mask)
and vs a float64 softmax written out by hand. ``rope_ref.rope`` vs ``apply_rope`` for every RoPE schedule.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CASES, AttnCase, make_inputs

from vla_kernels.attention_ref import chunked_attention
from vla_kernels.rope_ref import rope
from vla_runtime.kv.attention import masked_attention
from vla_runtime.kv.rope import RopeConfig, apply_rope, inv_freq, rope_cos_sin

SCHEDULES = {
    "default": RopeConfig(head_dim=64),
    "llama3": RopeConfig(head_dim=64, theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=64),
    "linear": RopeConfig(head_dim=128, rope_type="linear", factor=4.0),
}


def _composed(q, k_store, v_store, kv_slots, kv_pos, q_pos, cfg: RopeConfig) -> torch.Tensor:
    """Gather, rotate with the runtime's RoPE, attend with an explicit mask (masked_attention)."""
    k = k_store[:, :, kv_slots.long()]  # [B, Hkv, N, D]
    v = v_store[:, :, kv_slots.long()]  # [B, Hkv, N, D]
    q_rot = apply_rope(q, *rope_cos_sin(q_pos, cfg))
    k_rot = apply_rope(k, *rope_cos_sin(kv_pos, cfg))
    mask = kv_pos[None, :] <= q_pos[:, None]  # [T, N]
    return masked_attention(q_rot, k_rot, v, mask)


def _float64_softmax(q, k_store, v_store, kv_slots, kv_pos, q_pos, cfg: RopeConfig) -> torch.Tensor:
    """Scores, mask and softmax spelled out in float64 (GQA by repeating kv heads)."""
    group = q.shape[1] // k_store.shape[1]
    k = k_store[:, :, kv_slots.long()].double().repeat_interleave(group, dim=1)  # [B, Hq, N, D]
    v = v_store[:, :, kv_slots.long()].double().repeat_interleave(group, dim=1)  # [B, Hq, N, D]
    q_rot = apply_rope(q.double(), *rope_cos_sin(q_pos, cfg))
    k_rot = apply_rope(k, *rope_cos_sin(kv_pos, cfg))
    scores = q_rot @ k_rot.transpose(-1, -2) / q.shape[-1] ** 0.5  # [B, Hq, T, N]
    mask = kv_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # rows with no visible key: zeros
    return weights @ v


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_matches_independent_composition(case: AttnCase, schedule: str):
    cfg = SCHEDULES[schedule]
    if cfg.head_dim != case.head_dim:
        cfg = RopeConfig(**{**cfg.__dict__, "head_dim": case.head_dim})
    inputs = make_inputs(case, torch.float32, "cpu")
    inputs["inv_freq"] = inv_freq(cfg)
    out = chunked_attention(**inputs)
    args = [inputs[n] for n in ("q", "k_store", "v_store", "kv_slots", "kv_pos", "q_pos")]
    torch.testing.assert_close(out, _composed(*args, cfg), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.double(), _float64_softmax(*args, cfg), atol=1e-5, rtol=1e-5)


def test_reference_blind_query_is_zero_and_others_are_not():
    case = next(c for c in CASES if c.layout == "blind")
    out = chunked_attention(**make_inputs(case, torch.float32, "cpu"))
    assert (out[:, :, 0] == 0).all() and (out[:, :, 1:] != 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_rope_reference_equals_runtime_apply_rope(schedule: str, dtype: torch.dtype):
    cfg = SCHEDULES[schedule]
    x = torch.randn(2, 3, 17, cfg.head_dim).to(dtype)
    pos = torch.randint(0, 8000, (17,), dtype=torch.int32)
    expected = apply_rope(x, *rope_cos_sin(pos, cfg))
    torch.testing.assert_close(rope(x, pos, inv_freq(cfg)), expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=torch.zeros(1, 4, 2, 64)), "B and D must match"),
        (dict(kv_pos=torch.zeros(5, dtype=torch.int32)), "`kv_pos` has 5 entries"),
        (dict(kv_slots=torch.zeros(3)), "`kv_slots` must be int32"),
        (dict(q_pos=torch.zeros(3, dtype=torch.int32)), "`q_pos` has 3 entries"),
        (dict(inv_freq=torch.zeros(64)), r"`inv_freq` must be \[head_dim/2\]"),
        (dict(v_store=torch.zeros(2, 1, 9, 64)), "`v_store` shape"),
        (dict(q=torch.zeros(2, 3, 2, 64)), "multiple of key/value heads"),
        (dict(kv_slots=torch.tensor([0, 9, 1], dtype=torch.int32)), r"`kv_slots` holds 9; expected slot indices in \[0, 9\)"),
        (dict(kv_slots=torch.tensor([0, -1, 1], dtype=torch.int32)), r"`kv_slots` holds -1; expected slot indices"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, match):
    base = dict(
        q=torch.zeros(2, 4, 2, 64), k_store=torch.zeros(2, 2, 9, 64), v_store=torch.zeros(2, 2, 9, 64),
        kv_slots=torch.zeros(3, dtype=torch.int32), kv_pos=torch.zeros(3, dtype=torch.int32),
        q_pos=torch.zeros(2, dtype=torch.int32), inv_freq=torch.zeros(32),
    )
    with pytest.raises(ValueError, match=match):
        chunked_attention(**{**base, **kwargs})
