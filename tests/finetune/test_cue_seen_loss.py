"""The auxiliary cue-seen loss (``--cue-seen-weight``): a linear probe on each image token, max-pooled over a frame's
tokens, classifies whether a cue is drawn into the frame (the recorded ``episode_cue_steps``), class-balanced."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from vla_finetune.config import FinetuneConfig
from vla_finetune.cue_targets import cue_seen
from vla_finetune.data import IGNORE
from vla_finetune.model import seen_error
from vla_finetune.trainer import Trainer

from .conftest import CUE_STEPS, LENGTHS, WHOLE, make_config, outputs_with, training_batch


@pytest.fixture(scope="module")
def trained(tiny_ckpt, cue_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "seen"
    cfg = make_config(tiny_ckpt, cue_dataset, out, trainable="all", max_steps=2, lr=1e-3, cue_seen_weight=0.5, **WHOLE)
    trainer = Trainer(cfg)
    trainer.train()
    return trainer, out


def test_cue_seen_marks_exactly_the_cue_steps():
    seen = cue_seen(CUE_STEPS, LENGTHS)
    expected = np.zeros(sum(LENGTHS), dtype=np.float32)
    starts = np.cumsum([0, *LENGTHS[:-1]])
    for start, steps in zip(starts, CUE_STEPS):
        expected[start + np.asarray(steps, dtype=int)] = 1
    np.testing.assert_array_equal(seen, expected)
    with pytest.raises(ValueError, match="outside its 9 frames"):
        cue_seen([[2], [], [9], [0]], LENGTHS)


def test_seen_error_is_the_class_balanced_bce_of_the_frames_best_token():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 1)
    image = torch.randn(2, 3, 5, 8)  # [B, S, n_image, dim]
    seen = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    real = torch.tensor([[True, True, True], [True, True, False]])  # the last step is padding: its label is ignored
    logits = head(image)[..., 0].amax(-1)
    bce = F.binary_cross_entropy_with_logits(logits, seen, reduction="none")
    expected = 0.5 * (bce[0, 0] + (bce[0, 1] + bce[0, 2] + bce[1, 0] + bce[1, 1]) / 4)
    torch.testing.assert_close(seen_error(head, image, seen, real), expected)
    only_negatives = torch.zeros_like(seen)  # a batch without a cue frame: the negatives' mean alone
    negatives_only = F.binary_cross_entropy_with_logits(logits[real], only_negatives[real])
    torch.testing.assert_close(seen_error(head, image, only_negatives, real), negatives_only)
    # the max over tokens: raising one token's logit on a positive frame lowers the loss; on a negative one raises it
    bump = torch.zeros_like(image)
    bump[0, 0, 3] = head.weight[0] * 10
    assert seen_error(head, image + bump, seen, real) < seen_error(head, image, seen, real)
    bump = torch.zeros_like(image)
    bump[0, 1, 3] = head.weight[0] * 10
    assert seen_error(head, image + bump, seen, real) > seen_error(head, image, seen, real)


def test_batches_carry_each_frames_label_and_the_probe_reads_the_image_tokens(trained, monkeypatch):
    trainer, _ = trained
    data, module = trainer.data, trainer.module
    batch, layout = training_batch(trainer, [0, 2])
    for row, w in enumerate([data.windows[0], data.windows[2]]):
        length = data.segments[w.episode][1]
        steps = np.arange(batch["cue_seen"].shape[1])
        labels = cue_seen([CUE_STEPS[w.episode]], [length])[np.minimum(steps, length - 1)]  # padding repeats the last
        np.testing.assert_array_equal(batch["cue_seen"][row].numpy(), labels)
    seen = {}
    image_hook = module.vla.projector.register_forward_hook(lambda m, a, out: seen.update(image=out))
    probe_hook = module.seen_head.register_forward_hook(lambda m, a, out: seen.update(probe_in=a[0]))
    try:
        with torch.no_grad():
            with_seen = module(batch, layout, temperature=0.5)
    finally:
        image_hook.remove()
        probe_hook.remove()
    steps, action_dim = batch["pixels"].shape[1], data.action_dim
    torch.testing.assert_close(seen["probe_in"], seen["image"].reshape(2, steps, -1, seen["image"].shape[-1]))
    real = batch["labels"].view(2, steps, action_dim)[:, :, 0] != IGNORE
    assert 0 < real.sum() < real.numel()  # the 9-step episode is padded
    expected = seen_error(module.seen_head, seen["probe_in"], batch["cue_seen"], real)
    torch.testing.assert_close(with_seen["seen_bce"], expected)
    without = outputs_with(module, batch, layout, monkeypatch, cue_seen_weight=0.0)
    torch.testing.assert_close(with_seen["loss"] - without["loss"], 2 / trainer.cfg.batch_size * 0.5 * expected)
    assert float(without["seen_bce"]) == 0.0


def test_the_cue_seen_loss_trains_the_vision_side_and_not_the_decoder(trained, monkeypatch):
    trainer, _ = trained
    module = trainer.module
    batch, layout = training_batch(trainer, [0])
    with_seen = module(batch, layout, temperature=0.5)["loss"]
    seen_only = with_seen - outputs_with(module, batch, layout, monkeypatch, grad=True, cue_seen_weight=0.0)["loss"]
    vision = [p for p in module.vla.vision_backbone.parameters() if p.requires_grad]
    decoder = [p for p in module.vla.language_model.model.layers.parameters() if p.requires_grad]
    grads = torch.autograd.grad(seen_only, [module.seen_head.weight, *vision, *decoder], allow_unused=True)
    assert float(grads[0].abs().sum()) > 0
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads[1 : 1 + len(vision)])
    assert all(g is None or float(g.abs().sum()) == 0 for g in grads[1 + len(vision) :])


def test_a_run_logs_the_seen_loss_and_saves_no_probe(trained):
    trainer, out = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(np.isfinite(r["seen_bce"]) and r["seen_bce"] > 0 for r in log)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert not any("seen" in k for k in f.keys())
    assert "seen_head.weight" in trainer.trainable_state()  # ... but a resumed run continues the probe


def test_a_dataset_without_cue_steps_or_a_bad_weight_is_refused(tiny_ckpt, tiny_dataset, tmp_path):
    cfg = make_config(tiny_ckpt, tiny_dataset, tmp_path / "run", trainable="all", cue_seen_weight=1.0, **WHOLE)
    with pytest.raises(ValueError, match="cue-seen loss.*record_cue_steps.py"):
        Trainer(cfg)
    with pytest.raises(ValueError, match="cue_seen_weight"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, cue_seen_weight=-1.0)
