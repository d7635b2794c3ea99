"""For every test in the repository (``tests/`` and the ROS package's tests): it starts from seeded global RNGs
(``random``, numpy's, torch's), and it must leave the test process scheduled as it found it.

The scheduling policy and priority, the nice value and the CPU affinity of the thread that runs the
tests are inherited by every thread and process it starts afterwards: worker pools, simulator
workers, ROS node processes. A test (or a library it calls) that changes them changes how every later
test runs, hundreds of tests away: libsvtav1 switched the thread that opened it to ``SCHED_FIFO``
priority 99 (as root), and the ROS nodes started 500 tests later livelocked (issue 13). Here the
state at start-up is the reference; a test that leaves it changed fails by name, and the state is
put back so that the tests after it run as intended.
"""

from __future__ import annotations

import os

import pytest


POLICIES = {getattr(os, name): name for name in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR")
            if hasattr(os, name)}


def scheduling_state() -> dict[str, object]:
    """How the kernel schedules the calling thread (what threads and processes it starts inherit)."""
    state: dict[str, object] = {}
    if hasattr(os, "sched_getscheduler"):
        state["scheduling policy and priority"] = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
    if hasattr(os, "getpriority"):
        state["nice value"] = os.getpriority(os.PRIO_PROCESS, 0)
    if hasattr(os, "sched_getaffinity"):
        state["CPU affinity"] = sorted(os.sched_getaffinity(0))
    return state


def restore_scheduling(state: dict[str, object]) -> list[str]:
    """Put the calling thread's scheduling back to ``state``; what could not be put back, and why."""
    setters = {
        "scheduling policy and priority": lambda value: os.sched_setscheduler(0, value[0], os.sched_param(value[1])),
        "nice value": lambda value: os.setpriority(os.PRIO_PROCESS, 0, value),  # lowering it needs privileges
        "CPU affinity": lambda value: os.sched_setaffinity(0, value),
    }
    failed = []
    for key, value in state.items():
        try:
            setters[key](value)
        except OSError as e:
            failed.append(f"{key}: {e}")
    return failed


def shown(key: str, value: object) -> str:
    if key == "scheduling policy and priority":
        return f"{POLICIES.get(value[0], value[0])} {value[1]}"
    return str(value)


STARTED_WITH = scheduling_state()  # before any test module is imported


def _check(when: str) -> str:
    now = scheduling_state()
    changed = {k: (STARTED_WITH[k], now[k]) for k in STARTED_WITH if now.get(k) != STARTED_WITH[k]}
    if not changed:
        return ""
    failed = restore_scheduling(STARTED_WITH)
    put_back = f"could not put back {'; '.join(failed)}" if failed else "put back"
    return (f"the test process's scheduling changed {when} ({put_back}; threads and processes started in the meantime "
            "inherited it): " + "; ".join(f"{k} {shown(k, old)} -> {shown(k, new)}" for k, (old, new) in changed.items()))


@pytest.fixture(autouse=True)
def _seeded_global_rngs():
    """Every test starts from the same global RNG states, whichever tests ran before it: a failure reproduces
    alone (tests that need other draws pass their own generator)."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _scheduling_is_left_as_it_was():
    before = _check("before this test (at import or in an earlier fixture)")
    if before:
        pytest.fail(before, pytrace=False)
    yield
    after = _check("during this test")
    if after:
        pytest.fail(after, pytrace=False)
