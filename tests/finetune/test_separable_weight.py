"""Separable weights (``--separable-weight W --separable-span K``): every action token of each episode's first K
recorded separable steps (``episode_separable_steps``: where the expert's action depends on the answer) weighs W in
the action loss, on top of the decision weights."""

import argparse

import numpy as np
import pytest
import torch

from vla_finetune.args import add_arguments, config_from_args
from vla_finetune.config import FinetuneConfig
from vla_finetune.cue_targets import decision_weights, separable_weights
from vla_finetune.trainer import Trainer

from .conftest import LENGTHS, WHOLE, make_config, training_batch, write_dataset

CUE_STEPS = [[2], [], [2], [9]]
SEPARABLE = [[7, 4, 5, 6], [], [3, 8], [9]]  # per episode of lengths 10, 10, 9, 10 (unsorted on purpose)


def test_the_first_span_separable_steps_of_each_episode_get_the_weight():
    w = 3.0
    got = separable_weights(SEPARABLE, LENGTHS, span=2, weight=w)
    expected = [
        [1, 1, 1, 1, w, w, 1, 1, 1, 1],  # the first two in time (4 and 5), not the first two listed
        [1] * 10,
        [1, 1, 1, w, 1, 1, 1, 1, w],
        [1] * 9 + [w],
    ]
    np.testing.assert_array_equal(got, np.concatenate(expected).astype(np.float32))
    every = separable_weights(SEPARABLE, LENGTHS, span=None, weight=w)
    assert every.reshape(-1)[4:8].tolist() == [w] * 4 and int((every == w).sum()) == 7
    with pytest.raises(ValueError, match="3 episodes' separable steps for 4 episodes"):
        separable_weights(SEPARABLE[:3], LENGTHS, span=2, weight=w)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "sep", cue_steps=CUE_STEPS, separable_steps=SEPARABLE)


def test_the_batch_weights_are_the_product_of_decision_and_separable_weights(tiny_ckpt, data_dir, tmp_path):
    cfg = make_config(
        tiny_ckpt, data_dir, tmp_path / "run", trainable="all", separable_weight=5.0, separable_span=3,
        decision_weight=2.0, decision_span=1, gate={"retention_weight": 0.0}, **WHOLE,
    )  # fmt: skip
    trainer = Trainer(cfg)
    assert trainer.module.loss.step_weights and "cue_count" not in training_batch(trainer, [0])[0]  # no cue loss asked
    every = separable_weights(SEPARABLE, LENGTHS, span=3, weight=5.0) * decision_weights(CUE_STEPS, LENGTHS, span=1, weight=2.0)
    assert {2.0, 5.0, 10.0} <= set(every.tolist())  # frame 3 of the third episode: after a cue step and separable
    batch, layout = training_batch(trainer, [0, 2])
    steps = batch["pixels"].shape[1]
    for row, w in enumerate([trainer.data.windows[0], trainer.data.windows[2]]):
        first, length, _ = trainer.data.segments[w.episode]
        np.testing.assert_array_equal(batch["step_weight"][row].numpy(), every[first + np.minimum(np.arange(steps), length - 1)])
    with torch.no_grad():
        weighted = trainer.module(batch, layout, temperature=0.5)["loss"]
        batch["step_weight"] = torch.ones_like(batch["step_weight"])
        plain = trainer.module(batch, layout, temperature=0.5)["loss"]
    assert not torch.isclose(weighted, plain)


def test_separable_weights_alone_train_end_to_end(tiny_ckpt, data_dir, tmp_path):
    cfg = make_config(tiny_ckpt, data_dir, tmp_path / "run", trainable="all", separable_weight=4.0, max_steps=2, **WHOLE)
    trainer = Trainer(cfg)
    np.testing.assert_array_equal(trainer.data.step_weight, separable_weights(SEPARABLE, LENGTHS, span=8, weight=4.0))
    trainer.train()
    assert (tmp_path / "run" / "model.safetensors").exists()


def test_a_dataset_without_separable_steps_or_a_bad_setting_is_refused(tiny_ckpt, tiny_dataset, tmp_path):
    cfg = make_config(tiny_ckpt, tiny_dataset, tmp_path / "run", trainable="all", separable_weight=3.0, **WHOLE)
    with pytest.raises(ValueError, match="episode_separable_steps.*separable_weight.*record_cue_steps.py"):
        Trainer(cfg)
    with pytest.raises(ValueError, match="separable_weight"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, separable_weight=0.5)
    with pytest.raises(ValueError, match="separable_span"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, separable_span=0)
    assert FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, separable_span=None).separable_span is None


def test_the_flags_reach_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(tmp_path), "--dataset", str(tmp_path), "--out", str(tmp_path),
                              "--separable-weight", "8", "--separable-span", "6"])  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.separable_weight, cfg.separable_span) == (8.0, 6)


@pytest.mark.parametrize("steps", [[7, 12], [-1, 3]])
def test_recorded_steps_outside_their_episode_are_refused_by_name(steps):
    """A trimmed episode's step past its end raised an IndexError; a negative one weighted the episode's last frames."""
    with pytest.raises(ValueError, match=r"episode 1 records separable steps \[.*\] outside its 9 frames"):
        separable_weights([[0], steps], [5, 9], span=None, weight=3.0)
    with pytest.raises(ValueError, match=r"episode 1 records cue steps \[.*\] outside its 9 frames"):
        decision_weights([[0], steps], [5, 9], span=2, weight=3.0)
