"""Frames already at the model's size travel as uint8 and are normalised on the training device: the same
pixel values, so the same loss, as the processor's float pixels (an eighth of the bytes to move)."""

import numpy as np
import torch

from vla_finetune.trainer import Trainer

from .conftest import make_config, write_dataset


def test_frames_at_the_models_size_are_normalised_on_the_device_as_the_processor_would(tiny_ckpt, tmp_path):
    dataset = write_dataset(tmp_path / "data-28", size=28)  # the tiny checkpoint's towers take 28 px
    trainer = Trainer(make_config(tiny_ckpt, dataset, tmp_path / "run", max_steps=2, lora={"dropout": 0.0}))
    batch = trainer.data.batch(next(iter(trainer.data.buckets.values()))[:2], np.random.default_rng(0))  # one bucket
    frames = batch["frames"]
    assert frames.dtype == torch.uint8 and frames.shape[2:] == (28, 28, 3) and "pixels" not in batch
    processor = trainer.policy.image_processor
    one_by_one = torch.stack([processor(f) for f in frames.flatten(0, 1).numpy()])  # PIL + torchvision, per frame
    expected = one_by_one.view(*frames.shape[:2], -1, 28, 28)
    assert torch.equal(trainer.module.pixels(batch), expected)
    layout = trainer.data.layouts[tuple(batch.pop("key"))]
    batch.pop("tokens")
    as_pixels = {**{k: v for k, v in batch.items() if k != "frames"}, "pixels": expected}
    with torch.no_grad():
        assert torch.equal(trainer.module(batch, layout)["loss"], trainer.module(as_pixels, layout)["loss"])
    trainer.train()  # and a run end to end on uint8 frames
    assert (tmp_path / "run" / "train_log.jsonl").read_text().count("\n") >= 1
