"""Write an OpenVLA model as a checkpoint directory in the layout of the checkpoint it came from.

Used for merged fine-tunes and models trained from scratch (``vla_finetune``): ``config.json`` is the
source's, byte-for-byte in content except ``norm_stats`` (the new dataset's statistics) and
``torch_dtype``; the tokenizer and processor files are copied; the weights are written as transformers
does (``model.safetensors``, or 5 GB shards plus ``model.safetensors.index.json``) under the HF names.
``dataset_statistics.json`` is written beside them, as upstream's fine-tuning does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from ..models.prismatic.configuration_prismatic import read_json
from .safetensors_io import save_safetensors

# files copied from the source checkpoint when present (tokenizer, processors, generation, remote code)
COPIED = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
)
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size "5GB"
STATISTICS = "dataset_statistics.json"


def save_openvla_like(
    model: nn.Module,
    out: str | Path,
    *,
    source: str | Path,
    norm_stats: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model``'s weights to ``out`` as a checkpoint shaped like ``source``.

    norm_stats: replaces ``config.json``'s ``norm_stats`` and is written as ``dataset_statistics.json``
    (``None`` keeps the source's). dtype: stored dtype; ``None`` = the source's ``torch_dtype``.
    """
    source, out = Path(source), Path(out)
    config = read_json(source / "config.json")
    if dtype is None:
        dtype = getattr(torch, str(config.get("torch_dtype", "bfloat16")))
    name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = name
    if isinstance(config.get("text_config"), dict) and "torch_dtype" in config["text_config"]:
        config["text_config"]["torch_dtype"] = name
    if norm_stats is not None:
        config["norm_stats"] = norm_stats
    out.mkdir(parents=True, exist_ok=True)
    for file in [*COPIED, *(p.name for p in source.glob("*.py"))]:
        if (source / file).is_file():
            shutil.copy2(source / file, out / file)
    # clone: tied weights would otherwise share storage, which safetensors refuses
    state = {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}
    save_safetensors(state, out, max_shard_bytes=MAX_SHARD_BYTES)
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    if norm_stats is not None:
        (out / STATISTICS).write_text(json.dumps(norm_stats, indent=2) + "\n")
    return out
