"""Load a Hugging Face LLaMA-family causal-LM directory (LLaMA, SmolLM2, Qwen2) into our decoder.

Reads ``config.json``, ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``)
and the tokenizer files with transformers' ``AutoTokenizer`` (local files only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.llama import LlamaConfig, LlamaForCausalLM
from ..models.prismatic.configuration_prismatic import read_json
from .safetensors_io import open_safetensors, weight_files


@dataclass
class CausalLM:
    """A decoder and its tokenizer. ``name`` is the directory it came from."""

    model: LlamaForCausalLM
    tokenizer: object
    name: str

    @property
    def cfg(self) -> LlamaConfig:
        return self.model.cfg


ROTARY_BUFFER = ".rotary_emb.inv_freq"


def load_state_dict(root: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors; a ValueError naming the tensor and file for one that is not
    floating point (every weight of the decoder is)."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(root):
        with open_safetensors(f) as handle:
            for name in handle.keys():
                state[name] = handle.get_tensor(name)
                if not state[name].is_floating_point():
                    raise ValueError(f"{f}: tensor `{name}` is {state[name].dtype}; expected a floating-point weight")
    return state


def load_causal_lm(
    path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, tokenizer: bool = True
) -> CausalLM:
    """Our ``LlamaForCausalLM`` with the directory's weights (strict names) and its tokenizer."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {root} does not exist")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{root}: config.json is missing")
    cfg = LlamaConfig.from_hf(read_json(cfg_file), where=str(cfg_file))
    state = load_state_dict(root)
    for name in [n for n in state if n.endswith(ROTARY_BUFFER)]:  # older HF conversions saved the derived table
        del state[name]
    if cfg.tie_embeddings and "model.embed_tokens.weight" in state:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and tuple(expected[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{root}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{root}: weights missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{root}: tensors a {cfg.n_layers}-layer LLaMA-family decoder does not have: {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''} (is config.json from another model?)")
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    return CausalLM(model=model, tokenizer=tok, name=root.name)
