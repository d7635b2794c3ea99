"""The repository's conftest fails a test that leaves the test process scheduled differently, and puts the
scheduling back for the tests after it (see ``conftest.py`` at the repository root)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

INNER = """
import os

ALL = sorted(os.sched_getaffinity(0))


def test_narrows_the_cpu_affinity():
    os.sched_setaffinity(0, ALL[:1])


def test_runs_after_it_on_every_cpu():
    assert sorted(os.sched_getaffinity(0)) == ALL
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a CPU affinity of at least 2 CPUs to narrow")
def test_a_test_that_leaves_the_scheduling_changed_fails_and_the_next_runs_as_before(tmp_path):
    (tmp_path / "conftest.py").write_text(ROOT_CONFTEST.read_text())
    (tmp_path / "test_inner.py").write_text(INNER)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "ERROR test_inner.py::test_narrows_the_cpu_affinity" in out, out
    assert "scheduling changed during this test (put back;" in out and "CPU affinity" in out, out
    assert "PASSED test_inner.py::test_runs_after_it_on_every_cpu" in out, out
