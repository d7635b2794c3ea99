"""Run the kernel tests on CPU in Triton's interpreter, in a child pytest process.

``triton.jit`` picks compiled vs interpreted when a function is decorated, and Triton's own ``tl.zeros``,
``tl.max``... are decorated when ``triton`` is first imported. So ``TRITON_INTERPRET=1`` has to be set before
anything imports triton, and then it holds for every kernel in the process. Setting it from a conftest
would depend on collection order (another test module may import triton first) and would turn the GPU-marked
native runs into interpreted ones on a CUDA machine. A child process with the variable set from its start
is the robust way: nothing leaks into this process, and these modules' ``cpu`` cases, skipped here, run there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODULES = ["test_attention.py", "test_rope.py"]


def test_kernels_match_references_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-rs",
           *(str(HERE / m) for m in MODULES)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{report}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 50, f"too few interpreter tests ran:\n{report}"
    assert "skipped" not in proc.stdout.splitlines()[-1], f"interpreter tests were skipped:\n{report}"
