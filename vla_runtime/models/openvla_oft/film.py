"""FiLM (OFT+): the task's language modulates every ViT block of the vision towers.

Upstream (``prismatic/models/film_vit_wrapper.py``) wraps each timm block of ``featurizer`` (and
``fused_featurizer``) in a ``FiLMedVisionTransformerBlock`` holding ``scale`` and ``shift``,
``nn.Linear(llm_dim, vision_dim)`` each. With ``l`` the task's average language embedding [B, llm_dim]::

    x = x + drop_path1(ls1(attn(norm1(x))))
    x = x * (1 + scale(l))[:, None] + shift(l)[:, None]      # between attention and MLP
    x = x + drop_path2(ls2(mlp(norm2(x))))

``l`` is the mean, over the sequence, of the LLM's input embeddings of every position that is not an action
position (``predict_action``: ``input_embeddings[~all_actions_mask]``): BOS, the prompt ids (ending in
29871) and the stop token ``</s>``. The towers keep returning the second-to-last block's patch tokens, so
the last block's FiLM layers are loaded but never used, as upstream.

Weights only: the layers live beside the backbone (``OpenVLAOFT.film``), the ViTs stay unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.vision_transformer import VisionTransformer

TOWERS = ("featurizer", "fused_featurizer")  # the vision backbone's ViT attribute names, upstream's order


class FiLMLayer(nn.Module):
    """One block's ``scale`` (gamma) and ``shift`` (beta) projections, ``Linear(llm_dim, vision_dim)`` each."""

    def __init__(self, llm_dim: int, vision_dim: int) -> None:
        super().__init__()
        self.scale = nn.Linear(llm_dim, vision_dim)
        self.shift = nn.Linear(llm_dim, vision_dim)

    def forward(self, x: torch.Tensor, language: torch.Tensor) -> torch.Tensor:
        """x: [B, T, vision_dim], language: [B, llm_dim] -> x * (1 + gamma) + beta, [B, T, vision_dim]."""
        gamma = self.scale(language)[:, None]  # [B, 1, vision_dim]
        beta = self.shift(language)[:, None]  # [B, 1, vision_dim]
        return x * (1 + gamma) + beta


def film_block(block: nn.Module, layer: FiLMLayer, x: torch.Tensor, language: torch.Tensor) -> torch.Tensor:
    """A timm ViT block with FiLM between its attention and MLP halves. x: [B, T, D] -> [B, T, D]."""
    x = x + block.drop_path1(block.ls1(block.attn(block.norm1(x))))
    x = layer(x, language)
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


def film_tower_features(vit: VisionTransformer, layers: nn.ModuleList, x: torch.Tensor, language: torch.Tensor) -> torch.Tensor:
    """x: [B, 3, H, W], language: [B, llm_dim] -> the second-to-last FiLM'd block's patch tokens [B, N, D]."""
    x = vit.patch_embed(x)  # [B, N, D]
    x = vit._pos_embed(x)  # [B, prefix + N, D]
    x = vit.norm_pre(vit.patch_drop(x))
    for block, layer in zip(vit.blocks[:-1], layers):
        x = film_block(block, layer, x, language)
    return x[:, vit.num_prefix_tokens :]  # [B, N, D]


class VisionFiLM(nn.Module):
    """FiLM layers per tower: ``featurizer.{i}`` (and ``fused_featurizer.{i}``), one per ViT block.

    vision_backbone: our ``PrismaticVisionBackbone`` (read for depth and widths only, not held).
    """

    def __init__(self, vision_backbone: nn.Module, llm_dim: int) -> None:
        super().__init__()
        self.towers = nn.ModuleDict()
        for name in TOWERS:
            vit = getattr(vision_backbone, name, None)
            if vit is not None:
                self.towers[name] = nn.ModuleList(FiLMLayer(llm_dim, vit.num_features) for _ in vit.blocks)

    def forward(self, vision_backbone: nn.Module, pixel_values: torch.Tensor, language: torch.Tensor) -> torch.Tensor:
        """pixel_values: [B, 3 * towers, H, W] (DINO channels first), language: [B, llm_dim] -> patch
        features [B, N, sum(D)], as ``PrismaticVisionBackbone.forward`` with FiLM."""
        if "fused_featurizer" not in self.towers:
            return film_tower_features(vision_backbone.featurizer, self.towers["featurizer"], pixel_values, language)
        img, img_fused = torch.split(pixel_values, [3, 3], dim=1)  # [B, 3, H, W] each
        return torch.cat([
            film_tower_features(vision_backbone.featurizer, self.towers["featurizer"], img, language),
            film_tower_features(vision_backbone.fused_featurizer, self.towers["fused_featurizer"], img_fused, language),
        ], dim=2)  # fmt: skip


def average_language_embedding(embed: nn.Embedding, ids: list[int], batch: int = 1) -> torch.Tensor:
    """The FiLM conditioning: the mean of ``embed`` over ``ids`` (BOS + prompt + 29871 + ``</s>``) -> [B, llm_dim]."""
    tokens = torch.tensor([ids], device=embed.weight.device)  # [1, L]
    return embed(tokens).mean(dim=1).expand(batch, -1)  # [B, llm_dim]
