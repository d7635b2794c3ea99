"""``make_tiny_openvla_oft``: a tiny random OpenVLA-OFT checkpoint in upstream's on-disk layout.

The OpenVLA part is ``make_tiny_openvla``'s; beside it, as upstream's ``vla-scripts/finetune.py`` saves
them, ``action_head--{step}_checkpoint.pt`` and ``proprio_projector--{step}_checkpoint.pt`` (``torch.save``
of the DDP-wrapped modules' state dicts, so every key starts with ``module.``) and
``dataset_statistics.json`` (action and proprio statistics of one dataset). ``film=True`` adds
``vision_backbone--{step}_checkpoint.pt`` as upstream saves it for OFT+ (``openvla_oft_film``'s layout:
the whole FiLM-wrapped backbone, every ViT linear as a LoRA ``base_layer`` + ``lora_A/B`` of rank 4);
``diffusion=True`` writes the diffusion variant (``noise_predictor.*`` head + ``noisy_action_projector--*``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..models.llama import LLAMA_CONFIGS, LlamaConfig
from ..models.prismatic.modeling_prismatic import ProprioProjector
from ..models.openvla_oft.configuration_oft import (
    ACTION_HEAD,
    NOISY_ACTION_PROJECTOR,
    PLATFORMS,
    PROPRIO_PROJECTOR,
    VISION_BACKBONE,
    OFTConfig,
    OFTPlatform,
)
from ..models.openvla_oft.diffusion_oft import DiffusionActionHead, NoisyActionProjector
from ..models.openvla_oft.film import VisionFiLM
from ..models.openvla_oft.modeling_oft import L1RegressionActionHead
from .openvla import load_openvla
from .openvla_oft import DDP_PREFIX
from .openvla_oft_film import BASE, LORA_A, LORA_B, PREFIX
from .tiny_openvla import make_tiny_openvla, tiny_norm_stats

TINY_DATASETS = {OFTPlatform.LIBERO: "libero_spatial_no_noops", OFTPlatform.BRIDGE: "bridge_orig", OFTPlatform.ALOHA: "aloha_tiny"}


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Norm weights ~1, biases ~0.02, weights ~ N(0, 1 / fan_in)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):  # LayerNorm
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif p.ndim == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[1]))


def _save_component(module: torch.nn.Module, file: Path, dtype: torch.dtype) -> None:
    torch.save({DDP_PREFIX + k: v.to(dtype).contiguous() for k, v in module.state_dict().items()}, file)


def upstream_film_state(
    vision_backbone: torch.nn.Module, film: VisionFiLM, *, lora_rank: int | None, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Our vision backbone + FiLM layers -> upstream's ``FiLMedPrismaticVisionBackbone.state_dict()`` keys
    (no ``module.``); ``lora_rank``: every ``nn.Linear`` as PEFT saves it, ``base_layer`` = our weights and
    random ``lora_A`` [r, in] / ``lora_B`` [out, r] (so the merged weights differ from ours)."""
    linears = {name: m for name, m in vision_backbone.named_modules() if isinstance(m, torch.nn.Linear)}

    def upstream(name: str) -> str:  # wrapped blocks: {tower}.blocks.{i}.X -> {tower}.blocks.{i}.block.X
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "blocks":
            parts.insert(3, "block")
        return PREFIX + ".".join(parts)

    state = {}
    for key, value in vision_backbone.state_dict().items():
        owner, _, param = key.rpartition(".")
        if lora_rank is not None and owner in linears:
            state[upstream(owner) + BASE + param] = value
            if param == "weight":
                out_features, in_features = value.shape
                state[upstream(owner) + LORA_A] = torch.randn(lora_rank, in_features, generator=generator) / math.sqrt(in_features)
                state[upstream(owner) + LORA_B] = 0.1 * torch.randn(out_features, lora_rank, generator=generator) / math.sqrt(lora_rank)
        else:
            state[upstream(key)] = value
    for key, value in film.state_dict().items():  # towers.{tower}.{i}.scale.weight -> {tower}.blocks.{i}.scale.weight
        _, tower, index, rest = key.split(".", 3)
        state[f"{PREFIX}{tower}.blocks.{index}.{rest}"] = value
    return state


def make_tiny_openvla_oft(
    out: str | Path,
    *,
    seed: int = 0,
    image_size: int = 56,
    platform: OFTPlatform = OFTPlatform.LIBERO,
    proprio: bool = True,
    step: int = 150000,
    dtype: torch.dtype = torch.bfloat16,
    llm: LlamaConfig | None = None,
    film: bool = False,
    film_lora_rank: int | None = 4,
    diffusion: bool = False,
) -> Path:
    """Write a tiny random OFT checkpoint directory for ``platform``'s sizes and return its path.

    proprio: write a proprio projector (the platform's proprio size). step: the training step in the
    component file names. llm: another decoder geometry than ``LLAMA_CONFIGS["tiny"]``. film: write a FiLM
    vision backbone (OFT+), its linears as LoRA layers of ``film_lora_rank`` (``None``: plain weights).
    diffusion: the diffusion variant: a ``DiffusionActionHead`` as ``action_head--*`` and
    ``noisy_action_projector--{step}_checkpoint.pt``.
    """
    out = Path(out)
    constants = PLATFORMS[platform]
    llm = llm or LLAMA_CONFIGS["tiny"]
    stats = tiny_norm_stats(action_dim=constants.action_dim, proprio_dim=constants.proprio_dim, datasets=(TINY_DATASETS[platform],))
    make_tiny_openvla(out, seed=seed, image_size=image_size, norm_stats=stats, dtype=dtype, llm=llm)
    (out / "dataset_statistics.json").write_text(json.dumps(stats, indent=2) + "\n")
    cfg = OFTConfig(llm.dim, constants.action_dim, constants.chunk_size, constants.proprio_dim if proprio else None)
    generator = torch.Generator().manual_seed(seed + 1)
    head = DiffusionActionHead(cfg) if diffusion else L1RegressionActionHead(cfg)
    _randomize(head, generator)
    _save_component(head, out / f"{ACTION_HEAD}--{step}_checkpoint.pt", dtype)
    if diffusion:
        noisy = NoisyActionProjector(llm.dim)
        _randomize(noisy, generator)
        _save_component(noisy, out / f"{NOISY_ACTION_PROJECTOR}--{step}_checkpoint.pt", dtype)
    if proprio:
        projector = ProprioProjector(constants.proprio_dim, llm.dim)
        _randomize(projector, generator)
        _save_component(projector, out / f"{PROPRIO_PROJECTOR}--{step}_checkpoint.pt", dtype)
    if film:
        backbone = load_openvla(out, dtype=torch.float32).model.vision_backbone
        layers = VisionFiLM(backbone, llm.dim)
        _randomize(layers, generator)
        state = upstream_film_state(backbone, layers, lora_rank=film_lora_rank, generator=generator)
        torch.save({DDP_PREFIX + k: v.to(dtype).contiguous() for k, v in state.items()}, out / f"{VISION_BACKBONE}--{step}_checkpoint.pt")
    return out
