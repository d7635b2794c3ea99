"""``make_tiny_openvla``: a tiny random OpenVLA checkpoint in exactly the upstream directory layout.

Real safetensors (bf16 like upstream, optionally sharded with an index), timm ViTs under the real
parameter names with the real ``vision_backbone_id``/timm ids, ``config.json`` with every upstream key
(sizes the shapes cannot tell go into our extra keys), ``preprocessor_config.json`` (bf16-rounded DINO
constants, as upstream's conversion wrote them), ``processor_config.json``, ``generation_config.json``
and a LLaMA-2-layout tokenizer. Small enough that one predict takes well under a second on a CPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from ..models.llama import LLAMA_CONFIGS, LlamaConfig
from ..models.prismatic.configuration_prismatic import OpenVLAConfig
from ..models.prismatic.configuration_vision import ProjectorConfig, TIMM_VITS, VisionConfig, backbone_spec
from ..models.prismatic.modeling_prismatic import PrismaticVLM
from ..models.prismatic.processing_prismatic import ImageProcessor, TowerTransform
from .llama_tokenizer import build_llama_tokenizer, save_llama_tokenizer
from .safetensors_io import save_safetensors

# tiny tower geometry per timm id: embed_dim, depth, num_heads (mlp keeps the real ratio)
TINY_TOWERS: dict[str, tuple[int, int, int]] = {
    "vit_large_patch14_reg4_dinov2.lvd142m": (32, 3, 2),
    "vit_so400m_patch14_siglip_224": (48, 3, 3),
    "vit_so400m_patch14_siglip_384": (48, 3, 3),
    "vit_large_patch14_clip_224.openai": (32, 3, 2),
    "vit_large_patch14_clip_336.openai": (32, 3, 2),
    "vit_large_patch16_224.augreg_in21k_ft_in1k": (32, 3, 2),
}

# BOUNDS_Q99 statistics of `bridge_orig` as the openvla-7b config.json carries them (q01/q99/mask);
# the other fields are filled consistently.
BRIDGE_ACTION = {
    "mask": [True, True, True, True, True, True, False],
    "q01": [-0.02872725307941437, -0.04170349963009357, -0.026093858778476715, -0.08092105075716972,
            -0.09288699507713317, -0.20718276381492615, 0.0],
    "q99": [0.028309678435325586, 0.040855254605412394, 0.040161586627364146, 0.08192047759890528,
            0.07792850524187081, 0.20382574498653397, 1.0],
}  # fmt: skip


def tiny_norm_stats(*, action_dim: int = 7, proprio_dim: int | None = None, datasets: tuple[str, ...] = ("bridge_orig",)) -> dict:
    """``norm_stats`` in upstream's structure; ``bridge_orig`` gets its real action bounds."""
    out = {}
    for i, name in enumerate(datasets):
        if name == "bridge_orig" and action_dim == 7:
            q01, q99, mask = BRIDGE_ACTION["q01"], BRIDGE_ACTION["q99"], BRIDGE_ACTION["mask"]
        else:
            q01 = [-0.05 * (i + 1) * (d + 1) for d in range(action_dim - 1)] + [0.0]
            q99 = [0.04 * (i + 1) * (d + 1) for d in range(action_dim - 1)] + [1.0]
            mask = [True] * (action_dim - 1) + [False]
        action = {
            "mask": mask, "max": [1.2 * x for x in q99], "mean": [(a + b) / 2 for a, b in zip(q01, q99)],
            "min": [1.2 * x for x in q01], "q01": q01, "q99": q99, "std": [(b - a) / 4 for a, b in zip(q01, q99)],
        }  # fmt: skip
        p = proprio_dim or 7
        lo, hi = ([-1.0 - 0.1 * d for d in range(p)], [1.0 + 0.1 * d for d in range(p)]) if proprio_dim else ([0.0] * p, [0.0] * p)
        proprio = {"max": hi, "mean": [0.0] * p, "min": lo, "q01": lo, "q99": hi, "std": [0.5 if proprio_dim else 0.0] * p}
        out[name] = {"action": action, "num_transitions": 1000 * (i + 1), "num_trajectories": 10 * (i + 1), "proprio": proprio}
    return out


