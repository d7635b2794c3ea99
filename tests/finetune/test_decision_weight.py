"""Decision weights (``--decision-weight W --decision-span K``): every action token of the K steps after each
recorded cue step (counting's presses) weighs W in the action loss."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_finetune.config import FinetuneConfig
from vla_finetune.cue_targets import decision_weights
from vla_finetune.data import IGNORE
from vla_finetune.model import change_weights
from vla_finetune.trainer import Trainer

from .conftest import CUE_STEPS, LENGTHS, WHOLE, make_config, outputs_with, training_batch


def test_the_span_after_each_cue_step_gets_the_weight():
    got = decision_weights(CUE_STEPS, LENGTHS, span=2, weight=3.0)
    w = 3.0
    expected = [
        [1, 1, 1, w, w, 1, w, w, 1, 1],  # presses at 2 and 5: frames 3-4 and 6-7
        [1] * 10,
        [1, w, w, w, 1, 1, 1, 1, 1],  # 0 and 1 overlap; 8 is the last frame (nothing after it)
        [1] * 10,
    ]
    np.testing.assert_array_equal(got, np.concatenate(expected).astype(np.float32))
    with pytest.raises(ValueError, match="3 episodes' cue steps for 4 episodes"):
        decision_weights(CUE_STEPS[:3], LENGTHS, span=2, weight=3.0)


@pytest.fixture(scope="module")
def trainer(tiny_ckpt, cue_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "decision"
    cfg = make_config(
        tiny_ckpt, cue_dataset, out, trainable="all", decision_weight=4.0, decision_span=3, change_weight=2.0,
        gate={"retention_weight": 0.0}, **WHOLE,
    )  # fmt: skip  (no retention term: the loss is the action loss alone)
    return Trainer(cfg)


def test_the_loss_is_the_mean_of_the_cross_entropy_weighted_by_decision_and_change(trainer, monkeypatch):
    data, module = trainer.data, trainer.module
    batch, layout = training_batch(trainer, [0, 2])
    every = decision_weights(CUE_STEPS, LENGTHS, span=3, weight=4.0)
    steps, action_dim = batch["pixels"].shape[1], data.action_dim
    for row, w in enumerate([data.windows[0], data.windows[2]]):
        first, length, _ = data.segments[w.episode]
        expected = every[first + np.minimum(np.arange(steps), length - 1)]  # padding repeats the last frame
        np.testing.assert_array_equal(batch["step_weight"][row].numpy(), expected)
    seen = {}
    action_logits = module.action_logits
    monkeypatch.setattr(module, "action_logits", lambda h: seen.setdefault("logits", action_logits(h)))
    with torch.no_grad():
        out = module(batch, layout, temperature=0.5)
    labels = batch["labels"]
    valid = labels != IGNORE
    target = (labels - module.loss.action_range[0]).masked_fill(~valid, IGNORE)
    ce = F.cross_entropy(seen["logits"].flatten(0, 1), target.flatten(), reduction="none", ignore_index=IGNORE)
    weight = change_weights(labels, steps=steps, weight=2.0) * valid
    weight = weight * batch["step_weight"].repeat_interleave(action_dim, dim=1)
    assert {4.0, 8.0} <= set(weight.unique().tolist())  # decision alone, and decision times change
    rows = 2 / trainer.cfg.batch_size
    torch.testing.assert_close(out["loss"], rows * (ce.view_as(labels) * weight).sum() / weight.sum())
    seen.clear()
    plain = outputs_with(module, batch, layout, monkeypatch, step_weights=False)["loss"]
    unweighted = change_weights(labels, steps=steps, weight=2.0) * valid
    torch.testing.assert_close(plain, rows * (ce.view_as(labels) * unweighted).sum() / unweighted.sum())
    assert not torch.isclose(plain, out["loss"])


def test_a_dataset_without_cue_steps_or_a_bad_weight_is_refused(tiny_ckpt, tiny_dataset, tmp_path):
    cfg = make_config(tiny_ckpt, tiny_dataset, tmp_path / "run", trainable="all", decision_weight=3.0, **WHOLE)
    with pytest.raises(ValueError, match="episode_cue_steps.*decision_weight.*record_cue_steps.py"):
        Trainer(cfg)
    with pytest.raises(ValueError, match="decision_weight"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, decision_weight=0.5)
    with pytest.raises(ValueError, match="decision_span"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, decision_span=0)
