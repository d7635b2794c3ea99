"""config.json parsing: upstream keys and defaults, the timm-id table, errors, writing it back."""

import json

import pytest
import torch

from vla_runtime.models.llama import LlamaConfig
from vla_runtime.models.prismatic.configuration_prismatic import OpenVLAConfig
from vla_runtime.models.prismatic.configuration_vision import VISION_BACKBONES
from vla_runtime.models.prismatic.modeling_prismatic import PrismaticVLM

# openvla-7b's config.json as upstream writes it (norm_stats shortened), incl. the tiny text_config diff
OPENVLA_7B = {
    "arch_specifier": "no-align+fused-gelu-mlp",
    "architectures": ["OpenVLAForActionPrediction"],
    "auto_map": {"AutoConfig": "configuration_prismatic.OpenVLAConfig",
                 "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction"},
    "hf_llm_id": "meta-llama/Llama-2-7b-hf",
    "image_resize_strategy": "resize-naive",
    "image_sizes": [224, 224],
    "llm_backbone_id": "llama2-7b-pure",
    "llm_max_length": 2048,
    "model_type": "openvla",
    "n_action_bins": 256,
    "norm_stats": {"bridge_orig": {"action": {"mask": [True] * 6 + [False], "q01": [-1.0] * 7, "q99": [1.0] * 7}}},
    "output_projector_states": False,
    "pad_to_multiple_of": 64,
    "pad_token_id": 32000,
    "text_config": {"model_type": "llama", "pad_token_id": 32000, "torch_dtype": "bfloat16", "vocab_size": 32064},
    "timm_model_ids": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
    "timm_override_act_layers": [None, None],
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_fused_vision_backbone": True,
    "vision_backbone_id": "dinosiglip-vit-so-224px",
}  # fmt: skip


def test_openvla_7b_config_parses_with_llama_config_defaults():
    cfg = OpenVLAConfig.from_hf(OPENVLA_7B)
    llm = cfg.llm
    # missing text_config keys default as transformers' LlamaConfig does (not as Llama-2's own config.json)
    assert (llm.dim, llm.n_layers, llm.n_heads, llm.n_kv_heads, llm.ffn_dim) == (4096, 32, 32, 32, 11008)
    assert (llm.norm_eps, llm.max_position, llm.vocab_size, llm.rope.theta) == (1e-6, 2048, 32064, 10000.0)
    dino, siglip = cfg.vision.towers
    assert (dino.embed_dim, dino.depth, dino.num_heads, dino.mlp_hidden, dino.num_prefix_tokens) == (1024, 24, 16, 4096, 5)
    assert (siglip.embed_dim, siglip.depth, siglip.num_heads, siglip.mlp_hidden, siglip.num_prefix_tokens) == (1152, 27, 16, 4304, 0)
    assert cfg.vision.num_patches == 256 and cfg.vision.fused
    assert cfg.projector.dims == (2176, 8704, 4096, 4096)
    assert cfg.vocab_size_text == 32000 and cfg.action_token_range == (31744, 31999)


