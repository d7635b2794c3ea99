"""OpenVLA (Prismatic) configuration: the HF ``config.json`` parsed into nested dataclasses.

Upstream writes ``OpenVLAConfig(PrismaticConfig)`` (``model_type: openvla``). The ViT geometry is
implied only by ``vision_backbone_id`` -> timm ids, so ``TIMM_VITS`` (keyed by timm id) holds it.
Tiny test checkpoints keep the real ids and take their sizes from the tensor shapes; what shapes cannot
tell (attention heads) comes from the extra key ``vision_num_heads``. ``proprio_dim`` (an optional
proprioception projector) is our other extra key. Every upstream key is read and written as upstream does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..llama import LlamaConfig

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
OPENAI_CLIP_MEAN, OPENAI_CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

VIT_ACTS = ("gelu", "quick_gelu")
VIT_POOLS = ("token", "map", "avg", "")
RESIZE_STRATEGIES = ("resize-naive", "resize-crop", "letterbox")
# extra config.json keys of ours (upstream ignores unknown keys)
EXTRA_KEYS = ("vision_num_heads", "proprio_dim")


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


# transformers' LlamaConfig defaults (v4.40, what upstream diffs `text_config` against when it writes it)
HF_LLAMA_DEFAULTS: dict = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "pretraining_tp": 1, "use_cache": True,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


@dataclass(frozen=True)
class OpenVLAConfig:
    """A Prismatic VLM with OpenVLA's action head.

    Args:
        vision: the vision backbone (towers, resize strategy).
        projector: vision -> LLM projector geometry.
        llm: the LLaMA-family decoder (``text_config``).

        n_bins: action bins (``n_action_bins``); action tokens are the last ``n_bins`` text ids.
        action_dim: actions per step when no ``norm_stats`` say otherwise.
        pad_to_multiple_of: embedding padding; text vocabulary = ``llm.vocab_size - pad_to_multiple_of``.
        bos_token_id, eos_token_id, pad_token_id: special ids (1, 2, 32000 for LLaMA-2).
        llm_max_length: tokenizer ``model_max_length``.

        proprio_dim: size of the proprioception input projected to one token after the image tokens
            (ours; ``None`` = stock OpenVLA).
        norm_stats: dataset key -> {"action": {q01, q99, mask, ...}, "proprio": {...}}.
        llm_backbone_id, arch_specifier: upstream provenance, kept so ``to_hf`` writes them back.
    """

    vision: VisionConfig = field(default_factory=VisionConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    llm: LlamaConfig = field(default_factory=LlamaConfig)
    # action head
    n_bins: int = 256
    action_dim: int = 7
    pad_to_multiple_of: int = 64
    # tokens
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 32000
    llm_max_length: int = 2048
    # ours
    proprio_dim: int | None = None
    # data and provenance
    norm_stats: dict = field(default_factory=dict)
    llm_backbone_id: str = "llama2-7b-pure"
    arch_specifier: str = "no-align+fused-gelu-mlp"

    def __post_init__(self) -> None:
        if self.projector.vision_dim != self.vision.embed_dim or self.projector.llm_dim != self.llm.dim:
            raise ValueError(
                f"projector {self.projector.vision_dim} -> {self.projector.llm_dim} does not join vision "
                f"{self.vision.embed_dim} and LLM {self.llm.dim}"
            )
        if self.projector.fused != self.vision.fused:
            raise ValueError("`projector.fused` must match the number of vision towers")
        if not 2 <= self.n_bins <= self.vocab_size_text:
            raise ValueError(f"`n_bins` must be in [2, {self.vocab_size_text}], got {self.n_bins}")
        if self.proprio_dim is not None and self.proprio_dim < 1:
            raise ValueError(f"`proprio_dim` must be >= 1 or None, got {self.proprio_dim}")
        if self.action_dim < 1:
            raise ValueError(f"`action_dim` must be >= 1, got {self.action_dim}")

    @property
    def vocab_size_text(self) -> int:
        """Tokenizer vocabulary without the padding rows (32000 for LLaMA-2)."""
        return self.llm.vocab_size - self.pad_to_multiple_of

    @property
    def action_token_range(self) -> tuple[int, int]:
        """[first, last] action token ids (31744, 31999 for OpenVLA)."""
        return self.vocab_size_text - self.n_bins, self.vocab_size_text - 1

    # ---- config.json ----------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict, *, weight_shapes: Mapping[str, tuple[int, ...]] | None = None) -> "OpenVLAConfig":
        """Parse an upstream ``config.json`` dict.

        ``weight_shapes`` (HF names -> shapes, e.g. read from safetensors headers) sets the ViT geometry;
        without it the timm-id table's sizes are used.
        """
        model_type = hf.get("model_type", "openvla")
        if model_type not in ("openvla", "prismatic"):
            raise ValueError(f"config.json `model_type` is {model_type!r}; expected 'openvla' (or 'prismatic')")
        backbone_id = hf.get("vision_backbone_id", "siglip-vit-so400m")  # PrismaticConfig's default
        spec = backbone_spec(backbone_id)
        n = len(spec.timm_ids)
        image_sizes = list(hf.get("image_sizes") or [spec.image_size] * n)
        act_overrides = list(hf.get("timm_override_act_layers") or spec.act_overrides)
        heads = hf.get("vision_num_heads") or [None] * n
        for key, value in (("image_sizes", image_sizes), ("timm_override_act_layers", act_overrides), ("vision_num_heads", heads)):
            if len(value) != n:
                raise ValueError(f"config.json `{key}` has {len(value)} entries; {backbone_id!r} has {n} vision towers")
        fused = hf.get("use_fused_vision_backbone")
        if fused is None:
            fused = backbone_id.startswith(("dinoclip", "dinosiglip"))
        if bool(fused) != (n == 2):
            raise ValueError(f"`use_fused_vision_backbone` is {fused} but {backbone_id!r} has {n} vision tower(s)")
        towers = []
        for i, timm_id in enumerate(spec.timm_ids):
            tower = replace(TIMM_VITS[timm_id], image_size=int(image_sizes[i]), act=act_overrides[i] or "gelu")
            if weight_shapes is not None:
                prefix = TOWER_PREFIXES[i]
                sub = {k[len(prefix):]: v for k, v in weight_shapes.items() if k.startswith(prefix)}
                tower = tower.with_weights(sub, num_heads=heads[i])
            elif heads[i]:
                tower = replace(tower, num_heads=int(heads[i]))
            towers.append(tower)
        vision = VisionConfig(backbone_id, tuple(towers), hf.get("image_resize_strategy", "letterbox"))
        text = dict(hf.get("text_config") or {})
        llm = LlamaConfig.from_hf(text)
        return cls(
            vision=vision,
            projector=ProjectorConfig(vision.embed_dim, llm.dim, vision.fused),
            llm=llm,
            n_bins=int(hf.get("n_action_bins", 256)),
            pad_to_multiple_of=int(hf.get("pad_to_multiple_of", 64)),
            bos_token_id=int(text.get("bos_token_id", 1)),
            eos_token_id=int(text.get("eos_token_id", 2)),
            pad_token_id=int(hf.get("pad_token_id", 32000)),
            llm_max_length=int(hf.get("llm_max_length", 2048)),
            proprio_dim=hf.get("proprio_dim"),
            norm_stats=dict(hf.get("norm_stats") or {}),
            llm_backbone_id=hf.get("llm_backbone_id", "vicuna-v15-7b"),
            arch_specifier=hf.get("arch_specifier", "no-align+gelu-mlp"),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, weight_shapes: Mapping[str, tuple[int, ...]] | None = None) -> "OpenVLAConfig":
        """``config.json`` of a checkpoint directory; ``dataset_statistics.json`` beside it overrides ``norm_stats``."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} does not exist (an OpenVLA checkpoint directory needs config.json)")
        cfg = cls.from_hf(read_json(config_file), weight_shapes=weight_shapes)
        stats_file = path / "dataset_statistics.json"
        if stats_file.is_file():
            cfg = replace(cfg, norm_stats=read_json(stats_file))
        return cfg

    def to_hf(self, *, torch_dtype: str = "bfloat16") -> dict:
        """The ``config.json`` dict upstream writes (sorted keys), plus our extra keys where needed."""
        llm = self.llm.to_hf()
        if llm["head_dim"] == llm["hidden_size"] // llm["num_attention_heads"]:
            del llm["head_dim"]
        text = {k: v for k, v in llm.items() if k not in HF_LLAMA_DEFAULTS or HF_LLAMA_DEFAULTS[k] != v}
        text.pop("hidden_act", None)
        text.update(model_type="llama", pad_token_id=self.pad_token_id, torch_dtype=torch_dtype)
        spec = backbone_spec(self.vision.backbone_id)
        out = {
            "arch_specifier": self.arch_specifier,
            "architectures": ["OpenVLAForActionPrediction"],
            "auto_map": {
                "AutoConfig": "configuration_prismatic.OpenVLAConfig",
                "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction",
            },
            "hf_llm_id": LLM_BACKBONES.get(self.llm_backbone_id, self.llm_backbone_id),
            "image_resize_strategy": self.vision.image_resize_strategy,
            "image_sizes": [t.image_size for t in self.vision.towers],
            "llm_backbone_id": self.llm_backbone_id,
            "llm_max_length": self.llm_max_length,
            "model_type": "openvla",
            "n_action_bins": self.n_bins,
            "norm_stats": self.norm_stats,
            "output_projector_states": False,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "pad_token_id": self.pad_token_id,
            "text_config": dict(sorted(text.items())),
            "timm_model_ids": list(spec.timm_ids),
            "timm_override_act_layers": list(spec.act_overrides),
            "torch_dtype": torch_dtype,
            "transformers_version": "4.40.1",
            "use_fused_vision_backbone": self.vision.fused,
            "vision_backbone_id": self.vision.backbone_id,
        }
        # written whenever a tower is not the timm id's standard one: its head count cannot be read from the weights
        standard = [(TIMM_VITS[t.timm_id].num_heads, TIMM_VITS[t.timm_id].embed_dim) for t in self.vision.towers]
        if [(t.num_heads, t.embed_dim) for t in self.vision.towers] != standard:
            out["vision_num_heads"] = [t.num_heads for t in self.vision.towers]
        if self.proprio_dim is not None:
            out["proprio_dim"] = self.proprio_dim
        return dict(sorted(out.items()))


def detect_openvla(path: Path) -> bool:
    """An OpenVLA HF directory: ``config.json`` whose ``model_type`` is openvla (or prismatic)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") in ("openvla", "prismatic")
    except (json.JSONDecodeError, AttributeError):
        return False


def read_json(path: Path) -> dict:
    """A JSON file as a dict; a parse error names the file."""
    try:
        with path.open() as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
