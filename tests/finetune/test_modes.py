"""The other ways to train: from scratch (full checkpoint out), gates only, single mode, resume, the CLI."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vla_finetune import outputs
from vla_finetune.lora import is_unused, unused_by_forward
from vla_finetune.train import main
from vla_finetune.trainer import Trainer
from vla_runtime.api import Observation, load_policy

from .conftest import TASKS, make_config


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def changed(before: dict, module: torch.nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if not torch.equal(before[name], p.detach())}


def act(policy) -> np.ndarray:
    session = policy.new_session(TASKS[1])
    rng = np.random.default_rng(3)
    obs = [
        Observation(images={"primary": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)}, state=rng.normal(size=4))
        for _ in range(3)
    ]
    return np.stack([session.step(o).actions[0] for o in obs])


def test_from_scratch_trains_every_used_weight_and_writes_a_full_checkpoint(tiny_ckpt, tiny_dataset, tmp_path):
    out = tmp_path / "scratch"
    trainer = Trainer(make_config(tiny_ckpt, tiny_dataset, out, trainable="all", max_steps=3, lr=1e-3))
    before = snapshot(trainer.module)
    trainer.train()
    moved = changed(before, trainer.module)
    unused = unused_by_forward(trainer.policy.model)
    used = {n for n in before if not is_unused(n.removeprefix("vla."), unused)}
    # every weight the forward runs moved, except the padded embedding rows' owner may stay (only rows differ)
    assert used - moved <= {"vla.language_model.model.embed_tokens.weight"}
    assert not any(is_unused(n.removeprefix("vla."), unused) for n in moved)  # the towers' last block: no gradient
    assert not any("lora" in n for n in before)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json", "gates.safetensors",
            "kv_config.json", "dataset_statistics.json", "session_config.json"} <= names  # fmt: skip
    assert "adapter_config.json" not in names
    policy = load_policy(out)  # the gate, statistics and session come from the directory itself
    assert (
        policy.kv_gate is not None
        and policy.session.history == "history"
        and sorted(policy.norm_stats) == ["tiny-reach"]
    )
    trained = trainer.policy.model.state_dict()
    for name, tensor in policy.model.state_dict().items():
        torch.testing.assert_close(
            tensor, trained[name].to(tensor.dtype), atol=0, rtol=0
        )  # float32 source: stored exactly
    np.testing.assert_array_equal(act(policy), act(policy))
    # LoRA on top of it (single mode: the adapter has no gate): the checkpoint's own gate stays in use
    single = tmp_path / "single-on-scratch"
    Trainer(make_config(out, tiny_dataset, single, history="single", max_steps=1, lora={"rank": 4})).train()
    tuned = load_policy(out, adapter=single)
    assert torch.equal(tuned.kv_gate.tau, policy.kv_gate.tau) and tuned.session.history == "single"


def test_gates_only_changes_only_the_gate(tiny_ckpt, tiny_dataset, tmp_path):
    out = tmp_path / "gates"
    trainer = Trainer(make_config(tiny_ckpt, tiny_dataset, out, trainable="gates", max_steps=3))
    before = snapshot(trainer.module)
    trainer.train()
    moved = changed(before, trainer.module)
    assert moved and all(n.startswith("gate.") for n in moved)
    names = {p.name for p in out.iterdir()}
    assert {
        "gates.safetensors",
        "kv_config.json",
        "dataset_statistics.json",
    } <= names and "adapter_config.json" not in names
    policy = load_policy(tiny_ckpt, adapter=out)
    assert torch.equal(policy.kv_gate.tau.cpu(), trainer.gate.tau.detach().cpu())


def test_single_mode_trains_without_a_gate(tiny_ckpt, tiny_dataset, tmp_path):
    out = tmp_path / "single"
    trainer = Trainer(
        make_config(
            tiny_ckpt,
            tiny_dataset,
            out,
            history="single",
            max_steps=2,
            lora={"target_modules": "llm-linear"},
            action_vocab_loss=False,
        )
    )
    assert trainer.gate is None and all(len(lay.target_pos) == 7 for lay in trainer.data.layouts.values())
    assert len(trainer.data.windows) == 39  # every frame is a sample
    trainer.train()
    assert not (out / "gates.safetensors").exists()
    assert json.loads((out / "session_config.json").read_text())["history"] == "single"
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert all("vision" not in t and "lm_head" not in t for t in adapter["target_modules"])


class Killed(Exception):
    pass


def test_resume_continues_exactly(tiny_ckpt, tiny_dataset, tmp_path, monkeypatch):
    run = {"max_steps": 4, "save_every": 2, "lora": {"rank": 4}, "lr": 1e-2, "lr_schedule": "cosine"}
    Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "straight", **run)).train()
    save = outputs.save_training_state

    def save_then_die(out, *, params, optimizer, state):
        save(out, params=params, optimizer=optimizer, state=state)
        raise Killed(f"killed after step {state['step']}")

    monkeypatch.setattr(outputs, "save_training_state", save_then_die)
    with pytest.raises(Killed, match="after step 2"):
        Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "killed", **run)).train()
    monkeypatch.setattr(outputs, "save_training_state", save)
    with pytest.raises(ValueError, match="already holds a fine-tuning run"):
        Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "killed", **run))
    with pytest.raises(ValueError, match=r"lr: 0.01 -> 0.02"):
        Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "killed", **{**run, "lr": 2e-2}, resume=True))
    resumed = Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "killed", **run, resume=True))
    assert resumed.start_step == 2
    resumed.train()
    straight = load_file(str(tmp_path / "straight" / "checkpoints" / "last" / "trainable.safetensors"))
    halves = load_file(str(tmp_path / "killed" / "checkpoints" / "last" / "trainable.safetensors"))
    for name in straight:
        torch.testing.assert_close(halves[name], straight[name], atol=1e-6, rtol=1e-5)
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [2, 4]


def test_cli_runs_from_a_yaml_config_with_flag_overrides(tiny_ckpt, tiny_dataset, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"checkpoint: {tiny_ckpt}\ndataset: {tiny_dataset}\nbatch_size: 2\nkv:\n  chunk: 4\ndata:\n  window: 3\n  image_aug: true\n"
        f"  cache_dir: {tmp_path / 'cache'}\nlora:\n  rank: 4\n"
    )
    out = tmp_path / "cli"
    assert main(["--config", str(config), "--out", str(out), "--max-steps", "2", "--stride", "3", "--merge", "--chunk-mass"]) == 0
    saved = (out / "finetune_config.yaml").read_text()
    assert "stride: 3" in saved and "rank: 4" in saved and "mode: chunked" in saved and "image_aug: true" in saved
    assert "chunk_mass: true" in saved
    assert json.loads((out / "kv_config.json").read_text())["kv"]["chunk_mass"] is True  # what inference reads
    assert json.loads((out / "session_config.json").read_text())["center_crop"] is True
    assert (out / "merged" / "model.safetensors").is_file()
    assert main(["--config", str(config), "--out", str(out), "--max-steps", "2"]) == 2
    assert "already holds a fine-tuning run" in capsys.readouterr().err


def test_gradient_checkpointing_gives_the_same_training(tiny_ckpt, tiny_dataset, tmp_path):
    run = {"max_steps": 2, "lora": {"rank": 4}, "lr": 1e-2}
    for name, flag in (("plain", False), ("checkpointed", True)):
        Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / name, gradient_checkpointing=flag, **run)).train()
    plain = load_file(str(tmp_path / "plain" / "checkpoints" / "last" / "trainable.safetensors"))
    checkpointed = load_file(str(tmp_path / "checkpointed" / "checkpoints" / "last" / "trainable.safetensors"))
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trains_under_bf16_autocast_with_gradient_checkpointing(tiny_ckpt, tiny_dataset, tmp_path):
    out = tmp_path / "cuda"
    trainer = Trainer(make_config(tiny_ckpt, tiny_dataset, out, max_steps=3, gradient_checkpointing=True))
    assert trainer.device.type == "cuda" and next(trainer.module.parameters()).dtype == torch.float32
    trainer.train()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in log)
    policy = load_policy(tiny_ckpt, adapter=out, device="cuda")
    assert np.isfinite(act(policy)).all()