def tiny_openvla_config(
    *,
    image_size: int = 56,
    vision_backbone_id: str = "dinosiglip-vit-so-224px",
    llm: LlamaConfig | None = None,
    proprio_dim: int | None = None,
    norm_stats: dict | None = None,
) -> OpenVLAConfig:
    """The tiny model's configuration (real ids, tiny sizes)."""
    spec = backbone_spec(vision_backbone_id)
    towers = []
    for timm_id, act in zip(spec.timm_ids, spec.act_overrides):
        dim, depth, heads = TINY_TOWERS[timm_id]
        base = TIMM_VITS[timm_id]
        hidden = int(dim * base.mlp_hidden / base.embed_dim)
        towers.append(replace(base, image_size=image_size, embed_dim=dim, depth=depth, num_heads=heads, mlp_hidden=hidden, act=act or "gelu"))
    vision = VisionConfig(vision_backbone_id, tuple(towers), "resize-naive")
    llm = llm or LLAMA_CONFIGS["tiny"]
    fused = vision.fused
    return OpenVLAConfig(
        vision=vision,
        projector=ProjectorConfig(vision.embed_dim, llm.dim, fused),
        llm=llm,
        proprio_dim=proprio_dim,
        norm_stats=tiny_norm_stats(proprio_dim=proprio_dim) if norm_stats is None else norm_stats,
        llm_backbone_id="llama2-7b-pure",
        arch_specifier="no-align+fused-gelu-mlp" if fused else "no-align+gelu-mlp",
    )


def randomize_(model: PrismaticVLM, generator: torch.Generator) -> None:
    """Random weights with useful scales: unit-ish activations, LayerScale ~ 0.5..1, norms ~ 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "scale_factor":
                p.copy_(0.5 + 0.5 * torch.rand(p.shape, generator=generator))
            elif p.ndim == 1 and "norm" in name and leaf == "weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif p.ndim == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
            elif leaf in ("cls_token", "reg_token", "pos_embed", "latent"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            else:  # weights [out, in, ...]; embeddings [vocab, dim]
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))


def bf16_rounded(values: tuple[float, ...]) -> tuple[float, ...]:
    """What upstream's conversion (run under ``torch.set_default_dtype(torch.bfloat16)``) stored."""
    return tuple(torch.tensor(values, dtype=torch.bfloat16).float().tolist())


def make_tiny_openvla(
    out: str | Path,
    *,
    seed: int = 0,
    image_size: int = 56,
    vision_backbone_id: str = "dinosiglip-vit-so-224px",
    proprio_dim: int | None = None,
    norm_stats: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
    llm: LlamaConfig | None = None,
) -> Path:
    """Write a tiny random OpenVLA checkpoint directory to ``out`` and return its path (``llm``: another
    decoder geometry than ``LLAMA_CONFIGS["tiny"]``, e.g. for benchmarks)."""
    out = Path(out)
    cfg = tiny_openvla_config(
        image_size=image_size, vision_backbone_id=vision_backbone_id, llm=llm, proprio_dim=proprio_dim, norm_stats=norm_stats
    )
    generator = torch.Generator().manual_seed(seed)
    model = PrismaticVLM(cfg)
    randomize_(model, generator)
    save_safetensors({k: v.to(dtype) for k, v in model.state_dict().items()}, out, max_shard_bytes=max_shard_bytes)
    torch_dtype = str(dtype).removeprefix("torch.")
    processor = ImageProcessor(
        tuple(TowerTransform(t.image_size, bf16_rounded(t.mean), bf16_rounded(t.std)) for t in cfg.vision.towers),
        cfg.vision.image_resize_strategy,
    )
    files = {
        "config.json": cfg.to_hf(torch_dtype=torch_dtype),
        "preprocessor_config.json": processor.to_hf(cfg.vision),
        "processor_config.json": {
            "auto_map": {"AutoProcessor": "processing_prismatic.PrismaticProcessor"},
            "processor_class": "PrismaticProcessor",
        },
        "generation_config.json": {
            "_from_model_config": True,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "transformers_version": "4.40.1",
        },
    }
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    save_llama_tokenizer(build_llama_tokenizer(), out, model_max_length=cfg.llm_max_length)
    return out
