"""The memory recipe end to end on a tiny budget, on a Markovian task (the memory tasks plug in by name)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sim


def test_memory_recipe_trains_every_policy_and_evaluates_every_condition(tmp_path):
    """With ``--context observations`` (the history model's context without action tokens; ``history`` differs
    only in the ``--history`` value it passes on), the full-cache history model and the goal loss."""
    argv = [sys.executable, "-m", "vla_finetune.recipes.metaworld_memory", "--out", str(tmp_path), "--tasks", "reach-v3",
            "--episodes", "1", "--resolution", "28", "--llm-dim", "64", "--llm-layers", "1", "--max-steps", "2",
            "--batch-size", "1", "--single-batch-size", "4", "--threads", "1", "--max-chunks", "2",
            "--tune", "1:5e-4", "--context", "observations", "--eval-episodes", "1", "--eval-max-steps", "3", "--eval-workers", "1",
            "--full-model", "--goal-weight", "0.5"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    stages = [s["stage"] for s in json.loads((tmp_path / "recipe.json").read_text())["stages"]]
    assert stages == ["collect", "train-history", "train-single", "train-history-full", "tune-history-1", "eval-single",
                      "eval-history-full", "eval-history-window", "eval-history-chunked"]  # fmt: skip
    full = (tmp_path / "model-history-full" / "finetune_config.yaml").read_text()
    assert "mode: full" in full and "window: 0" in full and "history: observations" in full
    for model in ("model-history", "model-single", "model-history-full", "model-history-tune1"):
        assert "goal_weight: 0.5" in (tmp_path / model / "finetune_config.yaml").read_text()
    config = (tmp_path / "model-history" / "finetune_config.yaml").read_text()
    assert "window: 0" in config and "budget: hard" in config and "max_chunks: 2" in config
    assert "history: observations" in config
    tuned = (tmp_path / "model-history-tune1" / "finetune_config.yaml").read_text()
    assert "change_weight: 5.0" in tuned and "window: 0" in tuned and "max_chunks: 2" in tuned
    assert "history: single" in (tmp_path / "model-single" / "finetune_config.yaml").read_text()
    sessions = {c: json.loads((tmp_path / f"eval-{c}" / "report.json").read_text())["session"]
                for c in ("single", "history-full", "history-window", "history-chunked")}  # fmt: skip
    assert "history=<HistoryMode.SINGLE" in sessions["single"] and "KVMode.FULL" in sessions["history-full"]
    assert "KVMode.SINK_WINDOW" in sessions["history-window"] and "max_chunks=2" in sessions["history-chunked"]
    assert all("HistoryMode.OBSERVATIONS" in sessions[c] for c in ("history-full", "history-window", "history-chunked"))
    checkpoints = {c: json.loads((tmp_path / f"eval-{c}" / "report.json").read_text())["checkpoint"] for c in sessions}
    assert checkpoints["history-full"] == str(tmp_path / "model-history-full")
    assert checkpoints["history-chunked"] == checkpoints["history-window"] == str(tmp_path / "model-history-tune1")
    assert list((tmp_path / "eval-history-chunked" / "retention").glob("reach-v3-seed1000.png"))
    table = (tmp_path / "results.md").read_text()
    assert table.count("| reach-v3 |") == 4 and "history-chunked" in table


def test_memory_recipe_from_full_fits_a_gate_then_fine_tunes_through_the_chunked_cache(tmp_path):
    """``--from-full --widen-chunks --cue-rounds --mass-rounds``: the shipped policy's stages (full cache, gate fitted
    frozen, every weight through the chunked cache, then again under a wider budget, then with the cue-count loss,
    then with chunk keys weighted by their tokens); the window and chunked conditions evaluate the last one at the
    wider budget, the full condition the first."""
    argv = [sys.executable, "-m", "vla_finetune.recipes.metaworld_memory", "--out", str(tmp_path), "--tasks", "reach-v3",
            "--episodes", "1", "--resolution", "28", "--llm-dim", "64", "--llm-layers", "1", "--max-steps", "2",
            "--batch-size", "1", "--single-batch-size", "4", "--threads", "1", "--max-chunks", "2", "--context", "observations",
            "--from-full", "--gate-steps", "2", "--f2c-steps", "2", "--f2c-lr", "3e-4", "--goal-weight", "0.5",
            "--widen-chunks", "3", "--widen-steps", "2", "--cue-rounds", "1", "--cue-steps", "2",
            "--mass-rounds", "1", "--mass-steps", "2",
            "--eval-episodes", "1", "--eval-max-steps", "3", "--eval-workers", "1"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    stages = [s["stage"] for s in json.loads((tmp_path / "recipe.json").read_text())["stages"]]
    assert stages == ["collect", "train-single", "train-history-full", "gates-history-full", "train-history-f2c",
                      "train-history-f2c3", "train-history-f2c3-cue1", "train-history-f2c3-mass1", "eval-single", "eval-history-full", "eval-history-window", "eval-history-chunked"]  # fmt: skip
    gates = (tmp_path / "gates-history-full" / "finetune_config.yaml").read_text()
    assert "trainable: gates" in gates and "max_chunks: 2" in gates and "goal_weight: 0.0" in gates
    gated = tmp_path / "model-history-full-gated"
    assert (gated / "gates.safetensors").read_bytes() == (tmp_path / "gates-history-full" / "gates.safetensors").read_bytes()
    assert (gated / "model.safetensors").read_bytes() == (tmp_path / "model-history-full" / "model.safetensors").read_bytes()
    assert (gated / "gates_finetune_config.yaml").is_file()
    f2c = (tmp_path / "model-history-f2c" / "finetune_config.yaml").read_text()
    assert f"checkpoint: {gated}" in f2c and "trainable: all" in f2c and "lr: 0.0003" in f2c and "max_chunks: 2" in f2c
    assert "goal_weight: 0.5" in f2c and "history: observations" in f2c
    assert not (tmp_path / "model-history").exists()  # no chunked model from scratch on this path
    checkpoints = {c: json.loads((tmp_path / f"eval-{c}" / "report.json").read_text())["checkpoint"]
                   for c in ("history-full", "history-window", "history-chunked")}  # fmt: skip
    assert checkpoints["history-full"] == str(tmp_path / "model-history-full")
    wide = (tmp_path / "model-history-f2c3" / "finetune_config.yaml").read_text()
    assert f"checkpoint: {tmp_path / 'model-history-f2c'}" in wide and "max_chunks: 3" in wide and "trainable: all" in wide
    cue = (tmp_path / "model-history-f2c3-cue1" / "finetune_config.yaml").read_text()
    assert f"checkpoint: {tmp_path / 'model-history-f2c3'}" in cue and "max_chunks: 3" in cue and "cue_weight: 1.0" in cue
    assert "cue_weight: 0.0" in wide  # the cue-count loss only in the --cue-rounds
    mass = (tmp_path / "model-history-f2c3-mass1" / "finetune_config.yaml").read_text()
    assert f"checkpoint: {tmp_path / 'model-history-f2c3-cue1'}" in mass and "chunk_mass: true" in mass and "cue_weight: 0.0" in mass
    assert "chunk_mass: false" in cue
    assert checkpoints["history-chunked"] == checkpoints["history-window"] == str(tmp_path / "model-history-f2c3-mass1")
    kv = {c: json.loads((tmp_path / f"eval-{c}" / "report.json").read_text())["kv"] for c in ("history-window", "history-chunked")}
    assert kv["history-chunked"]["max_chunks"] == kv["history-window"]["matched_chunks"] == 3  # evaluated at the wider budget
    assert kv["history-chunked"]["chunk_mass"] is True  # read back from the last round's kv_config.json
