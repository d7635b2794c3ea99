"""Tiny CogACT/HybridVLA runs: the upstream layout and names, the VLM as upstream runs it, and loader errors
that name the missing file or key (nothing is ever downloaded)."""

import json
import shutil

import pytest
import torch
import transformers

from vla_runtime.api import FAMILIES, detect_family, load_policy
from vla_runtime.checkpoints.openvla import hf_name
from vla_runtime.checkpoints.prismatic_run import PrismaticRun, save_run
from vla_runtime.checkpoints.prismatic_vlm import load_prismatic, prismatic_modules, vlm_state
from vla_runtime.kv import FullCache, FullParams, KVMode

UPSTREAM_TRAIN_KEYS = {  # TrainConfig fields both upstreams dump to config.json
    "vla", "data_root_dir", "run_root_dir", "pretrained_checkpoint", "is_resume", "resume_step", "resume_epoch",
    "run_id", "run_id_note", "save_interval", "image_aug", "seed", "hf_token", "trackers", "wandb_project",
    "wandb_entity", "repeated_diffusion_steps", "load_all_data_for_training", "future_action_window_size",
    "past_action_window_size", "action_dim",
}  # fmt: skip
OURS = {"vision_num_heads", "llm_config", "action_model_num_heads"}


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_cogact_run_has_the_upstream_layout(tiny_cogact):
    assert (tiny_cogact / "dataset_statistics.json").is_file() and (tiny_cogact / "tokenizer.json").is_file()
    config = json.loads((tiny_cogact / "config.json").read_text())
    assert UPSTREAM_TRAIN_KEYS | {"action_model_type", "use_ema"} <= set(config)
    assert set(config) - UPSTREAM_TRAIN_KEYS - {"action_model_type", "use_ema"} <= OURS
    assert config["vla"]["base_vlm"] == "prism-dinosiglip-224px+7b" and config["future_action_window_size"] == 15
    run = PrismaticRun.open(tiny_cogact)
    assert run.checkpoint.name == "step-000000-epoch-00-loss=0.0000.pt"
    modules = run.modules()
    assert sorted(modules) == ["action_model", "llm_backbone", "projector", "vision_backbone"]
    for key in ("dino_featurizer.blocks.0.ls1.gamma", "dino_featurizer.reg_token", "siglip_featurizer.attn_pool.latent"):
        assert key in modules["vision_backbone"]
    assert sorted(modules["projector"]) == [f"projector.{i}.{p}" for i in (0, 2, 4) for p in ("bias", "weight")]
    assert "llm.model.layers.1.self_attn.q_proj.weight" in modules["llm_backbone"] and "llm.lm_head.weight" in modules["llm_backbone"]
    assert modules["llm_backbone"]["llm.model.embed_tokens.weight"].shape[0] == 32064
    assert "net.z_embedder.uncondition" in modules["action_model"]


def test_hybridvla_run_has_the_upstream_layout(tiny_hybridvla):
    config = json.loads((tiny_hybridvla / "config.json").read_text())
    hybrid_keys = {"class_dropout_prob", "action_tokenizer_exist", "use_diff", "ar_diff_loss", "need_to_sub"}
    assert UPSTREAM_TRAIN_KEYS | hybrid_keys <= set(config) and set(config) - UPSTREAM_TRAIN_KEYS - hybrid_keys <= OURS
    assert config["use_diff"] is True and config["future_action_window_size"] == 0
    modules = PrismaticRun.open(tiny_hybridvla).modules()
    assert sorted(modules) == sorted(
        ["vision_backbone", "projector", "llm_backbone", "x_embedder", "t_embedder", "final_layer", "proprio_embedder"]
    )
    stats = json.loads((tiny_hybridvla / "dataset_statistics.json").read_text())
    assert stats["rlbench"]["proprio"]["mask"] == [True] * 6 + [False]


def test_family_detection(tiny_cogact, tiny_hybridvla):
    assert {"openvla", "cogact", "hybridvla"} <= set(FAMILIES)
    assert detect_family(tiny_cogact) == "cogact" and detect_family(tiny_hybridvla) == "hybridvla"


def test_detection_falls_back_to_the_checkpoint_modules(tiny_cogact, tmp_path):
    run = copy_run(tiny_cogact, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    del config["action_model_type"]  # an older dump without the flag
    (run / "config.json").write_text(json.dumps(config))
    assert detect_family(run) == "cogact"


def test_prismatic_names_round_trip(tiny_cogact):
    modules = PrismaticRun.open(tiny_cogact).modules()
    state = vlm_state(modules)
    assert "vision_backbone.featurizer.blocks.0.ls1.scale_factor" in state and "projector.fc3.weight" in state
    back = prismatic_modules(state)
    for module in ("vision_backbone", "projector", "llm_backbone"):
        assert set(back[module]) == set(modules[module])
    assert all(hf_name(f"{m}.{k}") in state for m in back for k in back[m])


def test_cognition_feature_is_transformers_last_hidden_state_at_eos(tiny_cogact, frame):
    """The LLM of a Prismatic run (eps from config, 32064 rows) against transformers' LlamaForCausalLM:
    ``hidden_states[-1][:, -1]`` of the multimodal sequence ending in 29871, EOS is the cognition feature."""
    ckpt = load_prismatic(tiny_cogact)
    llm_cfg = ckpt.config.llm
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**llm_cfg.to_hf(), "rope_scaling": None})).eval()
    hf.load_state_dict(ckpt.vlm.language_model.state_dict(), strict=True)
    prompt = ckpt.tokenizer.prompt("stack the green block")
    ids = torch.tensor([[*prompt.input_ids, 2]])
    pixels = ckpt.image_processor(frame(3))[None]
    with torch.no_grad():
        embeds = ckpt.vlm.embed_prefix(pixels, ids)  # image right after BOS
        ours = ckpt.vlm.language_model.model(inputs_embeds=embeds, cache=FullCache(llm_cfg.geometry, FullParams(capacity=64)))[:, -1]
        ref = hf(inputs_embeds=embeds, output_hidden_states=True).hidden_states[-1][:, -1]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    assert llm_cfg.norm_eps == 1e-6  # tiny runs carry their own llm_config; real ones read Llama-2-7b-hf's 1e-5


