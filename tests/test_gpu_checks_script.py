"""``scripts/gpu_checks.sh`` (what to run on a CUDA machine) refuses plainly where torch sees no GPU, before
running anything; with a stand-in interpreter, its parts get the arguments the environment gives them."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_checks.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the checks instead")
def test_without_a_gpu_the_script_exits_2_naming_why(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), sys.executable], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "gpu")})  # fmt: skip
    assert out.returncode == 2, out
    assert "gpu_checks: torch sees no CUDA device" in out.stderr
    assert list((tmp_path / "gpu").iterdir()) == []  # nothing ran


FAKE_PYTHON = """#!/bin/bash
# stands in for a CUDA machine's interpreter: logs each call (arguments, PYTHONPATH) and succeeds, except the
# project-import check when IMPORT_RC says the project is not installed
echo "$* | PYTHONPATH=${PYTHONPATH:-}" >> "$FAKE_LOG"
case "$*" in *"import vla_runtime, vla_kernels, vla_finetune"*) exit "${IMPORT_RC:-0}" ;; esac
exit 0
"""


@pytest.mark.parametrize("installed", [True, False])
def test_each_part_gets_its_arguments_and_an_uninstalled_tree_is_put_on_the_path(tmp_path, installed):
    """What the next GPU lease runs, checked here with a stand-in interpreter: ``GPU_TESTS``, ``BENCH_ARGS`` and
    ``SERVE_ARGS`` reach their parts' commands, and where the project is not installed every later call sees the
    tree and links named as pyproject's package-dir maps them (``vla_kernels`` -> kernels/vla_kernels/, ``vla_finetune`` ->
    finetune/)."""
    fake, log = tmp_path / "python", tmp_path / "calls.log"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "gpu"), "FAKE_LOG": str(log), "IMPORT_RC": "0" if installed else "1",
           "PARTS": "tests bench_fast_7b serve", "GPU_TESTS": "tests/openvla -k token_loop", "BENCH_ARGS": "--quantized",
           "SERVE_ARGS": "--compile default", "TMPDIR": str(tmp_path)}  # fmt: skip
    out = subprocess.run(["bash", str(SCRIPT), str(fake)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out
    calls = log.read_text().splitlines()
    run = {part: next(c for c in calls if marker in c) for part, marker in
           (("tests", "-m pytest"), ("bench", "bench_fast.py"), ("serve", "bench_serve.py"))}  # fmt: skip
    assert "-m gpu" in run["tests"] and run["tests"].split(" | ")[0].endswith("tests/openvla -k token_loop")
    assert "--geometry 7b-layer --layers 32" in run["bench"] and "--quantized" in run["bench"]
    assert "--clients 1 2 4 8 --compile default" in run["serve"]
    path = run["serve"].split("PYTHONPATH=")[1]
    if installed:
        assert path == ""
    else:
        root, site = path.split(":")[:2]
        assert Path(root) == SCRIPT.parents[1]
        assert Path(site, "vla_kernels").resolve() == SCRIPT.parents[1] / "kernels" / "vla_kernels"
        assert Path(site, "vla_finetune").resolve() == SCRIPT.parents[1] / "finetune"
