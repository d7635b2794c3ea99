"""OpenVLA-OFT through ``vla_finetune`` (single frame: LoRA + the L1 head + the proprio projector): the L1 loss
goes down, only those weights change, the targets are the next K normalised actions, and the outputs load back
through ``load_policy(adapter=)`` giving the trained module's chunks."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch

from vla_finetune.oft_data import chunk_rows
from vla_finetune.oft_history import HistoryLayout
from vla_finetune.train import make_trainer
from vla_finetune.trainer import DistEnv
from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.kv import KVConfig

from .conftest import make_config, write_dataset

STEPS = 24


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def oft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("oft")
    ckpt = make_tiny_openvla_oft(root / "tiny-oft", seed=3, image_size=28, dtype=torch.float32)  # LIBERO: 8 x 7, proprio 8
    dataset = write_dataset(root / "oft-reach", state_dim=8)
    cfg = make_config(ckpt, dataset, root / "run", history="single", max_steps=STEPS, log_every=4, lr=1e-3,
                      batch_size=4, lora={"rank": 8}, data={"window": 1})  # fmt: skip
    trainer = make_trainer(cfg, DistEnv())
    before = {name: digest(p) for name, p in trainer.module.named_parameters()}
    trainer.train()
    return trainer, before, ckpt, root / "run"


def test_l1_loss_goes_down(oft_run):
    _, _, _, out = oft_run
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(4, STEPS + 1, 4))
    assert log[-1]["l1"] < 0.7 * log[0]["l1"], [r["l1"] for r in log]


def test_only_lora_head_and_projector_change(oft_run):
    trainer, before, _, _ = oft_run
    after = {name: digest(p) for name, p in trainer.module.named_parameters()}
    changed = {n for n in before if before[n] != after[n]}
    lora = {n for n in before if ".lora_A." in n or ".lora_B." in n}
    head = {n for n in before if n.startswith(("oft.action_head.", "oft.proprio_projector."))}
    assert lora and head and not any("lm_head" in n for n in lora)  # the parallel forward never runs lm_head
    assert changed - lora - head == set()  # every base weight hashes the same
    assert {n for n in lora if ".lora_B." in n} <= changed and head <= changed


def test_targets_are_the_next_k_normalised_actions(oft_run):
    trainer, _, _, _ = oft_run
    data = trainer.data
    first, length, _ = data.segments[0]
    np.testing.assert_array_equal(chunk_rows(first, length, length - 3, 8), first + np.array([7, 8, 9, 9, 9, 9, 9, 9]))
    stats = data.statistics[next(iter(data.statistics))]["action"]
    lo, hi, mask = (np.asarray(stats[k]) for k in ("q01", "q99", "mask"))
    raw = data.decoded.actions[first + 2 : first + 10]
    expected = np.where(mask, np.clip(2 * (raw - lo) / (hi - lo + 1e-8) - 1, -1, 1), raw)
    sample = next(s for s in data.samples if s.frame == first + 2)
    np.testing.assert_allclose(data.targets(sample), expected, atol=1e-6)


def test_outputs_load_back_and_reproduce_the_trained_chunks(oft_run):
    trainer, _, ckpt, out = oft_run
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", f"action_head--{STEPS}_checkpoint.pt",
            f"proprio_projector--{STEPS}_checkpoint.pt", "dataset_statistics.json"} <= names  # fmt: skip
    policy = load_policy(ckpt, adapter=out, device="cpu", dtype="float32")
    assert policy.norm_stats == json.loads((out / "dataset_statistics.json").read_text())
    session = policy.new_session(trainer.data.segments[0][2])
    data, frame = trainer.data, trainer.data.segments[0][0] + 1
    state = data.decoded.states[frame]
    result = session.step(Observation(images={"primary": data.decoded.frames[frame]}, state=state))
    trainer.module.eval()
    with torch.no_grad():
        batch = data.batch([next(i for i, s in enumerate(data.samples) if s.frame == frame)], np.random.default_rng(0))
        trained = trainer.module.predict(batch)[0].numpy()
    np.testing.assert_allclose(result.actions, session.action_stats.unnormalize(trained), atol=1e-4, rtol=1e-4)
    base = load_policy(ckpt, device="cpu", dtype="float32").new_session(trainer.data.segments[0][2], session.config)
    untrained = base.step(Observation(images={"primary": data.decoded.frames[frame]}, state=state))
    assert np.abs(untrained.actions - result.actions).max() > 1e-3  # the adapter changed what the policy does


def test_unsupported_settings_are_named(tmp_path, oft_run):
    _, _, ckpt, _ = oft_run
    cfg = make_config(ckpt, tmp_path / "none", tmp_path / "run", trainable="all", data={"window": 0})
    with pytest.raises(ValueError, match="its fine-tuning does not support: data.window 0 .*; trainable 'all'"):
        make_trainer(cfg, DistEnv())
    cfg = make_config(ckpt, tmp_path / "none", tmp_path / "run", time_budget=6, save_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"does not support: time_budget \(give max_steps\); save_dtype"):
        make_trainer(cfg, DistEnv())


def test_history_layout_by_hand():
    """P=2, O=2, Q=3 (first action at 2, 1 action token), S=2: P O1 Q1 O2 Q2 at positions 0 1 | 2 3 | 4 5 6 | 4 5 | 6 7 8."""
    layout = HistoryLayout(prompt=2, obs=2, query=3, steps=2, first_action=2, action_tokens=1)
    assert layout.positions().tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    P, O1, Q1, O2, Q2 = [0, 1], [2, 3], [4, 5, 6], [7, 8], [9, 10, 11]
    expected = torch.zeros(12, 12, dtype=torch.bool)
    for rows, cols in ((P, P), (O1, P), (Q1, P + O1 + Q1), (O2, P + O1), (Q2, P + O1 + O2 + Q2)):
        for r in rows:
            expected[r, cols] = True
    for block in (P, O1, O2):  # causal inside the kept parts
        for i, r in enumerate(block):
            expected[r, block[: i + 1]] = True
            expected[r, block[i + 1 :]] = False
    torch.testing.assert_close(layout.mask(), expected)
    assert layout.head_rows().tolist() == [[5], [10]]


@pytest.fixture(scope="module")
def oft_history_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("oft-history")
    ckpt = make_tiny_openvla_oft(root / "tiny-oft", seed=4, image_size=28, dtype=torch.float32)
    dataset = write_dataset(root / "oft-reach", state_dim=8)
    cfg = make_config(ckpt, dataset, root / "run", max_steps=12, log_every=4, lr=1e-3, batch_size=2, lora={"rank": 8},
                      data={"window": 3, "stride": 2})  # fmt: skip
    cfg = dataclasses.replace(cfg, kv=KVConfig())  # history mode with the full cache
    trainer = make_trainer(cfg, DistEnv())
    trainer.train()
    return trainer, ckpt, root / "run"


def test_history_training_forward_equals_the_streamed_session(oft_history_run):
    """The window's one-forward chunks equal a history session's (full cache, loaded from the outputs) step by step;
    the session config the model was trained for is the loaded default."""
    trainer, ckpt, out = oft_history_run
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["l1"] < log[0]["l1"]
    data = trainer.data
    index = next(i for i, s in enumerate(data.samples) if s.frame == data.segments[1][0])  # a window at a segment start
    trainer.module.eval()
    with torch.no_grad():
        trained = trainer.module.predict(data.batch([index], np.random.default_rng(0)))[0].numpy()  # [S, K, A]
    policy = load_policy(ckpt, adapter=out, device="cpu", dtype="float32")
    session = policy.new_session(data.segments[1][2])
    assert session.history and session.cache is not None
    for i, frame in enumerate(data.frames_of(data.samples[index])):
        obs = Observation(images={"primary": data.decoded.frames[frame]}, state=data.decoded.states[frame])
        np.testing.assert_allclose(session.step(obs).actions, session.action_stats.unnormalize(trained[i]), atol=1e-4, rtol=1e-4)
