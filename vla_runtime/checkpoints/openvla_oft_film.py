"""FiLM (OFT+): ``vision_backbone--*checkpoint.pt`` onto our vision towers and ``OpenVLAOFT.film``.

Upstream (``vla-scripts/finetune.py``) saves the *whole* FiLM-wrapped vision backbone
(``FiLMedPrismaticVisionBackbone.state_dict()``), and ``experiments/robot/openvla_utils.py``
(``_apply_film_to_vla``) loads it strictly over the backbone, so it replaces the vision weights of the
merged checkpoint. Its keys, after the DDP ``module.`` prefix::

    vision_backbone.{tower}.blocks.{i}.block.<timm block param>   the wrapped block  -> {tower}.blocks.{i}.<param>
    vision_backbone.{tower}.blocks.{i}.scale|shift.weight|bias      FiLM [vision_dim, llm_dim] / [vision_dim]
    vision_backbone.{tower}.<other ViT param>                       patch_embed, pos_embed, norm, attn_pool, ...

with ``tower`` ``featurizer`` (and ``fused_featurizer``). Under LoRA (upstream's default, ``get_peft_model``
with ``target_modules="all-linear"`` before the FiLM wrap) every ViT ``nn.Linear`` ``X`` is saved as
``X.base_layer.weight|bias`` + ``X.lora_A.default.weight`` [r, in] + ``X.lora_B.default.weight`` [out, r];
we merge ``W = base + (alpha / r) B A`` with upstream's ``lora_alpha = min(r, 16)``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..models.openvla_oft.film import TOWERS

PREFIX = "vision_backbone."
BASE, LORA_A, LORA_B = ".base_layer.", ".lora_A.default.weight", ".lora_B.default.weight"
_FILM = re.compile(rf"^({'|'.join(TOWERS)})\.blocks\.(\d+)\.(scale|shift)\.(weight|bias)$")
_BLOCK = re.compile(rf"^({'|'.join(TOWERS)})\.blocks\.(\d+)\.block\.(.+)$")


def lora_scaling(rank: int) -> float:
    """Upstream's ``LoraConfig(r=rank, lora_alpha=min(rank, 16))`` (finetune.py, openvla_utils.py): alpha / r."""
    return min(rank, 16) / rank


def merge_vision_lora(state: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """``X.base_layer.*`` + ``X.lora_A/B.default.weight`` -> ``X.*`` with the LoRA delta merged (float32
    arithmetic, the base's dtype kept); a state without LoRA keys is returned as is."""
    out = {k: v for k, v in state.items() if BASE not in k and not k.endswith((LORA_A, LORA_B))}
    for key, base in state.items():
        if BASE not in key:
            continue
        owner, param = key.split(BASE)
        if param == "bias":
            out[f"{owner}.bias"] = base
            continue
        a_key, b_key = owner + LORA_A, owner + LORA_B
        if a_key not in state or b_key not in state:
            raise ValueError(f"{file.name}: `{key}` has no `{a_key}` / `{b_key}` beside it (a LoRA layer needs both)")
        a, b = state[a_key].float(), state[b_key].float()  # [r, in], [out, r]
        if a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise ValueError(f"{file.name}: LoRA of `{owner}` has A {list(a.shape)}, B {list(b.shape)} for a base {list(base.shape)}")
        out[f"{owner}.weight"] = (base.float() + lora_scaling(a.shape[0]) * (b @ a)).to(base.dtype)
    orphans = sorted(k for k in state if k.endswith((LORA_A, LORA_B)) and k.rsplit(".lora_", 1)[0] + BASE + "weight" not in state)
    if orphans:
        raise ValueError(f"{file.name}: LoRA weights without a `base_layer`: {orphans[:3]}")
    return out


def split_film_state(state: dict[str, torch.Tensor], file: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Upstream's FiLM vision-backbone state (``module.`` already stripped) -> (our ``vision_backbone`` state,
    our ``VisionFiLM`` state ``towers.{tower}.{i}.scale|shift.*``)."""
    foreign = sorted(k for k in state if not k.startswith(PREFIX))
    if foreign:
        raise ValueError(
            f"{file.name} is not a FiLM vision backbone: keys must start with `{PREFIX}` "
            f"(FiLMedPrismaticVisionBackbone.state_dict()), found {foreign[:3]}"
        )
    backbone: dict[str, torch.Tensor] = {}
    film: dict[str, torch.Tensor] = {}
    for key, value in merge_vision_lora({k.removeprefix(PREFIX): v for k, v in state.items()}, file).items():
        if m := _FILM.match(key):
            tower, index, which, param = m.groups()
            film[f"towers.{tower}.{index}.{which}.{param}"] = value
        elif m := _BLOCK.match(key):
            tower, index, rest = m.groups()
            backbone[f"{tower}.blocks.{index}.{rest}"] = value
        else:
            backbone[key] = value
    if not film:
        raise ValueError(f"{file.name} has no FiLM layers (`{PREFIX}featurizer.blocks.<i>.scale.weight`, ...)")
    return backbone, film


def upstream_key(key: str, *, film: bool) -> str:
    """Our name -> the file's (LoRA-merged) name, for errors: ``towers.{tower}.{i}.X`` (FiLM) ->
    ``vision_backbone.{tower}.blocks.{i}.X``; ``{tower}.blocks.{i}.X`` -> ``vision_backbone.{tower}.blocks.{i}.block.X``."""
    parts = key.split(".")
    if film:
        return f"{PREFIX}{parts[1]}.blocks.{'.'.join(parts[2:])}"
    if len(parts) > 3 and parts[1] == "blocks":
        parts.insert(3, "block")
    return PREFIX + ".".join(parts)


def check_film_state(
    backbone: torch.nn.Module, film: torch.nn.Module, vision_state: dict, film_state: dict, file: Path
) -> None:
    """The split state covers our vision backbone and FiLM layers exactly, with their shapes; the error names
    the file's keys (LoRA-merged: ``X.weight`` for ``X.base_layer.weight``) that are missing, unexpected or mis-shaped."""
    for module, state, is_film in ((backbone, vision_state, False), (film, film_state, True)):
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        missing = sorted(upstream_key(k, film=is_film) for k in set(expected) - set(state))
        unexpected = sorted(upstream_key(k, film=is_film) for k in set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{file.name} does not match this backbone's FiLM vision towers: missing {missing[:5] or 'none'}, "
                f"unexpected {unexpected[:5] or 'none'}"
            )
        for key, shape in expected.items():
            if tuple(state[key].shape) != shape:
                raise ValueError(f"{file.name}: `{upstream_key(key, film=is_film)}` has shape {list(state[key].shape)}; expected {list(shape)}")
