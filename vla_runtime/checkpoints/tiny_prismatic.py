"""Tiny random CogACT and HybridVLA runs in the upstream run-directory layout.

    <out>/config.json                 the training config as upstream's draccus dump writes it
    <out>/dataset_statistics.json     bridge_orig (CogACT) / rlbench with proprio (HybridVLA)
    <out>/checkpoints/step-000000-epoch-00-loss=0.0000.pt   {"model": {module: state_dict}}
    <out>/tokenizer.json (+ tokenizer_config.json, ...)     the LLaMA-2-layout tokenizer (see below)

The VLM is the tiny OpenVLA geometry (fused DINOv2 + SigLIP timm towers, LLaMA decoder) under the
Prismatic module names (``dino_featurizer``, ``projector.0``, ``llm.model``, LayerScale ``gamma``).
Sizes the shapes cannot tell go into our extra config keys (``vision_num_heads``, ``llm_config``,
``action_model_num_heads``). Upstream runs carry no tokenizer (upstream downloads LLaMA-2's); the tiny
run ships its own so that it loads offline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.cogact.configuration_cogact import DiTConfig
from ..models.cogact.modeling_cogact import ActionModel
from ..models.hybridvla.configuration_hybridvla import DiffusionHeadConfig
from ..models.hybridvla.modeling_hybridvla import DiffusionHead
from ..models.llama import LlamaConfig
from ..models.prismatic.configuration_prismatic import OpenVLAConfig
from ..models.prismatic.modeling_prismatic import PrismaticVLM
from .llama_tokenizer import build_llama_tokenizer, save_llama_tokenizer
from .prismatic_run import save_run
from .prismatic_vlm import prismatic_modules
from .tiny_openvla import randomize_, tiny_norm_stats, tiny_openvla_config

BASE_VLM = "prism-dinosiglip-224px+7b"


def _train_config(vla_id: str, *, future_window: int, action_dim: int, extra: dict) -> dict:
    """The fields of upstream's ``TrainConfig`` dump (values of a small fine-tuning run)."""
    return {
        "vla": {
            "type": vla_id, "vla_id": vla_id, "base_vlm": BASE_VLM, "freeze_vision_backbone": False,
            "freeze_llm_backbone": False, "unfreeze_last_llm_layer": False, "data_mix": "bridge",
            "shuffle_buffer_size": 256000, "epochs": 100, "max_steps": None, "expected_world_size": 8,
            "global_batch_size": 256, "per_device_batch_size": 32, "learning_rate": 2e-05, "weight_decay": 0.0,
            "max_grad_norm": 1.0, "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
            "train_strategy": "fsdp-full-shard", "enable_gradient_checkpointing": True,
            "enable_mixed_precision_training": True, "reduce_in_full_precision": True,
        },
        "data_root_dir": "datasets/open-x-embodiment", "run_root_dir": "runs", "pretrained_checkpoint": None,
        "is_resume": True, "resume_step": None, "resume_epoch": None, "run_id": f"tiny+{vla_id}", "run_id_note": None,
        "save_interval": 2500, "image_aug": False, "seed": 42, "hf_token": ".hf_token", "trackers": ["jsonl"],
        "wandb_project": "", "wandb_entity": "", "repeated_diffusion_steps": 4, "load_all_data_for_training": True,
        "future_action_window_size": future_window, "past_action_window_size": 0, "action_dim": action_dim,
        **extra,
    }  # fmt: skip


def _size_keys(cfg: OpenVLAConfig) -> dict:
    """Our extra keys for what the shapes of a tiny VLM cannot tell."""
    return {
        "vision_num_heads": [t.num_heads for t in cfg.vision.towers],
        "llm_config": {k: v for k, v in cfg.llm.to_hf().items() if k != "vocab_size"},
    }


def _tiny_vlm(
    seed: int, image_size: int, norm_stats: dict, llm: LlamaConfig | None
) -> tuple[OpenVLAConfig, PrismaticVLM, torch.Generator]:
    cfg = tiny_openvla_config(image_size=image_size, llm=llm, norm_stats=norm_stats)
    generator = torch.Generator().manual_seed(seed)
    model = PrismaticVLM(cfg)
    randomize_(model, generator)
    return cfg, model, generator


def _write(out: Path, *, config: dict, norm_stats: dict, modules: dict, dtype: torch.dtype) -> Path:
    out = Path(out)
    save_run(out, config=config, norm_stats=norm_stats, modules={
        name: {k: v.to(dtype) for k, v in sd.items()} for name, sd in modules.items()
    })  # fmt: skip
    save_llama_tokenizer(build_llama_tokenizer(), out)
    return out


def make_tiny_cogact(
    out: str | Path,
    *,
    seed: int = 0,
    image_size: int = 56,
    dtype: torch.dtype = torch.float32,
    llm: LlamaConfig | None = None,
) -> Path:
    """A tiny random CogACT run (DiT ``tiny``: width 32, depth 2, 2 heads; chunk 16 x 7).
    ``llm``: another decoder geometry than ``LLAMA_CONFIGS["tiny"]`` (benchmarks)."""
    norm_stats = tiny_norm_stats()
    cfg, vlm, generator = _tiny_vlm(seed, image_size, norm_stats, llm)
    dit = DiTConfig.from_name("tiny", token_size=cfg.llm.dim)
    action_model = ActionModel(dit)
    randomize_(action_model, generator)
    config = _train_config(
        "prism-dinosiglip-224px+oxe+diffusion",
        future_window=dit.future_window,
        action_dim=dit.action_dim,
        extra={"action_model_type": "DiT-tiny", "use_ema": False, "action_model_num_heads": dit.heads, **_size_keys(cfg)},
    )
    modules = {**prismatic_modules(vlm.state_dict()), "action_model": action_model.state_dict()}
    return _write(Path(out), config=config, norm_stats=norm_stats, modules=modules, dtype=dtype)


def hybridvla_norm_stats(action_dim: int = 7) -> dict:
    """``rlbench`` statistics with action and proprio masks (6 x True + gripper False), as current upstream writes."""
    stats = tiny_norm_stats(action_dim=action_dim, proprio_dim=action_dim, datasets=("rlbench",))
    stats["rlbench"]["proprio"]["mask"] = [True] * (action_dim - 1) + [False]
    return stats


def make_tiny_hybridvla(
    out: str | Path,
    *,
    seed: int = 0,
    image_size: int = 56,
    future_window: int = 0,
    need_to_sub: int = 0,
    dtype: torch.dtype = torch.float32,
    llm: LlamaConfig | None = None,
) -> Path:
    """A tiny random HybridVLA run (diffusion modules at the LLM's width, ``use_diff`` on)."""
    norm_stats = hybridvla_norm_stats()
    cfg, vlm, generator = _tiny_vlm(seed, image_size, norm_stats, llm)
    head = DiffusionHead(DiffusionHeadConfig(dim=cfg.llm.dim, future_window=future_window))
    randomize_(head, generator)
    config = _train_config(
        "prism-dinosiglip-224px+rlbench+hybrid",
        future_window=future_window,
        action_dim=7,
        extra={"class_dropout_prob": 0.0, "action_tokenizer_exist": True, "use_diff": True, "ar_diff_loss": True,
               "need_to_sub": need_to_sub, **_size_keys(cfg)},  # fmt: skip
    )
    modules = {**prismatic_modules(vlm.state_dict()), **head.module_state_dicts()}
    return _write(Path(out), config=config, norm_stats=norm_stats, modules=modules, dtype=dtype)
