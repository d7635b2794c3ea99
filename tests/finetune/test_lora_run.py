"""One LoRA + gate run (30 steps, trained once per module): it learns, touches only LoRA and gate
weights, writes every artefact, and its outputs load back through ``load_policy``."""

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vla_finetune.merge import merge_adapter
from vla_finetune.trainer import Trainer
from vla_runtime.api import Observation, load_policy
from vla_runtime.config import SessionConfig
from vla_runtime.kv import KVMode

from .conftest import TASKS, make_config, training_and_streaming_hidden

STEPS = 30


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def run(tiny_ckpt, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "lora"
    cfg = make_config(
        tiny_ckpt, tiny_dataset, out, max_steps=STEPS, log_every=5, lr=2e-3, gate={"retention_target": 0.5}
    )
    trainer = Trainer(cfg)
    before = {name: digest(p) for name, p in trainer.module.named_parameters()}
    trainer.train()
    return trainer, before, out


def test_loss_decreases_and_gate_moves_toward_the_target(run):
    _, _, out = run
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(5, STEPS + 1, 5))
    assert log[-1]["ce"] < 0.8 * log[0]["ce"]
    assert log[-1]["accuracy"] > log[0]["accuracy"]
    # the untrained gate keeps ~95% (sigmoid(3)); the retention term pulls the mean toward 0.5
    assert log[0]["kept_ratio"] > 0.85 and abs(log[-1]["kept_ratio"] - 0.5) < abs(log[0]["kept_ratio"] - 0.5)
    assert all(r["steps_per_s"] > 0 and r["lr"] == pytest.approx(2e-3) for r in log)


def test_only_lora_and_gate_weights_change(run):
    trainer, before, _ = run
    after = {name: digest(p) for name, p in trainer.module.named_parameters()}
    changed = {name for name in before if before[name] != after[name]}
    lora = {n for n in before if ".lora_A." in n or ".lora_B." in n}
    gate = {n for n in before if n.startswith("gate.")}
    base = set(before) - lora - gate
    assert lora and gate and base
    assert changed & base == set()  # every base weight hashes the same
    assert {n for n in lora if ".lora_B." in n} <= changed  # B starts at zero: every adapter learned
    assert {"gate.tau", "gate.readout_bias", "gate.readout_weight"} <= changed
    assert len(changed & gate) >= len(gate) - 1  # fc2 of an aggregator may stay ~0, the rest moves


def test_outputs_in_the_expected_formats(run, tiny_dataset):
    trainer, _, out = run
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "gates.safetensors", "kv_config.json", "dataset_statistics.json",
            "session_config.json", "finetune_config.yaml", "train_log.jsonl", "training_curves.png"} <= names  # fmt: skip
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 32 and adapter["lora_alpha"] == 16 and adapter["lora_dropout"] == 0.0
    assert adapter["init_lora_weights"] == "gaussian"
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for layer in ("language_model.lm_head", "language_model.model.layers.1.self_attn.q_proj", "projector.fc3",
                  "vision_backbone.fused_featurizer.blocks.1.mlp.fc2", "proprio_projector.fc1"):  # fmt: skip
        assert f"base_model.model.{layer}.lora_A.weight" in keys
    assert not any(".blocks.2." in k for k in keys)  # the towers' last block never runs
    stats = json.loads((out / "dataset_statistics.json").read_text())
    entry = stats["tiny-reach"]
    actions = trainer.data.decoded.actions
    assert entry["action"]["mask"] == [True] * 6 + [False]
    np.testing.assert_allclose(entry["action"]["q01"], np.quantile(actions.astype(np.float64), 0.01, axis=0))
    np.testing.assert_allclose(entry["action"]["q99"], np.quantile(actions.astype(np.float64), 0.99, axis=0))
    assert len(entry["proprio"]["q99"]) == 4 and entry["num_transitions"] == 39 and entry["num_trajectories"] == 4
    kv = json.loads((out / "kv_config.json").read_text())["kv"]
    assert kv["mode"] == "chunked" and kv["chunk"] == 4 and kv["window"] == trainer.kv.params.window > 0
    session = json.loads((out / "session_config.json").read_text())
    assert session["history"] == "history" and session["kv"] == kv


def observations(n: int = 5) -> list[Observation]:
    rng = np.random.default_rng(7)
    return [
        Observation(images={"primary": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)}, state=rng.normal(size=4))
        for _ in range(n)
    ]


def rollout(policy, config: SessionConfig | None = None) -> np.ndarray:
    session = policy.new_session(TASKS[0], config)
    return np.stack([session.step(o).actions[0] for o in observations()])


def test_adapter_loads_and_changes_the_actions_deterministically(run, tiny_ckpt):
    _, _, out = run
    tuned = load_policy(tiny_ckpt, adapter=out)
    assert tuned.session.history == "history" and tuned.kv.mode is KVMode.CHUNKED and tuned.kv_gate is not None
    assert sorted(tuned.norm_stats) == ["tiny-reach"]  # the run's statistics replaced the checkpoint's
    first, second = rollout(tuned), rollout(tuned)
    np.testing.assert_array_equal(first, second)
    base = rollout(load_policy(tiny_ckpt), SessionConfig(history="history", kv=tuned.kv, unnorm_key="bridge_orig"))
    assert not np.allclose(first, base)
    assert np.all((first[:, 6] >= -1) & (first[:, 6] <= 1))  # gripper: un-normalised dimension, bin centres


def test_merged_checkpoint_equals_base_plus_adapter(run, tiny_ckpt, tmp_path):
    _, _, out = run
    merged = merge_adapter(tiny_ckpt, out, tmp_path / "merged")
    names = {p.name for p in merged.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json", "dataset_statistics.json",
            "gates.safetensors", "kv_config.json", "session_config.json"} <= names  # fmt: skip
    config = json.loads((merged / "config.json").read_text())
    assert sorted(config["norm_stats"]) == ["tiny-reach"] and config["torch_dtype"] == "float32"
    np.testing.assert_array_equal(rollout(load_policy(merged)), rollout(load_policy(tiny_ckpt, adapter=out)))


def test_training_form_sees_what_streaming_inference_sees(run):
    """Teacher-forced: the parallel form at a near-zero temperature (hard gates) and the runtime's cache
    fed forward by forward (``embed_forward`` + ``ChunkedGatedCache`` with the trained gate) give the same
    hidden states at every action target, for windows at an episode's start and in its middle."""
    trainer, _, _ = run
    for start in (0, 4):
        index = next(i for i, w in enumerate(trainer.data.windows) if w.episode == 1 and w.start == start)
        parallel, streamed, cache, schedule = training_and_streaming_hidden(trainer, index)
        stats = cache.stats()  # chunk counts are summed over layers
        assert schedule.n_chunks >= 3
        assert stats.chunks_retained + stats.chunks_dropped == schedule.n_chunks * cache.geometry.n_layers
        assert stats.chunks_dropped > 0  # the trained gate drops chunks: the windows exercise compression
        torch.testing.assert_close(parallel, streamed, atol=1e-4, rtol=1e-4)
