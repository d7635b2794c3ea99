"""The Prismatic VLM of a run directory (CogACT, HybridVLA): configuration, weights, tokenizer.

The VLM modules (``vision_backbone``, ``projector``, ``llm_backbone``) map onto the shared Prismatic
module tree (``models.prismatic.modeling_prismatic.PrismaticVLM``) through ``checkpoints.openvla.hf_name``. The geometry comes
from ``vla.base_vlm`` (upstream's model registry), the tensor shapes, and -- for what shapes cannot
tell in tiny runs -- our extra config.json keys ``vision_num_heads`` and ``llm_config``. Nothing is
ever downloaded: a checkpoint without its vision tower is an error, and the LLaMA-2 tokenizer (which
upstream fetches from the Hub) must sit in the run directory as ``tokenizer.json`` or be passed in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.llama import LlamaConfig
from ..models.prismatic.configuration_prismatic import OpenVLAConfig
from ..models.prismatic.configuration_vision import (
    ProjectorConfig,
    TIMM_VITS,
    TOWER_PREFIXES,
    VisionConfig,
    backbone_spec,
)
from ..models.prismatic.modeling_prismatic import PrismaticVLM
from ..models.prismatic.processing_prismatic import ImageProcessor
from ..models.prismatic.prompt_prismatic import PromptTokenizer
from .openvla import PROGRESS_MIN_BYTES, UNUSED, hf_name
from .prismatic_run import PrismaticRun

VLM_MODULES = ("vision_backbone", "projector", "llm_backbone")
TOKENIZER_FILE = "tokenizer.json"

# upstream's Prismatic registry (conf/models.py) for the base VLMs our families run on
PRISMATIC_VLMS: dict[str, dict[str, str]] = {
    "prism-dinosiglip-224px+7b": {
        "vision_backbone_id": "dinosiglip-vit-so-224px",
        "llm_backbone_id": "llama2-7b-pure",
        "image_resize_strategy": "resize-naive",
        "arch_specifier": "no-align+fused-gelu-mlp",
    },
}
# the base LLM's own config.json (meta-llama/Llama-2-7b-hf): upstream builds the LLM from it, so eps is
# 1e-5 here (the HF OpenVLA port runs 1e-6); the vocabulary comes from the checkpoint (32064 rows)
PRISMATIC_LLMS: dict[str, dict] = {
    "llama2-7b-pure": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    },
}  # fmt: skip


def vlm_state(modules: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The VLM modules' tensors under our (HF OpenVLA) names: ``{module}.{key}`` through ``hf_name``."""
    return {hf_name(f"{m}.{k}"): v for m in VLM_MODULES if m in modules for k, v in modules[m].items()}


_TO_PRISMATIC: tuple[tuple[str, str, str], ...] = (  # HF prefix -> (module, key prefix)
    ("vision_backbone.featurizer.", "vision_backbone", "dino_featurizer."),
    ("vision_backbone.fused_featurizer.", "vision_backbone", "siglip_featurizer."),
    ("projector.fc1.", "projector", "projector.0."),
    ("projector.fc2.", "projector", "projector.2."),
    ("projector.fc3.", "projector", "projector.4."),
    ("language_model.", "llm_backbone", "llm."),
)