def test_real_size_llama2_uses_the_base_models_epsilon(tiny_cogact):
    from vla_runtime.checkpoints.prismatic_vlm import PRISMATIC_LLMS
    from vla_runtime.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf({**PRISMATIC_LLMS["llama2-7b-pure"], "vocab_size": 32064})
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.norm_eps, cfg.vocab_size) == (4096, 32, 32, 1e-5, 32064)


def _rewrite(run, drop=(), config_update=None):
    ckpt = PrismaticRun.open(run)
    modules = {k: v for k, v in ckpt.modules().items() if k not in drop}
    config = {**ckpt.config, **(config_update or {})}
    ckpt.checkpoint.unlink()
    save_run(run, config=config, norm_stats=ckpt.norm_stats, modules=modules)


@pytest.mark.parametrize(
    "fixture, drop, message",
    [
        ("tiny_cogact", ("vision_backbone",), r"lacks module\(s\) \['vision_backbone'\].*never downloads"),
        ("tiny_cogact", ("action_model",), r"lacks module\(s\) \['action_model'\]"),
        ("tiny_hybridvla", ("t_embedder",), r"lacks diffusion module\(s\) \['t_embedder'\]"),
        ("tiny_hybridvla", ("llm_backbone", "projector"), r"lacks module\(s\) \['projector', 'llm_backbone'\]"),
    ],
)
def test_missing_modules_are_named(request, tmp_path, fixture, drop, message):
    run = copy_run(request.getfixturevalue(fixture), tmp_path / "run")
    _rewrite(run, drop=drop)
    with pytest.raises(KeyError, match=message):
        load_policy(run)


@pytest.mark.parametrize("missing", ["config.json", "dataset_statistics.json", "tokenizer.json"])
def test_missing_files_are_named(tiny_cogact, tmp_path, missing):
    run = copy_run(tiny_cogact, tmp_path / "run")
    (run / missing).unlink()
    with pytest.raises((FileNotFoundError, ValueError), match=missing):
        load_policy(run) if missing != "config.json" else PrismaticRun.open(run)


def test_tokenizer_can_be_supplied_separately(tiny_cogact, tmp_path):
    run = copy_run(tiny_cogact, tmp_path / "run")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.move(run / "tokenizer.json", tok_dir / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="copy tokenizer.json from an OpenVLA checkpoint"):
        load_policy(run)
    assert load_policy(run, tokenizer=tok_dir / "tokenizer.json").name == "cogact"


@pytest.mark.parametrize(
    "update, error, message",
    [
        ({"action_model_type": "DiT-B"}, ValueError, "action_model_type 'DiT-B'.*depth 2, width 32"),
        ({"future_action_window_size": 7}, ValueError, "positional table holds 15"),
        ({"action_model_num_heads": None, "action_model_type": "DiT-tiny"}, ValueError, "action_model_num_heads"),
        ({"vla": {"base_vlm": "phi-2+3b"}}, ValueError, "base VLM 'phi-2\\+3b' is not supported"),
    ],
)
def test_config_mismatches_are_reported(tiny_cogact, tmp_path, update, error, message):
    run = copy_run(tiny_cogact, tmp_path / "run")
    _rewrite(run, config_update=update)
    with pytest.raises(error, match=message):
        load_policy(run)


def test_info_reads_structure_only(tiny_hybridvla):
    info = load_policy(tiny_hybridvla, device="meta").info()
    assert info["family"] == "hybridvla" and info["mode"] == "diff+ar" and info["ar_token_range"] == [31744, 31999]
    assert info["parameters"]["diffusion_modules"] > 0 and info["datasets"] == ["rlbench"]


@pytest.mark.parametrize("fixture", ["tiny_cogact", "tiny_hybridvla"])
def test_a_trained_chunk_gate_beside_the_run_is_used(request, tmp_path, fixture):
    from vla_runtime.config import SessionConfig
    from vla_runtime.kv import ChunkGate, KVConfig, save_gate

    run = copy_run(request.getfixturevalue(fixture), tmp_path / "run")
    plain = load_policy(run)
    kv = KVConfig.of(KVMode.CHUNKED, chunk=8, window=24)
    gate = ChunkGate(kv.gate_config(plain.vlm.cfg.llm.geometry))
    with torch.no_grad():
        for p in gate.parameters():
            p.add_(0.1)
    save_gate(gate, run, kv)
    policy = load_policy(run)
    assert policy.kv == kv  # the cache the gate was trained with becomes the default
    for ours, saved in zip(policy.kv_gate.state_dict().values(), gate.state_dict().values()):
        assert torch.equal(ours, saved)
    session = policy.new_session("open the drawer", SessionConfig(kv=kv, history="history"))
    assert session.cache.gate is policy.kv_gate
    assert plain.chunk_gate(kv) is plain.chunk_gate(kv)  # without a file: one untrained default per policy
