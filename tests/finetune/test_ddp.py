"""``torchrun`` with 2 CPU ranks (gloo) trains the same weights as 1 rank with 2 accumulation steps."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from vla_finetune.trainer import Trainer

from .conftest import make_config

RUN = {"max_steps": 2, "batch_size": 2, "lr": 1e-2, "lora": {"rank": 8}, "log_every": 1}


def trainable(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / "last" / "trainable.safetensors"))


def test_two_ranks_match_one_rank_with_gradient_accumulation(tiny_ckpt, tiny_dataset, tmp_path):
    Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "one", grad_accum=2, **RUN)).train()
    flags = [
        "--checkpoint", str(tiny_ckpt), "--dataset", str(tiny_dataset), "--out", str(tmp_path / "two"), "--window", "3",
        "--stride", "2", "--chunk", "4", "--batch-size", "2", "--grad-accum", "1", "--max-steps", "2", "--log-every", "1",
        "--lora-rank", "8", "--lr", "1e-2", "--threads", "1", "--cache-dir", str(tmp_path / "frame-cache"),
    ]  # fmt: skip
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "vla_finetune.train",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, *flags], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    single, ddp = trainable(tmp_path / "one"), trainable(tmp_path / "two")
    assert set(single) == set(ddp) and "gate.tau" in single
    assert any((single[k] != 0).any() for k in single if ".lora_B." in k)  # it trained (B starts at zero)
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
