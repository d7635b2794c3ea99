"""``vla-runtime bench``: the listing (every benchmarks/bench_*.py, a line each), dispatch by name with the
benchmark's own arguments, the built-in kv without a benchmarks folder, and the errors for unknown names."""

import ast
import json
import sys
from pathlib import Path

import pytest

from vla_runtime.bench.registry import BUILTIN, default_dir, find_benchmarks, get_benchmark, summary
from vla_runtime.cli import main

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ECHO = '''"""Echoes its arguments
into a file (a test benchmark)."""

import json
import sys

from echo_helper import OUT_FLAG


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = argv[argv.index(OUT_FLAG) + 1]
    with open(out, "w") as f:
        json.dump(argv, f)
    return 3
'''


@pytest.fixture
def echo_dir(tmp_path):
    """A benchmarks folder with one script that imports a neighbour, as bench_episode_training does."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_echo.py").write_text(ECHO)
    (folder / "echo_helper.py").write_text('OUT_FLAG = "--out"\n')
    (folder / "not_a_bench.py").write_text('"""Not listed."""\n')
    return folder


def test_the_default_folder_is_the_checkouts_benchmarks():
    assert default_dir() == BENCHMARKS


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--list"]])
def test_listing_names_every_script_with_its_docstrings_first_paragraph(argv, capsys):
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = dict(line.split(None, 1) for line in lines[:-1])
    scripts = {p.stem.removeprefix("bench_"): p for p in BENCHMARKS.glob("bench_*.py")}
    assert set(listed) == set(scripts) and list(listed) == sorted(listed)
    assert listed["step"] == "Per-action latency (ms): our OpenVLA step vs upstream's inference path, same checkpoint, one process."
    assert listed["serve"].startswith("Load on vla-runtime serve: N robots") and listed["serve"].endswith("in the same run.")
    assert listed["kv"].startswith("How long does one control step take")  # vla_runtime.bench.kv's docstring
    assert all(listed[name] == summary(path) for name, path in scripts.items() if name != "kv")
    assert lines[-1].startswith("run one: vla-runtime bench NAME")


def test_every_script_uses_the_shared_harness():
    for path in BENCHMARKS.glob("bench_*.py"):
        imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
        assert imported & {"vla_runtime.bench.harness", "vla_runtime.bench.kv"}, path.name


def test_dispatch_passes_the_benchmarks_own_arguments(echo_dir, tmp_path, capsys):
    out = tmp_path / "argv.json"
    path_before = list(sys.path)
    assert main(["bench", "--dir", str(echo_dir), "echo", "--repeats", "1", "--out", str(out), "--list"]) == 3
    assert json.loads(out.read_text()) == ["--repeats", "1", "--out", str(out), "--list"]
    assert sys.path == path_before  # the script's folder is on sys.path only while it runs
    assert main(["bench", "--dir", str(echo_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "echo  Echoes its arguments into a file (a test benchmark)." in lines and not any("not_a_bench" in x for x in lines)


def test_a_real_script_runs_by_name(capsys):
    # bench_kernels with --device cpu: loaded by path (its dataclasses need the module registered) and exits 0
    assert main(["bench", "kernels", "--device", "cpu"]) == 0
    assert "bench_kernels needs a CUDA GPU" in capsys.readouterr().out


def test_kv_is_built_in_and_needs_no_benchmarks_folder(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert get_benchmark("kv", missing).module == BUILTIN["kv"] == "vla_runtime.bench.kv"
    assert find_benchmarks(BENCHMARKS)["kv"].module == "vla_runtime.bench.kv"  # not benchmarks/bench_kv.py
    assert list(find_benchmarks(missing)) == ["kv"]
    assert main(["bench", "--dir", str(missing)]) == 0
    assert f"no benchmarks folder at {missing}" in capsys.readouterr().out


def test_unknown_names_and_a_missing_folder_are_user_errors(tmp_path, capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'; available: episode_training, families," in err and "step" in err
    assert main(["bench", "--dir", str(tmp_path / "missing"), "ros"]) == 2
    err = capsys.readouterr().err
    assert f"benchmark 'ros' is a script in a source checkout's benchmarks/ folder, and there is none at {tmp_path / 'missing'}" in err
