"""peft LoRA adapters written by ``vla_finetune``: detect one, merge it into a loaded model.

An adapter directory holds ``adapter_config.json`` + ``adapter_model.safetensors`` (peft's layout,
keys ``base_model.model.<module>.lora_{A,B}.weight``). Only safetensors are read: a directory with
only a pickled ``adapter_model.bin`` is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def has_lora(directory: str | Path) -> bool:
    """Whether ``directory`` holds a peft LoRA adapter (``adapter_config.json``)."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def merge_lora(model: nn.Module, directory: str | Path) -> nn.Module:
    """Load the adapter in ``directory`` onto ``model`` and merge it into the weights
    (``W + (alpha / r) B A``); returns the plain model (same module tree and names, no peft layers)."""
    from peft import PeftModel

    directory = Path(directory)
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(
            f"{directory / ADAPTER_WEIGHTS} does not exist (an adapter needs {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}; "
            "pickled adapter_model.bin files are not loaded)"
        )
    try:
        peft_model = PeftModel.from_pretrained(model, str(directory), is_trainable=False)
    except (ValueError, RuntimeError) as e:  # unknown target modules / tensor shape mismatch
        raise ValueError(f"the LoRA adapter in {directory} does not fit this checkpoint: {e}") from e
    return peft_model.merge_and_unload()
