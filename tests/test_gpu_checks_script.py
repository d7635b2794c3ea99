"""``scripts/gpu_checks.sh`` (what to run on a CUDA machine) refuses plainly where torch sees no GPU, before
running anything."""

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
