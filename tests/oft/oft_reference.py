"""OpenVLA-OFT's L1-regression ``predict_action`` written out plainly from upstream's algorithm, for tests.

Upstream (moojink/openvla-oft ``modeling_prismatic.py``, ``train_utils.py``, ``action_heads.py`` and the
transformers fork's bidirectional SDPA patch), step by step with token ids and labels as upstream builds
them, an explicit additive attention mask, an explicit-softmax LLaMA loop and the head's layers by hand.
Shares nothing with the runtime's OFT code: only the backbone's weights (``state_dict``) and its vision path.
"""

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
ACTION_TOKEN_BEGIN_IDX = 31743
STOP_INDEX = 2
EMPTY_ID = 29871


def input_ids_and_labels(prompt_ids: list[int], action_dim: int, chunk: int) -> tuple[list[int], list[int], int]:
    """``predict_action``: append 29871 if missing, the placeholder ids (1) and STOP; the fake labels."""
    ids = list(prompt_ids) + ([] if prompt_ids[-1] == EMPTY_ID else [EMPTY_ID])
    num_prompt_tokens = len(ids) - 1
    n = len(ids)
    ids = ids + [1] * (action_dim * chunk) + [STOP_INDEX]
    labels = [IGNORE_INDEX] * n + [ACTION_TOKEN_BEGIN_IDX + 1] * (action_dim * chunk)
    labels = labels + [STOP_INDEX]
    return ids, labels, num_prompt_tokens


def all_actions_mask(labels: torch.Tensor, action_dim: int) -> torch.Tensor:
    """``get_current_action_mask | get_next_actions_mask`` (train_utils.py). labels: [B, T] -> bool [B, T]."""
    cumsum = torch.cumsum(labels != IGNORE_INDEX, dim=1)
    is_action = labels > ACTION_TOKEN_BEGIN_IDX
    current = (1 <= cumsum) & (cumsum <= action_dim) & is_action
    following = (cumsum > action_dim) & is_action
    return current | following


def fork_attention_mask(t: int, *, causal: bool = False) -> torch.Tensor:
    """The fork's SDPA mask: HF's causal additive mask's last row copied to every row (no padding -> all 0).
    ``causal=True`` gives the stock causal mask instead (to show the test tells them apart)."""
    mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)  # [T, T]
    return mask if causal else mask[-1:].expand(t, t)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama_hidden(state: dict, cfg, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An explicit LLaMA: x [1, T, dim], additive mask [T, T] -> final-normed hidden states [1, T, dim] (float64)."""
    s = {k: v.double() for k, v in state.items()}
    t, hq, hkv, d = x.shape[1], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    inv_freq = 1.0 / (cfg.rope.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None]  # [T, D/2], positions 0..T-1
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    h = x[0].double()  # [T, dim]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        n = _rms(h, s[p + "input_layernorm.weight"], cfg.norm_eps)
        q = (n @ s[p + "self_attn.q_proj.weight"].T).view(t, hq, d).transpose(0, 1)  # [Hq, T, D]
        k = (n @ s[p + "self_attn.k_proj.weight"].T).view(t, hkv, d).transpose(0, 1)  # [Hkv, T, D]
        v = (n @ s[p + "self_attn.v_proj.weight"].T).view(t, hkv, d).transpose(0, 1)  # [Hkv, T, D]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)  # [Hq, T, D]
        scores = q @ k.transpose(1, 2) / math.sqrt(d) + mask.double()  # [Hq, T, T]
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, hq * d)  # [T, Hq * D]
        h = h + out @ s[p + "self_attn.o_proj.weight"].T
        n = _rms(h, s[p + "post_attention_layernorm.weight"], cfg.norm_eps)
        gate, up = n @ s[p + "mlp.gate_proj.weight"].T, n @ s[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ s[p + "mlp.down_proj.weight"].T
    return _rms(h, s["model.norm.weight"], cfg.norm_eps)[None]


def strip_ddp(state: dict) -> dict:
    return {k[len("module."):] if k.startswith("module.") else k: v.double() for k, v in state.items()}


def head_actions(head: dict, hidden: torch.Tensor, chunk: int) -> torch.Tensor:
    """``L1RegressionActionHead.predict_action`` by hand: hidden [1, K * A, dim] -> [K, A] (float64)."""
    x = hidden.double().reshape(chunk, -1)  # [K, A * dim]
    ln = lambda x, name: F.layer_norm(x, x.shape[-1:], head[f"model.{name}.weight"], head[f"model.{name}.bias"])  # noqa: E731
    lin = lambda x, name: x @ head[f"model.{name}.weight"].T + head[f"model.{name}.bias"]  # noqa: E731
    x = torch.relu(lin(ln(x, "layer_norm1"), "fc1"))
    blocks = sorted({k.split(".")[2] for k in head if k.startswith("model.mlp_resnet_blocks.")})
    for b in blocks:
        p = f"mlp_resnet_blocks.{b}.ffn"
        x = x + torch.relu(lin(ln(x, f"{p}.0"), f"{p}.1"))
    return lin(ln(x, "layer_norm2"), "fc2")


def proprio_token(projector: dict, state: torch.Tensor) -> torch.Tensor:
    """``ProprioProjector`` by hand: state [P] (normalised) -> [1, 1, dim]."""
    h = F.gelu(state.double() @ projector["fc1.weight"].T + projector["fc1.bias"])
    return (h @ projector["fc2.weight"].T + projector["fc2.bias"])[None, None]


def reference_chunk(
    *, lm_state: dict, llm_cfg, prompt_ids: list[int], patches: torch.Tensor, head: dict, action_dim: int,
    chunk: int, proprio: torch.Tensor | None = None, causal: bool = False, offset: int = 0,
) -> torch.Tensor:
    """Normalised actions [K, A] (float64). patches: [1, num_images * N, dim] (projected image tokens);
    proprio: [1, 1, dim]. ``offset``/``causal``: deliberately wrong variants for sensitivity checks."""
    ids, labels, num_prompt_tokens = input_ids_and_labels(prompt_ids, action_dim, chunk)
    ids_t, labels_t = torch.tensor([ids]), torch.tensor([labels])
    mask = all_actions_mask(labels_t, action_dim)  # [1, T]
    assert int(mask.sum()) == action_dim * chunk and not mask[0, -1]
    embeds = lm_state["model.embed_tokens.weight"].double()[ids_t] * ~mask[..., None]  # [1, T, dim], actions zeroed
    projected = patches.double() if proprio is None else torch.cat([patches.double(), proprio.double()], dim=1)
    seq = torch.cat([embeds[:, :1], projected, embeds[:, 1:]], dim=1)  # image (+ proprio) after BOS
    hidden = llama_hidden(lm_state, llm_cfg, seq, fork_attention_mask(seq.shape[1], causal=causal))
    num_patches = projected.shape[1]
    first = num_patches + num_prompt_tokens + offset
    return head_actions(head, hidden[:, first : first + action_dim * chunk], chunk)
