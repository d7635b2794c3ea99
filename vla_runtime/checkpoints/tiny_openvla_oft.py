"""``make_tiny_openvla_oft``: a tiny random OpenVLA-OFT checkpoint in upstream's on-disk layout.

The OpenVLA part is ``make_tiny_openvla``'s; beside it, as upstream's ``vla-scripts/finetune.py`` saves
them, ``action_head--{step}_checkpoint.pt`` and ``proprio_projector--{step}_checkpoint.pt`` (``torch.save``
of the DDP-wrapped modules' state dicts, so every key starts with ``module.``) and
``dataset_statistics.json`` (action and proprio statistics of one dataset).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..models.llama import LLAMA_CONFIGS, LlamaConfig
from ..models.openvla.modeling_openvla import ProprioProjector
from ..models.openvla_oft.configuration_oft import ACTION_HEAD, PLATFORMS, PROPRIO_PROJECTOR, OFTConfig, OFTPlatform
from ..models.openvla_oft.modeling_oft import L1RegressionActionHead
from .openvla_oft import DDP_PREFIX
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
) -> Path:
    """Write a tiny random OFT checkpoint directory for ``platform``'s sizes and return its path.

    proprio: write a proprio projector (the platform's proprio size). step: the training step in the
    component file names. llm: another decoder geometry than ``LLAMA_CONFIGS["tiny"]``.
    """
    out = Path(out)
    constants = PLATFORMS[platform]
    llm = llm or LLAMA_CONFIGS["tiny"]
    stats = tiny_norm_stats(action_dim=constants.action_dim, proprio_dim=constants.proprio_dim, datasets=(TINY_DATASETS[platform],))
    make_tiny_openvla(out, seed=seed, image_size=image_size, norm_stats=stats, dtype=dtype, llm=llm)
    (out / "dataset_statistics.json").write_text(json.dumps(stats, indent=2) + "\n")
    cfg = OFTConfig(llm.dim, constants.action_dim, constants.chunk_size, constants.proprio_dim if proprio else None)
    generator = torch.Generator().manual_seed(seed + 1)
    head = L1RegressionActionHead(cfg)
    _randomize(head, generator)
    _save_component(head, out / f"{ACTION_HEAD}--{step}_checkpoint.pt", dtype)
    if proprio:
        projector = ProprioProjector(constants.proprio_dim, llm.dim)
        _randomize(projector, generator)
        _save_component(projector, out / f"{PROPRIO_PROJECTOR}--{step}_checkpoint.pt", dtype)
    return out
