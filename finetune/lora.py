"""peft LoRA on the policy model: ``apply_lora(model, cfg)`` is the single entry point (STYLE §1.4).

Targets resolve to full module names before peft sees them, so what is adapted is explicit and an
unknown name fails before training with the model's linear layers listed. ``all-linear`` follows
OpenVLA's recipe (vision towers, projectors, LLM and ``lm_head``; peft 0.11 also caught the ViTs'
Conv2d ``patch_embed.proj`` by its suffix, which we leave out: only ``nn.Linear`` layers) minus the
layers the forward pass never runs (each tower's last block and heads, see ``tower_features``), whose
adapters would never get a gradient.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable

import torch.nn as nn

from vla_runtime.checkpoints.openvla import UNUSED

from .config import LORA_SHORTHANDS, LoraSettings

if TYPE_CHECKING:
    from peft import PeftModel


def unused_by_forward(model: nn.Module) -> tuple[str, ...]:
    """Module-name prefixes (ending in ``.``) the policy's forward never runs: every vision tower's last
    block (features are the second-to-last block's) and its final norms and heads."""
    prefixes = []
    backbone = getattr(model, "vision_backbone", None)
    for tower in ("featurizer", "fused_featurizer"):
        vit = getattr(backbone, tower, None)
        if vit is not None:
            prefixes.append(f"vision_backbone.{tower}.blocks.{len(vit.blocks) - 1}.")
    return tuple(prefixes)


def is_unused(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module or parameter ``name`` belongs to a part the forward pass never runs."""
    return name.startswith(prefixes) or UNUSED.match(name + ".") is not None


def linear_layers(model: nn.Module) -> list[str]:
    """Full names of the ``nn.Linear`` layers the forward pass runs, in module order."""
    unused = unused_by_forward(model)
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and not is_unused(name, unused)]


def _llm_linear(model: nn.Module) -> list[str]:
    return [n for n in linear_layers(model) if n.startswith("language_model.model.layers.")]


# shorthand -> the full names it covers
TARGET_SETS: dict[str, Callable[[nn.Module], list[str]]] = {"all-linear": linear_layers, "llm-linear": _llm_linear}
assert tuple(TARGET_SETS) == LORA_SHORTHANDS


def resolve_targets(model: nn.Module, targets: str | list[str]) -> list[str]:
    """A shorthand or a list of names (full, or suffixes like ``q_proj``) -> full layer names.

    Raises ``KeyError`` for an unknown shorthand and ``ValueError`` naming the names that match no
    linear layer, with the model's linear layers listed.
    """
    if isinstance(targets, str):
        if targets not in TARGET_SETS:
            raise KeyError(
                f"unknown LoRA target shorthand {targets!r}; known: {', '.join(sorted(TARGET_SETS))} (or a list of layer names)"
            )
        return TARGET_SETS[targets](model)
    layers = linear_layers(model)
    found, unknown = set(), []
    for target in targets:
        hits = [n for n in layers if n == target or n.endswith("." + target)]
        if not hits:
            unknown.append(target)
        found.update(hits)
    if unknown:
        kinds = Counter(n.rsplit(".", 1)[-1] for n in layers)
        listing = ", ".join(f"{k} (x{c})" for k, c in sorted(kinds.items()))
        raise ValueError(
            f"LoRA target module(s) {unknown} match no linear layer of this model. Its linear layers, by name "
            f"(use a name, a dotted suffix or a full name such as {layers[0]!r}): {listing}; "
            f"shorthands: {', '.join(sorted(TARGET_SETS))}"
        )
    return [n for n in layers if n in found]


def apply_lora(model: nn.Module, cfg: LoraSettings) -> PeftModel:
    """Wrap ``model``'s target layers with peft LoRA adapters in place; every other weight is frozen.

    Returns the ``PeftModel`` (``save_pretrained`` writes ``adapter_config.json`` +
    ``adapter_model.safetensors``); ``model`` itself keeps working with the adapters active.
    """
    from peft import LoraConfig, get_peft_model  # here: peft (and transformers) cost a run without LoRA ~2 s to import

    targets = resolve_targets(model, cfg.target_modules)
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        init_lora_weights="gaussian" if cfg.init == "gaussian" else True,
        bias="none",
    )
    return get_peft_model(model, config)
