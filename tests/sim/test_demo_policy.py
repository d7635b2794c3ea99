"""The demo command (``make demo``: the shipped memory policy on memory-order with its chunked cache) and the
recipe for a small policy on Markovian Meta-World tasks."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.sim

CLI = str(Path(sys.executable).with_name("vla-runtime"))


def test_demo_command_runs_a_closed_loop_episode(tmp_path):
    out = subprocess.run([CLI, "demo", "--max-steps", "12", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "policy step: p50" in out.stdout and "KV cache at the end" in out.stdout
    assert ("SUCCESS" in out.stdout) or ("failure after 12 steps" in out.stdout)
    assert "policy mw-memory-openvla" in out.stdout and "memory-order seed 1000" in out.stdout
    assert "chance level of memory-order: 33%" in out.stdout
    assert list(tmp_path.glob("memory-order-seed1000.*")), out.stdout
    # the chunked cache's story: KV held against a full cache's, where the retained chunks come from, the picture
    assert "a full cache would hold" in out.stdout and "retained chunks at the end come from" in out.stdout
    assert (tmp_path / "memory-order-seed1000-retention.png").is_file()


def test_recipe_collects_and_trains_end_to_end_on_a_tiny_budget(tmp_path):
    argv = [sys.executable, "-m", "vla_finetune.recipes.metaworld_demo", "--out", str(tmp_path), "--tasks", "reach-v3",
            "--episodes", "1", "--resolution", "28", "--llm-dim", "64", "--llm-layers", "1", "--max-steps", "2",
            "--batch-size", "2", "--threads", "1", "--eval-episodes", "0"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    log = json.loads((tmp_path / "recipe.json").read_text())
    assert [s["stage"] for s in log["stages"]] == ["collect", "train"]
    assert (tmp_path / "data" / "meta" / "info.json").is_file()
    model = tmp_path / "model"
    assert (model / "config.json").is_file() and (model / "gates.safetensors").is_file()
    lines = (model / "train_log.jsonl").read_text().splitlines()
    assert lines and all(np.isfinite(json.loads(line).get("loss", 0.0)) for line in lines)

    from vla_runtime.api import load_policy

    policy = load_policy(model, device="cpu")
    assert policy.info()["vision_towers"][0]["image_size"] == 28 and policy.kv_gate is not None
