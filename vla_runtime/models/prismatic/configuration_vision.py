"""The Prismatic VLM's vision side as ``config.json`` implies it: timm ViT towers (``ViTConfig``, keyed by
timm id in ``TIMM_VITS``), what each upstream ``vision_backbone_id`` means (``VISION_BACKBONES``), the fused
or single backbone (``VisionConfig``) and the projector to the LLM (``ProjectorConfig``). Parsed from
``config.json`` by ``configuration_prismatic.OpenVLAConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
OPENAI_CLIP_MEAN, OPENAI_CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

VIT_ACTS = ("gelu", "quick_gelu")
VIT_POOLS = ("token", "map", "avg", "")
RESIZE_STRATEGIES = ("resize-naive", "resize-crop", "letterbox")

@dataclass(frozen=True)
class ViTConfig:
    """One timm ``VisionTransformer`` used as a Prismatic featurizer.

    Args:
        timm_id: timm model id (what upstream passes to ``timm.create_model``).
        image_size: square input side in pixels (``config.json`` ``image_sizes``).
        patch_size, embed_dim, depth, num_heads: geometry. mlp_hidden: ``mlp.fc1`` output features.
        class_token, reg_tokens: prefix tokens (dropped from the features).
        no_embed_class: ``pos_embed`` covers the patches only (DINOv2).
        layer_scale: blocks carry LayerScale (``ls1/ls2.scale_factor``).
        global_pool: timm head pooling; ``map`` builds the (unused) ``attn_pool``.
        pre_norm: LayerNorm before the blocks (CLIP). norm_eps: LayerNorm epsilon.
        act: MLP activation, ``gelu`` (exact erf) or ``quick_gelu`` (CLIP).
        mean, std: timm's normalisation for this model (``preprocessor_config.json`` may override).
    """

    timm_id: str
    image_size: int = 224
    patch_size: int = 14
    embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_hidden: int = 4096
    class_token: bool = True
    reg_tokens: int = 0
    no_embed_class: bool = False
    layer_scale: bool = False
    global_pool: str = "token"
    pre_norm: bool = False
    norm_eps: float = 1e-6
    act: str = "gelu"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.image_size < self.patch_size:
            raise ValueError(f"`image_size` {self.image_size} of {self.timm_id} is smaller than its patch size {self.patch_size}")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"{self.timm_id}: embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}; "
                "set config.json `vision_num_heads` for non-standard (tiny) towers"
            )
        if self.depth < 2:
            raise ValueError(f"{self.timm_id}: `depth` must be >= 2 (features come from the second-to-last block), got {self.depth}")
        if self.act not in VIT_ACTS:
            raise ValueError(f"{self.timm_id}: `act` is {self.act!r}; expected one of {', '.join(VIT_ACTS)}")
        if self.global_pool not in VIT_POOLS:
            raise ValueError(f"{self.timm_id}: `global_pool` is {self.global_pool!r}; expected one of {VIT_POOLS}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.reg_tokens

    def with_weights(self, shapes: Mapping[str, tuple[int, ...]], *, num_heads: int | None = None) -> "ViTConfig":
        """Geometry read from this tower's tensor shapes (names relative to the tower, HF layout).

        Heads cannot be read from weights: ``num_heads`` (config extra key) or the table's value.
        """

        def shape(name: str) -> tuple[int, ...]:
            if name not in shapes:
                raise ValueError(f"vision tower {self.timm_id}: tensor `{name}` is missing from the checkpoint")
            return tuple(shapes[name])

        if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
            raise ValueError(f"config.json `vision_num_heads` has {num_heads!r}; expected a positive integer per tower (or null)")
        embed_dim, _, patch, _ = shape("patch_embed.proj.weight")
        if num_heads is None and embed_dim != self.embed_dim:
            # the table's head count belongs to the table's width: for another width it would be a guess, and a
            # wrong head count changes every output without failing
            raise ValueError(
                f"vision tower {self.timm_id} is {embed_dim} wide (timm's {self.timm_id} is {self.embed_dim} wide with "
                f"{self.num_heads} heads), so its head count is unknown; set config.json `vision_num_heads`"
            )
        blocks = {int(k.split(".")[1]) for k in shapes if k.startswith("blocks.")}
        cfg = replace(
            self,
            patch_size=patch,
            embed_dim=embed_dim,
            depth=max(blocks) + 1 if blocks else 0,
            num_heads=num_heads or self.num_heads,
            mlp_hidden=shape("blocks.0.mlp.fc1.weight")[0],
            class_token="cls_token" in shapes,
            reg_tokens=shape("reg_token")[1] if "reg_token" in shapes else 0,
            layer_scale="blocks.0.ls1.scale_factor" in shapes,
            pre_norm="norm_pre.weight" in shapes,
        )
        positions = shape("pos_embed")[1] - (0 if cfg.no_embed_class else cfg.num_prefix_tokens)
        if positions != cfg.num_patches:
            raise ValueError(
                f"weight shape mismatch: {self.timm_id} `pos_embed` holds {positions} patch positions, but image size "
                f"{cfg.image_size} with patch {cfg.patch_size} gives {cfg.num_patches}; check config.json `image_sizes`"
            )
        return cfg


def _vit(timm_id: str, **kw) -> ViTConfig:
    return ViTConfig(timm_id=timm_id, **kw)


# Architecture implied by each timm id (timm v0.9.10 definitions, which upstream pins).
TIMM_VITS: dict[str, ViTConfig] = {
    "vit_large_patch14_reg4_dinov2.lvd142m": _vit(
        "vit_large_patch14_reg4_dinov2.lvd142m", reg_tokens=4, no_embed_class=True, layer_scale=True
    ),
    "vit_so400m_patch14_siglip_224": _vit(
        "vit_so400m_patch14_siglip_224", embed_dim=1152, depth=27, mlp_hidden=4304, class_token=False,
        global_pool="map", mean=HALF, std=HALF,
    ),
    "vit_so400m_patch14_siglip_384": _vit(
        "vit_so400m_patch14_siglip_384", image_size=384, embed_dim=1152, depth=27, mlp_hidden=4304,
        class_token=False, global_pool="map", mean=HALF, std=HALF,
    ),
    "vit_large_patch14_clip_224.openai": _vit(
        "vit_large_patch14_clip_224.openai", pre_norm=True, norm_eps=1e-5, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD
    ),
    "vit_large_patch14_clip_336.openai": _vit(
        "vit_large_patch14_clip_336.openai", image_size=336, pre_norm=True, norm_eps=1e-5,
        mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD,
    ),
    "vit_large_patch16_224.augreg_in21k_ft_in1k": _vit(
        "vit_large_patch16_224.augreg_in21k_ft_in1k", patch_size=16, mean=HALF, std=HALF
    ),
}  # fmt: skip


@dataclass(frozen=True)
class BackboneSpec:
    """What a ``vision_backbone_id`` means upstream: timm ids, default resolution, activation overrides."""

    timm_ids: tuple[str, ...]
    image_size: int
    act_overrides: tuple[str | None, ...]


_DINO, _SIGLIP224, _SIGLIP384 = ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224",
                                 "vit_so400m_patch14_siglip_384")  # fmt: skip
VISION_BACKBONES: dict[str, BackboneSpec] = {
    "clip-vit-l": BackboneSpec(("vit_large_patch14_clip_224.openai",), 224, ("quick_gelu",)),
    "clip-vit-l-336px": BackboneSpec(("vit_large_patch14_clip_336.openai",), 336, ("quick_gelu",)),
    "siglip-vit-so400m": BackboneSpec((_SIGLIP224,), 224, (None,)),
    "siglip-vit-so400m-384px": BackboneSpec((_SIGLIP384,), 384, (None,)),
    "dinov2-vit-l": BackboneSpec((_DINO,), 224, (None,)),
    "in1k-vit-l": BackboneSpec(("vit_large_patch16_224.augreg_in21k_ft_in1k",), 224, (None,)),
    "dinoclip-vit-l-336px": BackboneSpec((_DINO, "vit_large_patch14_clip_336.openai"), 336, (None, "quick_gelu")),
    "dinosiglip-vit-so-224px": BackboneSpec((_DINO, _SIGLIP224), 224, (None, None)),
    "dinosiglip-vit-so-384px": BackboneSpec((_DINO, _SIGLIP384), 384, (None, None)),
}

# LLM backbone id -> HF id (informational upstream; we need a LLaMA-family decoder).
LLM_BACKBONES: dict[str, str] = {
    "llama2-7b-pure": "meta-llama/Llama-2-7b-hf",
    "llama2-13b-pure": "meta-llama/Llama-2-13b-hf",
    "llama2-7b-chat": "meta-llama/Llama-2-7b-chat-hf",
    "llama2-13b-chat": "meta-llama/Llama-2-13b-chat-hf",
    "vicuna-v15-7b": "lmsys/vicuna-7b-v1.5",
    "vicuna-v15-13b": "lmsys/vicuna-13b-v1.5",
    "mistral-v0.1-7b-pure": "mistralai/Mistral-7B-v0.1",
    "mistral-v0.1-7b-instruct": "mistralai/Mistral-7B-Instruct-v0.1",
}

TOWER_PREFIXES = ("vision_backbone.featurizer.", "vision_backbone.fused_featurizer.")


def backbone_spec(vision_backbone_id: str) -> BackboneSpec:
    if vision_backbone_id not in VISION_BACKBONES:
        raise ValueError(
            f"unknown `vision_backbone_id` {vision_backbone_id!r}; known: {', '.join(sorted(VISION_BACKBONES))}"
        )
    return VISION_BACKBONES[vision_backbone_id]


@dataclass(frozen=True)
class VisionConfig:
    """The Prismatic vision backbone: one tower, or two fused (DINO features first).

    Args:
        backbone_id: upstream ``vision_backbone_id``.
        towers: one ``ViTConfig`` per timm model (``featurizer``, then ``fused_featurizer``).
        image_resize_strategy: ``resize-naive`` (OpenVLA), ``resize-crop`` or ``letterbox``.
    """

    backbone_id: str = "dinosiglip-vit-so-224px"
    towers: tuple[ViTConfig, ...] = (TIMM_VITS[_DINO], TIMM_VITS[_SIGLIP224])
    image_resize_strategy: str = "resize-naive"

    def __post_init__(self) -> None:
        if not 1 <= len(self.towers) <= 2:
            raise ValueError(f"a Prismatic vision backbone has 1 or 2 towers, got {len(self.towers)}")
        if len({t.num_patches for t in self.towers}) != 1:
            raise ValueError(f"fused towers must give the same patch count, got {[t.num_patches for t in self.towers]}")
        if self.image_resize_strategy not in RESIZE_STRATEGIES:
            raise ValueError(
                f"`image_resize_strategy` is {self.image_resize_strategy!r}; expected one of {', '.join(RESIZE_STRATEGIES)}"
            )

    @property
    def fused(self) -> bool:
        return len(self.towers) == 2

    @property
    def embed_dim(self) -> int:
        return sum(t.embed_dim for t in self.towers)

    @property
    def num_patches(self) -> int:
        return self.towers[0].num_patches


@dataclass(frozen=True)
class ProjectorConfig:
    """Vision features -> LLM embeddings. Fused: fc1 (v -> 4v), GELU, fc2 (4v -> d), GELU, fc3 (d -> d).
    Single tower: fc1 (v -> d), GELU, fc2 (d -> d)."""

    vision_dim: int = 2176
    llm_dim: int = 4096
    fused: bool = True

    @property
    def dims(self) -> tuple[int, ...]:
        """Feature sizes through the layers: (in, hidden..., out)."""
        if self.fused:
            return (self.vision_dim, 4 * self.vision_dim, self.llm_dim, self.llm_dim)
        return (self.vision_dim, self.llm_dim, self.llm_dim)
