"""The auxiliary cue-count loss (``--cue-weight``): a linear probe on each step's hidden state regresses how many
of its episode's recorded cue steps (``episode_cue_steps``; counting's presses) are at or before the step."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vla_finetune.config import FinetuneConfig
from vla_finetune.cue_targets import cue_counts
from vla_finetune.data import IGNORE
from vla_finetune.trainer import Trainer

from .conftest import CUE_STEPS, WHOLE, make_config, outputs_with, training_batch


@pytest.fixture(scope="module")
def trained(tiny_ckpt, cue_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "cue"
    cfg = make_config(tiny_ckpt, cue_dataset, out, trainable="all", max_steps=2, lr=1e-3, cue_weight=0.5, **WHOLE)
    trainer = Trainer(cfg)
    trainer.train()
    return trainer, out


def test_cue_counts_count_the_cue_steps_at_or_before_each_frame():
    counts = cue_counts(CUE_STEPS, [10, 10, 9, 10])
    expected = [
        [0, 0, 1, 1, 1, 2, 2, 2, 2, 2],
        [0] * 10,
        [1, 2, 2, 2, 2, 2, 2, 2, 3],
        [0] * 9 + [1],
    ]
    np.testing.assert_array_equal(counts, np.concatenate(expected).astype(np.float32))
    with pytest.raises(ValueError, match="3 episodes' cue steps for 4 episodes"):
        cue_counts(CUE_STEPS[:3], [10, 10, 9, 10])


def test_batches_carry_each_steps_cue_count_and_the_probe_adds_its_error(trained, monkeypatch):
    trainer, _ = trained
    data, module = trainer.data, trainer.module
    batch, layout = training_batch(trainer, [0, 2])
    every = cue_counts(CUE_STEPS, [10, 10, 9, 10])  # standardised over the dataset's frames
    mean, std = every.mean(), every.std()
    for row, w in enumerate([data.windows[0], data.windows[2]]):
        first, length, _ = data.segments[w.episode]
        steps = np.arange(batch["cue_count"].shape[1])
        counts = cue_counts([CUE_STEPS[w.episode]], [length])[np.minimum(steps, length - 1)]  # padding repeats the last
        np.testing.assert_allclose(batch["cue_count"][row].numpy(), (counts - mean) / std, rtol=1e-6)
    seen = {}
    decoder_hook = module.vla.language_model.model.register_forward_hook(lambda m, a, out: seen.update(hidden=out))
    probe_hook = module.cue_head.register_forward_hook(lambda m, a, out: seen.update(probe_in=a[0], probe_out=out))
    try:
        with torch.no_grad():
            with_cue = module(batch, layout, temperature=0.5)
    finally:
        decoder_hook.remove()
        probe_hook.remove()
    steps, action_dim = batch["pixels"].shape[1], data.action_dim
    torch.testing.assert_close(seen["probe_in"], seen["hidden"][:, layout.target_pos.view(steps, action_dim)[:, 0]])
    real = (batch["labels"].view(2, steps, action_dim)[:, :, 0] != IGNORE).float()
    assert 0 < real.sum() < real.numel()  # the 9-step episode is padded: its padding is not counted
    err = (seen["probe_out"][..., 0] - batch["cue_count"]).pow(2)
    expected_mse = (err * real).sum() / real.sum()
    torch.testing.assert_close(with_cue["cue_mse"], expected_mse)
    without = outputs_with(module, batch, layout, monkeypatch, cue_weight=0.0)
    torch.testing.assert_close(with_cue["loss"] - without["loss"], 2 / trainer.cfg.batch_size * 0.5 * expected_mse)
    assert float(without["cue_mse"]) == 0.0


def test_the_cue_loss_trains_the_decoder_and_the_probe(trained, monkeypatch):
    trainer, _ = trained
    module = trainer.module
    batch, layout = training_batch(trainer, [1])
    with_cue = module(batch, layout, temperature=0.5)["loss"]
    cue_only = with_cue - outputs_with(module, batch, layout, monkeypatch, grad=True, cue_weight=0.0)["loss"]
    params = [module.cue_head.weight, *(p for p in module.vla.language_model.parameters() if p.requires_grad)]
    grads = torch.autograd.grad(cue_only, params, allow_unused=True)
    assert float(grads[0].abs().sum()) > 0
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads[1:])


def test_a_run_logs_the_cue_error_and_saves_no_probe(trained):
    trainer, out = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(np.isfinite(r["cue_mse"]) and r["cue_mse"] > 0 for r in log)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert not any("cue" in k for k in f.keys())
    assert "cue_head.weight" in trainer.trainable_state()  # ... but a resumed run continues the probe


def test_a_dataset_without_cue_steps_is_refused_with_the_fix(tiny_ckpt, tiny_dataset, tmp_path):
    cfg = make_config(tiny_ckpt, tiny_dataset, tmp_path / "run", trainable="all", cue_weight=1.0, **WHOLE)
    with pytest.raises(ValueError, match="episode_cue_steps.*record_cue_steps.py"):
        Trainer(cfg)
    with pytest.raises(ValueError, match="cue_weight"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, cue_weight=-1.0)
