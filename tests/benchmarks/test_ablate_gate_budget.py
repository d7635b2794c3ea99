"""ablate_gate_budget.py keeps working on a minimal budget and writes its JSON record (scores are not asserted)."""

import json

import torch


def test_ablation_trains_every_objective_and_scores_it_by_streaming(tmp_path, load_benchmark):
    ablation = load_benchmark("ablate_gate_budget")
    ids, label, cue = ablation.sequences(3, steps=6, classes=4, seed=0)
    assert torch.all(ids[torch.arange(3), cue] == ablation.MARK) and torch.all(ids[torch.arange(3), cue + 1] == 2 + label)
    assert torch.all((cue - ablation.PROMPT) % ablation.CHUNK == 0)  # the cue fills exactly one chunk
    argv = ["--threads", "1", "--seeds", "0", "--steps", "6", "--train-steps", "2", "--batch", "2", "--eval", "2",
            "--out", str(tmp_path / "ablation")]  # fmt: skip
    assert ablation.main(argv) == 0
    results = json.loads((tmp_path / "ablation.json").read_text())["results"]
    assert list(results) == list(ablation.VARIANTS)
    assert all(0.0 <= r[0]["accuracy"] <= 1.0 and 0.0 <= r[0]["cue_held"] <= 1.0 for r in results.values())
