"""The Prismatic VLM's configuration (OpenVLA's, and the VLM inside CogACT, HybridVLA and OpenVLA-OFT): the HF
``config.json`` parsed into nested dataclasses; the vision side is in ``configuration_vision``.

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

from ...json_fields import ConfigFields
from ..llama import LlamaConfig
from .configuration_vision import LLM_BACKBONES, TIMM_VITS, TOWER_PREFIXES, ProjectorConfig, VisionConfig, backbone_spec

# extra config.json keys of ours (upstream ignores unknown keys)
EXTRA_KEYS = ("vision_num_heads", "proprio_dim")



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
    def from_hf(cls, hf: dict, *, weight_shapes: Mapping[str, tuple[int, ...]] | None = None,
                where: str = "config.json") -> "OpenVLAConfig":
        """Parse an upstream ``config.json`` dict (``where``: the file, named by errors).

        ``weight_shapes`` (HF names -> shapes, e.g. read from safetensors headers) sets the ViT geometry;
        without it the timm-id table's sizes are used.
        """
        f = ConfigFields(hf, where)
        model_type = f.str("model_type", "openvla")
        if model_type not in ("openvla", "prismatic"):
            raise ValueError(f"config.json `model_type` is {model_type!r}; expected 'openvla' (or 'prismatic')")
        backbone_id = f.str("vision_backbone_id", "siglip-vit-so400m")  # PrismaticConfig's default
        spec = backbone_spec(backbone_id)
        n = len(spec.timm_ids)
        image_sizes = f.ints("image_sizes", [spec.image_size] * n)
        act_overrides = f.strs("timm_override_act_layers", list(spec.act_overrides))
        heads = f.ints("vision_num_heads", [None] * n)
        for key, value in (("image_sizes", image_sizes), ("timm_override_act_layers", act_overrides), ("vision_num_heads", heads)):
            if len(value) != n:
                raise ValueError(f"config.json `{key}` has {len(value)} entries; {backbone_id!r} has {n} vision towers")
        if None in image_sizes:
            raise ValueError(f"{where} `image_sizes` is {image_sizes}; expected an integer per vision tower")
        fused = f.bool("use_fused_vision_backbone", None)
        if fused is None:
            fused = backbone_id.startswith(("dinoclip", "dinosiglip"))
        if fused != (n == 2):
            raise ValueError(f"`use_fused_vision_backbone` is {fused} but {backbone_id!r} has {n} vision tower(s)")
        towers = []
        for i, timm_id in enumerate(spec.timm_ids):
            tower = replace(TIMM_VITS[timm_id], image_size=image_sizes[i], act=act_overrides[i] or "gelu")
            if weight_shapes is not None:
                prefix = TOWER_PREFIXES[i]
                sub = {k[len(prefix):]: v for k, v in weight_shapes.items() if k.startswith(prefix)}
                tower = tower.with_weights(sub, num_heads=heads[i])
            elif heads[i]:
                tower = replace(tower, num_heads=heads[i])
            towers.append(tower)
        vision = VisionConfig(backbone_id, tuple(towers), f.str("image_resize_strategy", "letterbox"))
        text = f.sub("text_config")
        llm = LlamaConfig.from_hf(text.data, where=text.where)
        return cls(
            vision=vision,
            projector=ProjectorConfig(vision.embed_dim, llm.dim, vision.fused),
            llm=llm,
            n_bins=f.int("n_action_bins", 256),
            pad_to_multiple_of=f.int("pad_to_multiple_of", 64),
            bos_token_id=text.int("bos_token_id", 1),
            eos_token_id=text.int("eos_token_id", 2),
            pad_token_id=f.int("pad_token_id", 32000),
            llm_max_length=f.int("llm_max_length", 2048),
            proprio_dim=f.int("proprio_dim", None),
            norm_stats=f.dict("norm_stats", {}),
            llm_backbone_id=f.str("llm_backbone_id", "vicuna-v15-7b"),
            arch_specifier=f.str("arch_specifier", "no-align+gelu-mlp"),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, weight_shapes: Mapping[str, tuple[int, ...]] | None = None) -> "OpenVLAConfig":
        """``config.json`` of a checkpoint directory; ``dataset_statistics.json`` beside it overrides ``norm_stats``."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} does not exist (an OpenVLA checkpoint directory needs config.json)")
        cfg = cls.from_hf(read_json(config_file), weight_shapes=weight_shapes, where=str(config_file))
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