def prismatic_modules(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Our VLM state dict -> the checkpoint's ``{module: state_dict}`` (LayerScale back to ``gamma``)."""
    out: dict[str, dict[str, torch.Tensor]] = {m: {} for m in VLM_MODULES}
    for name, tensor in state.items():
        for prefix, module, key in _TO_PRISMATIC:
            if name.startswith(prefix):
                out[module][re.sub(r"\.(ls[12])\.scale_factor$", r".\1.gamma", key + name[len(prefix) :])] = tensor
                break
        else:
            raise ValueError(f"`{name}` is not a Prismatic VLM tensor")
    return out


def _tower(timm_id: str, shapes: Mapping[str, tuple[int, ...]], num_heads: int | None):
    """A tower's config from its tensor shapes; the input size follows from ``pos_embed`` and the patch size."""
    base = TIMM_VITS[timm_id]
    for name in ("patch_embed.proj.weight", "pos_embed"):
        if name not in shapes:
            raise ValueError(f"vision tower {timm_id}: tensor `{name}` is missing from the checkpoint")
    patch = shapes["patch_embed.proj.weight"][2]
    prefix = int("cls_token" in shapes) + (shapes["reg_token"][1] if "reg_token" in shapes else 0)
    positions = shapes["pos_embed"][1] - (0 if base.no_embed_class else prefix)
    side = math.isqrt(positions)
    if side * side != positions:
        raise ValueError(f"vision tower {timm_id}: `pos_embed` holds {positions} patch positions, not a square grid")
    return replace(base, image_size=side * patch).with_weights(shapes, num_heads=num_heads)


def vlm_config(config: dict, norm_stats: dict, shapes: Mapping[str, tuple[int, ...]]) -> OpenVLAConfig:
    """The Prismatic VLM of a run: ``vla.base_vlm`` from ``config.json``, sizes from the tensor ``shapes``
    (our names). Extra keys for non-standard (tiny) sizes: ``vision_num_heads`` [per tower] and ``llm_config``
    (a transformers-style LLaMA config dict)."""
    base_vlm = (config.get("vla") or {}).get("base_vlm")
    if base_vlm is None:
        raise KeyError("config.json has no `vla.base_vlm` (the Prismatic VLM the run was trained from)")
    if base_vlm not in PRISMATIC_VLMS:
        raise ValueError(f"base VLM {base_vlm!r} is not supported; supported: {', '.join(sorted(PRISMATIC_VLMS))}")
    entry = PRISMATIC_VLMS[base_vlm]
    spec = backbone_spec(entry["vision_backbone_id"])
    heads = config.get("vision_num_heads") or [None] * len(spec.timm_ids)
    towers = []
    for i, timm_id in enumerate(spec.timm_ids):
        sub = {k[len(TOWER_PREFIXES[i]) :]: v for k, v in shapes.items() if k.startswith(TOWER_PREFIXES[i])}
        if not sub:
            raise ValueError(f"the checkpoint has no weights for vision tower {i} ({timm_id})")
        towers.append(_tower(timm_id, sub, heads[i]))
    vision = VisionConfig(entry["vision_backbone_id"], tuple(towers), entry["image_resize_strategy"])
    embed = shapes.get("language_model.model.embed_tokens.weight")
    if embed is None:
        raise ValueError("the checkpoint has no `llm.model.embed_tokens.weight` in `llm_backbone`")
    llm = LlamaConfig.from_hf({**(config.get("llm_config") or PRISMATIC_LLMS[entry["llm_backbone_id"]]), "vocab_size": embed[0]},
                              where="config.json llm_config")
    if llm.dim != embed[1]:
        raise ValueError(f"LLM width {embed[1]} in the checkpoint, but the configuration says {llm.dim}")
    return OpenVLAConfig(
        vision=vision,
        projector=ProjectorConfig(vision.embed_dim, llm.dim, vision.fused),
        llm=llm,
        norm_stats=norm_stats,
        llm_backbone_id=entry["llm_backbone_id"],
        arch_specifier=entry["arch_specifier"],
    )


def load_vlm(
    run: PrismaticRun,
    modules: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PrismaticVLM:
    """Build the run's VLM and load its weights (``device="meta"``: structure only, nothing read)."""
    run.require(
        modules,
        VLM_MODULES,
        why="The vision tower, projector and LLM must all be in the checkpoint: this runtime never downloads "
        "weights (upstream silently falls back to timm's pretrained towers when `vision_backbone` is absent)",
    )
    state = vlm_state(modules)
    cfg = vlm_config(run.config, run.norm_stats, {k: tuple(v.shape) for k, v in state.items()})
    with torch.device("meta"):
        model = PrismaticVLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if not_float := [k for k, v in state.items() if not v.is_floating_point()]:
        raise ValueError(f"{run.checkpoint}: VLM tensor `{not_float[0]}` is {state[not_float[0]].dtype}; expected a floating-point weight")
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(k for k in set(expected) - set(state) if not UNUSED.match(k))
    if unexpected or missing:
        raise ValueError(
            f"{run.checkpoint}: the VLM weights do not match {cfg.vision.backbone_id} + {cfg.llm_backbone_id}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
        )
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ValueError(f"{run.checkpoint}: `{name}` has shape {list(state[name].shape)}, expected {list(shape)}")
    if torch.device(device).type != "meta":
        total = sum(v.numel() for v in state.values()) * torch.empty((), dtype=dtype).element_size()
        weights = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < PROGRESS_MIN_BYTES) as bar:
            for name, tensor in state.items():  # memory-mapped: each tensor is read as it is placed
                weights[name] = tensor.to(device=device, dtype=dtype)
                bar.update(weights[name].numel() * weights[name].element_size())
        for name in set(expected) - set(weights):  # unused by the forward pass and absent: zeros
            weights[name] = torch.zeros(expected[name], device=device, dtype=dtype)
        model.load_state_dict(weights, strict=True, assign=True)
    return model.eval()


def load_tokenizer(run: PrismaticRun, cfg: OpenVLAConfig, tokenizer: str | Path | None = None) -> PromptTokenizer:
    """The LLaMA-2 tokenizer: ``tokenizer`` (a directory or a ``tokenizer.json``) or the run's own copy."""
    where = Path(tokenizer) if tokenizer is not None else run.path
    directory = where.parent if where.name == TOKENIZER_FILE else where
    if not (directory / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(
            f"{directory / TOKENIZER_FILE} does not exist. Prismatic run directories do not ship the LLaMA-2 "
            "tokenizer (upstream downloads meta-llama/Llama-2-7b-hf); copy tokenizer.json from an OpenVLA "
            "checkpoint (e.g. openvla/openvla-7b) into the run directory or pass tokenizer=PATH"
        )
    tok = PromptTokenizer.from_pretrained_dir(directory, bos_id=cfg.bos_token_id)
    vocab = tok.tokenizer.get_vocab_size(with_added_tokens=False)
    if vocab != cfg.vocab_size_text:
        raise ValueError(f"{directory / TOKENIZER_FILE} has {vocab} tokens; the checkpoint's LLM expects {cfg.vocab_size_text}")
    return tok


def image_processor(cfg: OpenVLAConfig) -> ImageProcessor:
    """Upstream's transform for the run's towers (no preprocessor_config.json in run directories)."""
    return ImageProcessor.from_config(cfg.vision)


@dataclass
class PrismaticCheckpoint:
    """A run directory with its VLM loaded; ``modules`` keeps every module state dict (memory-mapped)
    for the family to take its head from."""

    run: PrismaticRun
    modules: dict[str, dict[str, torch.Tensor]]
    config: OpenVLAConfig
    vlm: PrismaticVLM
    tokenizer: PromptTokenizer
    image_processor: ImageProcessor


def load_prismatic(
    path: str | Path,
    *,
    checkpoint: str | Path | None = None,
    tokenizer: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PrismaticCheckpoint:
    """Open a run directory and load its Prismatic VLM (``device="meta"``: structure only)."""
    run = PrismaticRun.open(path, checkpoint=checkpoint)
    modules = run.modules()
    vlm = load_vlm(run, modules, device=device, dtype=dtype)
    return PrismaticCheckpoint(run, modules, vlm.cfg, vlm, load_tokenizer(run, vlm.cfg, tokenizer), image_processor(vlm.cfg))
