"""The Prismatic VLM (OpenVLA's whole model; the VLM under CogACT, HybridVLA and OpenVLA-OFT), native PyTorch
under the upstream parameter names.

``vision_backbone.featurizer`` (and ``.fused_featurizer``) are timm ``VisionTransformer``s with timm's
real module tree; LayerScale's ``gamma`` is named ``scale_factor`` as in the HF checkpoints. A tower's
features are the **second-to-last block's** patch tokens (no final norm, prefix tokens dropped), which
is what upstream's ``get_intermediate_layers(n={depth - 2})`` returns; the last block's output is never
used, so it is skipped. ``projector.fc1/fc2(/fc3)`` maps them to LLM embeddings, and
``language_model`` is our LLaMA decoder (``cache.attend`` seam). Weights only: no episode state here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn as nn
from timm.models.vision_transformer import VisionTransformer

from ...kv.base import KVCache
from ..llama import LlamaForCausalLM
from .configuration_prismatic import OpenVLAConfig
from .configuration_vision import ProjectorConfig, ViTConfig, VisionConfig
from .processing_prismatic import Forward, SegmentKind


class LayerScale(nn.Module):
    """timm's LayerScale with the HF checkpoints' parameter name ``scale_factor`` (was ``gamma``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale_factor = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_factor


def build_vit(cfg: ViTConfig) -> VisionTransformer:
    """A timm ViT with ``cfg``'s geometry, no classifier, LayerScale renamed; weights uninitialised."""
    vit = VisionTransformer(
        img_size=cfg.image_size,
        patch_size=cfg.patch_size,
        embed_dim=cfg.embed_dim,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        mlp_ratio=(cfg.mlp_hidden + 0.5) / cfg.embed_dim,  # timm takes int(dim * ratio) features
        class_token=cfg.class_token,
        reg_tokens=cfg.reg_tokens,
        no_embed_class=cfg.no_embed_class,
        init_values=1.0 if cfg.layer_scale else None,
        global_pool=cfg.global_pool,
        pre_norm=cfg.pre_norm,
        norm_layer=partial(nn.LayerNorm, eps=cfg.norm_eps),
        act_layer=cfg.act,
        num_classes=0,
        weight_init="skip",
    )
    if cfg.layer_scale:
        for block in vit.blocks:
            block.ls1, block.ls2 = LayerScale(cfg.embed_dim), LayerScale(cfg.embed_dim)
    return vit


def tower_features(vit: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """x: [B, 3, H, W] -> the second-to-last block's patch tokens [B, N, D] (no final norm, no prefix)."""
    x = vit.patch_embed(x)  # [B, N, D]
    x = vit._pos_embed(x)  # [B, prefix + N, D]
    x = vit.norm_pre(vit.patch_drop(x))
    for block in vit.blocks[:-1]:
        x = block(x)
    return x[:, vit.num_prefix_tokens :]  # [B, N, D]


class PrismaticVisionBackbone(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.featurizer = build_vit(cfg.towers[0])
        self.fused_featurizer = build_vit(cfg.towers[1]) if cfg.fused else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [B, 3 * towers, H, W] (DINO channels first) -> patch features [B, N, sum(D)]."""
        if self.fused_featurizer is None:
            return tower_features(self.featurizer, pixel_values)
        img, img_fused = torch.split(pixel_values, [3, 3], dim=1)  # [B, 3, H, W] each
        return torch.cat([tower_features(self.featurizer, img), tower_features(self.fused_featurizer, img_fused)], dim=2)


class PrismaticProjector(nn.Module):
    """Fused: fc1 -> GELU -> fc2 -> GELU -> fc3; single tower: fc1 -> GELU -> fc2 (exact-erf GELU)."""

    def __init__(self, cfg: ProjectorConfig) -> None:
        super().__init__()
        dims = cfg.dims
        self.fc1, self.act_fn1, self.fc2 = nn.Linear(dims[0], dims[1]), nn.GELU(), nn.Linear(dims[1], dims[2])
        self.act_fn2 = nn.GELU() if cfg.fused else None
        self.fc3 = nn.Linear(dims[2], dims[3]) if cfg.fused else None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features: [B, N, vision_dim] -> [B, N, llm_dim]."""
        x = self.fc2(self.act_fn1(self.fc1(features)))
        return x if self.fc3 is None else self.fc3(self.act_fn2(x))


class ProprioProjector(nn.Module):
    """Normalised proprioception -> one LLM token: fc1 -> GELU -> fc2 (ours, for trained demo models)."""

    def __init__(self, proprio_dim: int, llm_dim: int) -> None:
        super().__init__()
        self.fc1, self.act_fn1, self.fc2 = nn.Linear(proprio_dim, llm_dim), nn.GELU(), nn.Linear(llm_dim, llm_dim)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        """state: [B, P] -> [B, 1, llm_dim]."""
        return self.fc2(self.act_fn1(self.fc1(state)))[:, None]


class PrismaticVLM(nn.Module):
    """``vision_backbone`` + ``projector`` (+ ``proprio_projector``) + ``language_model``. OpenVLA decodes its
    action tokens with the LM head; CogACT, HybridVLA and OpenVLA-OFT put their own heads on it."""

    def __init__(self, cfg: OpenVLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_backbone = PrismaticVisionBackbone(cfg.vision)
        self.projector = PrismaticProjector(cfg.projector)
        self.language_model = LlamaForCausalLM(cfg.llm)
        self.proprio_projector = ProprioProjector(cfg.proprio_dim, cfg.llm.dim) if cfg.proprio_dim else None

    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [B, 3 * towers, H, W] -> image tokens [B, N, dim]."""
        return self.projector(self.vision_backbone(pixel_values))

    def embed_proprio(self, state: torch.Tensor) -> torch.Tensor:
        """state: [B, proprio_dim] (normalised) -> [B, 1, dim]."""
        if self.proprio_projector is None:
            raise ValueError("this checkpoint has no proprio projector (config.json `proprio_dim` is unset)")
        return self.proprio_projector(state)

    def embed_prefix(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, proprio: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stock OpenVLA input: image tokens right after BOS (then the proprio token, if any).

        pixel_values: [B, 3 * towers, H, W]; input_ids: [B, T] starting with BOS; proprio: [B, P].
        Returns [B, T + N (+ 1), dim].
        """
        text = self.language_model.model.embed_tokens(input_ids)  # [B, T, dim]
        parts = [text[:, :1], self.embed_image(pixel_values)]
        if proprio is not None:
            parts.append(self.embed_proprio(proprio))
        return torch.cat([*parts, text[:, 1:]], dim=1)

    def embed_forward(
        self, forward: Forward, *, images: Sequence[torch.Tensor], proprio: Sequence[torch.Tensor] = ()
    ) -> torch.Tensor:
        """Embeddings of one layout ``Forward`` (see ``processing_prismatic``).

        images[s]: image tokens [B, N, dim] of control step s; proprio[s]: [B, 1, dim]. Returns [B, T, dim].
        """
        embed = self.language_model.model.embed_tokens
        device = embed.weight.device
        parts = []
        for seg in forward.segments:
            if seg.kind is SegmentKind.TEXT:
                ids = torch.tensor([seg.ids], device=device)  # [1, t]
                parts.append(embed(ids).expand(images[0].shape[0] if images else 1, -1, -1))
            elif seg.kind is SegmentKind.IMAGE:
                parts.append(images[seg.step])
            else:
                parts.append(proprio[seg.step])
        return torch.cat(parts, dim=1)

    def forward(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        cache: KVCache,
        proprio: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Multimodal prefill. Returns float32 logits [B, T', vocab] (``[B, 1, vocab]`` with ``last_only``)."""
        embeds = self.embed_prefix(pixel_values, input_ids, proprio)
        return self.language_model(inputs_embeds=embeds, cache=cache, last_only=last_only)