def test_openvla_7b_module_tree_has_the_upstream_names_and_shapes():
    with torch.device("meta"):
        model = PrismaticVLM(OpenVLAConfig.from_hf(OPENVLA_7B))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {
        "vision_backbone.featurizer.cls_token": (1, 1, 1024),
        "vision_backbone.featurizer.reg_token": (1, 4, 1024),
        "vision_backbone.featurizer.pos_embed": (1, 256, 1024),
        "vision_backbone.featurizer.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_backbone.featurizer.blocks.23.attn.qkv.weight": (3072, 1024),
        "vision_backbone.featurizer.blocks.0.ls1.scale_factor": (1024,),
        "vision_backbone.featurizer.blocks.0.ls2.scale_factor": (1024,),
        "vision_backbone.featurizer.norm.weight": (1024,),
        "vision_backbone.fused_featurizer.pos_embed": (1, 256, 1152),
        "vision_backbone.fused_featurizer.blocks.26.mlp.fc1.weight": (4304, 1152),
        "vision_backbone.fused_featurizer.attn_pool.latent": (1, 1, 1152),
        "vision_backbone.fused_featurizer.attn_pool.kv.weight": (2304, 1152),
        "vision_backbone.fused_featurizer.attn_pool.mlp.fc2.weight": (1152, 4304),
        "projector.fc1.weight": (8704, 2176),
        "projector.fc2.weight": (4096, 8704),
        "projector.fc3.weight": (4096, 4096),
        "language_model.model.embed_tokens.weight": (32064, 4096),
        "language_model.model.layers.31.mlp.down_proj.weight": (4096, 11008),
        "language_model.lm_head.weight": (32064, 4096),
    }
    assert {k: shapes.get(k) for k in expected} == expected
    assert not any("gamma" in k or "cls_token" in k and "fused" in k for k in shapes)
    assert "vision_backbone.fused_featurizer.blocks.27.norm1.weight" not in shapes
    # research §2.4: ~7.54 B parameters (LLM 6.739 B incl. pad rows, DINOv2-L 0.304 B, SigLIP 0.43 B, projector 71.4 M)
    total = sum(v.numel() for v in model.state_dict().values())
    assert 7.50e9 < total < 7.58e9
    assert sum(p.numel() for p in model.projector.parameters()) == 8704 * 2176 + 8704 + 4096 * 8704 + 4096 + 4096 * 4096 + 4096


def test_text_config_is_written_as_upstream_diff():
    cfg = OpenVLAConfig.from_hf(OPENVLA_7B)
    out = cfg.to_hf()
    assert out["text_config"] == OPENVLA_7B["text_config"]
    assert {k: v for k, v in out.items() if k != "norm_stats"} == {k: v for k, v in OPENVLA_7B.items() if k != "norm_stats"}
    assert list(out) == sorted(out)
    reparsed = OpenVLAConfig.from_hf(json.loads(json.dumps(out)))
    assert reparsed == cfg


def test_prismatic_defaults_and_single_tower_projector():
    cfg = OpenVLAConfig.from_hf({"model_type": "prismatic", "text_config": {"hidden_size": 64, "num_attention_heads": 4}})
    # PrismaticConfig's defaults: siglip-vit-so400m, letterbox, non-fused 2-layer projector
    assert cfg.vision.backbone_id == "siglip-vit-so400m" and not cfg.vision.fused
    assert cfg.vision.image_resize_strategy == "letterbox"
    assert cfg.projector.dims == (1152, 64, 64)


def test_unknown_vision_backbone_id_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown `vision_backbone_id` 'dinosiglip-vit-xl'") as e:
        OpenVLAConfig.from_hf({**OPENVLA_7B, "vision_backbone_id": "dinosiglip-vit-xl"})
    for known in VISION_BACKBONES:
        assert known in str(e.value)


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"use_fused_vision_backbone": False}, "use_fused_vision_backbone"),
        ({"image_sizes": [224]}, "`image_sizes` has 1 entries"),
        ({"model_type": "llava"}, "model_type"),
        ({"n_action_bins": 1}, "n_bins"),
        ({"vision_num_heads": [10, 16]}, "not divisible by num_heads 10"),
    ],
)
def test_inconsistent_configs_are_rejected(patch, message):
    with pytest.raises(ValueError, match=message):
        OpenVLAConfig.from_hf({**OPENVLA_7B, **patch})


def test_llama_from_hf_defaults_match_transformers():
    import transformers

    hf = transformers.LlamaConfig()
    ours = LlamaConfig.from_hf({"model_type": "llama"})
    assert (ours.dim, ours.n_layers, ours.n_heads, ours.ffn_dim, ours.vocab_size, ours.norm_eps, ours.max_position) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.intermediate_size, hf.vocab_size,
        hf.rms_norm_eps, hf.max_position_embeddings,
    )  # fmt: skip
