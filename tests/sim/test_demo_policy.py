"""The shipped demo policy (assets/mw-tiny-openvla), the demo command and the recipe that trained it."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shipped import assert_shipped_checkpoint

pytestmark = pytest.mark.sim

DEMO = Path(__file__).resolve().parents[2] / "assets" / "mw-tiny-openvla"
TASKS = ("reach-v3", "button-press-topdown-v3", "drawer-close-v3")
CLI = str(Path(sys.executable).with_name("vla-runtime"))


def test_shipped_checkpoint_is_small_complete_and_in_the_upstream_layout():
    assert_shipped_checkpoint(DEMO, TASKS, extra=("gates.safetensors", "kv_config.json"))


@pytest.mark.parametrize("kv", ["full", "chunked"])
def test_shipped_policy_acts_in_range_on_metaworld_frames(kv):
    import torch

    from vla_runtime.api import load_policy
    from vla_runtime.config import SessionConfig
    from vla_runtime.kv import KVConfig
    from vla_runtime.sim import MetaWorldConfig, make_env

    torch.set_num_threads(1)
    policy = load_policy(DEMO, device="cpu")
    assert policy.kv_gate is not None  # the trained aggregator + gate ship with it
    size = policy.info()["vision_towers"][0]["image_size"]
    stats = json.loads((DEMO / "dataset_statistics.json").read_text())
    (action,) = [v["action"] for v in stats.values()]
    low, high = np.array(action["q01"]), np.array(action["q99"])
    with make_env("metaworld", MetaWorldConfig(cameras=("corner",), resolution=(size, size))) as env:
        obs = env.reset("reach-v3", seed=3)
        session = policy.new_session(obs.instruction, SessionConfig(history="history", kv=KVConfig(mode=kv)))
        for _ in range(4):
            result = session.step(obs.to_policy())
            a = result.actions[0]
            assert a.shape == (7,) and np.all(np.isfinite(a))
            assert np.all(a[:6] >= low[:6] - 1e-6) and np.all(a[:6] <= high[:6] + 1e-6)  # un-normalised into the data range
            assert a[6] in (0.0, 1.0) or -1.0 <= a[6] <= 1.0
            obs, *_ = env.step(a)
        assert result.kv.tokens_seen > 0


def test_demo_command_runs_a_closed_loop_episode(tmp_path):
    out = subprocess.run([CLI, "demo", "--max-steps", "12", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "policy step: p50" in out.stdout and "KV cache at the end" in out.stdout
    assert ("SUCCESS" in out.stdout) or ("failure after 12 steps" in out.stdout)
    assert list(tmp_path.glob("drawer-close-v3-seed1000.*")), out.stdout
    # the chunked cache's story: KV held against a full cache's, where the retained chunks come from, the picture
    assert "a full cache would hold" in out.stdout and "retained chunks at the end come from" in out.stdout
    assert (tmp_path / "drawer-close-v3-seed1000-retention.png").is_file()


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
