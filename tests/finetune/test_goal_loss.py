"""The auxiliary goal loss (``--goal-weight``): a linear probe on each step's hidden state regresses the
normalised robot state of the episode's last frame; it adds to the action loss, teaches the towers and the
decoder through the same forward, and is not saved with the policy."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vla_finetune.config import FinetuneConfig
from vla_finetune.data import IGNORE
from vla_finetune.trainer import Trainer

from .conftest import WHOLE, make_config, outputs_with, training_batch


@pytest.fixture(scope="module")
def trained(tiny_ckpt, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "goal"
    cfg = make_config(tiny_ckpt, tiny_dataset, out, trainable="all", max_steps=2, lr=1e-3, goal_weight=2.0, **WHOLE)
    trainer = Trainer(cfg)
    trainer.train()
    return trainer, out


def test_the_goal_is_the_normalised_state_of_each_episodes_last_frame(trained):
    trainer, _ = trained
    data = trainer.data
    batch, _ = training_batch(trainer, [0, 2])
    for row, w in enumerate([data.windows[0], data.windows[2]]):
        first, length, _ = data.segments[w.episode]
        torch.testing.assert_close(batch["goal"][row], torch.from_numpy(data.proprio[first + length - 1]))
    assert not torch.equal(batch["goal"][0], batch["goal"][1])  # one target per episode, not one per dataset


def test_the_probe_reads_each_steps_first_action_position_and_adds_its_error(trained, monkeypatch):
    trainer, _ = trained
    module = trainer.module
    batch, layout = training_batch(trainer, [0, 2])
    seen = {}
    decoder_hook = module.vla.language_model.model.register_forward_hook(lambda m, a, out: seen.update(hidden=out))
    probe_hook = module.goal_head.register_forward_hook(lambda m, a, out: seen.update(probe_in=a[0], probe_out=out))
    try:
        with torch.no_grad():
            with_goal = module(batch, layout, temperature=0.5)
    finally:
        decoder_hook.remove()
        probe_hook.remove()
    steps, action_dim = batch["pixels"].shape[1], trainer.data.action_dim
    first_targets = layout.target_pos.view(steps, action_dim)[:, 0]
    torch.testing.assert_close(seen["probe_in"], seen["hidden"][:, first_targets])
    real = (batch["labels"].view(2, steps, action_dim)[:, :, 0] != IGNORE).float()  # the 9-step episode is padded
    assert 0 < real.sum() < real.numel()
    err = (seen["probe_out"] - batch["goal"][:, None]).pow(2).mean(-1)
    expected = (err * real).sum() / real.sum()
    torch.testing.assert_close(with_goal["goal_mse"], expected)
    without = outputs_with(module, batch, layout, monkeypatch, goal_weight=0.0)
    rows = 2 / trainer.cfg.batch_size
    torch.testing.assert_close(with_goal["loss"] - without["loss"], rows * 2.0 * expected)
    assert float(without["goal_mse"]) == 0.0


def test_the_goal_loss_trains_the_vision_towers_and_the_probe(trained, monkeypatch):
    trainer, _ = trained
    module = trainer.module
    batch, layout = training_batch(trainer, [1])
    goal_only = module(batch, layout, temperature=0.5)["loss"]
    head = module.goal_head
    goal_only = goal_only - outputs_with(module, batch, layout, monkeypatch, grad=True, goal_weight=0.0)["loss"]
    params = [head.weight, *(p for p in module.vla.vision_backbone.parameters() if p.requires_grad)]
    assert len(params) > 1
    grads = torch.autograd.grad(goal_only, params, allow_unused=True)
    assert float(grads[0].abs().sum()) > 0
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads[1:])


def test_a_run_logs_the_goal_error_and_saves_no_probe(trained):
    trainer, out = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(np.isfinite(r["goal_mse"]) and r["goal_mse"] > 0 for r in log)
    assert "goal_weight: 2.0" in (out / "finetune_config.yaml").read_text()
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and not any("goal" in k for k in keys)
    assert "goal_head.weight" in trainer.trainable_state()  # ... but a resumed run continues the probe


def test_a_negative_goal_weight_is_refused(tmp_path):
    with pytest.raises(ValueError, match="goal_weight"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, goal_weight=-1.0)
