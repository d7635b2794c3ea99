"""Per-episode eval results: durable JSON lines, a torn last line dropped, the report rebuilt from the file alone."""

import pytest

from vla_runtime.sim.evaluate import EpisodeResult
from vla_runtime.sim.report import summarize
from vla_runtime.sim.results import append_result, load_results, read_results


def result(task, seed, success):
    return EpisodeResult(task, seed, success, steps=10 + seed, policy_s=0.1 * seed + 1 / 3, env_s=0.2, step_ms=[1.5, 2.25, 1 / 7],
                         inference_ms=[1.5], kv_bytes_max=64 * seed, kv_final={"bytes": 64}, error=None, video=None)


def test_results_round_trip_and_a_torn_line_is_dropped(tmp_path):
    path = tmp_path / "episodes.jsonl"
    results = [result("a", 0, True), result("a", 1, False), result("b", 0, True)]
    for job in (2, 0, 1):  # finished out of order (parallel workers)
        append_result(path, job, results[job])
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"job": 3, "task": "b", "se')  # a kill in the middle of a write
    assert read_results(path) == {0: results[0], 1: results[1], 2: results[2]}  # floats and lists exactly
    assert path.read_bytes() == whole  # the torn line is trimmed, so the next append starts a clean line
    assert load_results(path) == results
    assert summarize(load_results(path)) == summarize(results)


def test_a_foreign_line_is_a_clear_error(tmp_path):
    path = tmp_path / "episodes.jsonl"
    path.write_text('{"job": 0, "task": "a"}\n')
    with pytest.raises(ValueError, match="episodes.jsonl line 1 is not an episode result"):
        read_results(path)


def test_the_checkpoint_digest_follows_its_files_but_not_an_output_inside_it(tmp_path):
    from vla_runtime.sim.results import checkpoint_fingerprint

    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"w" * 300_000)
    (ckpt / "sub" / "config.json").write_text("{}")
    digest = checkpoint_fingerprint(ckpt)
    moved = ckpt.rename(tmp_path / "moved")
    assert checkpoint_fingerprint(moved) == digest  # where it lives does not matter
    (moved / "eval").mkdir()
    (moved / "eval" / "episodes.jsonl").write_text("{}\n")  # `--out` inside the checkpoint: its results grow
    assert checkpoint_fingerprint(moved, exclude=moved / "eval") == digest
    assert checkpoint_fingerprint(moved) != digest
    with open(moved / "model.safetensors", "r+b") as f:  # retrained: the tail of the weights differs
        f.seek(-10, 2)
        f.write(b"x" * 10)
    assert checkpoint_fingerprint(moved, exclude=moved / "eval") != digest
