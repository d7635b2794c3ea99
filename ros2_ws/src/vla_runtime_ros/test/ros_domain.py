"""A DDS domain of this process's own on this machine, for the ROS tests and benchmarks.

Test runs that share a ``ROS_DOMAIN_ID`` on one machine (several engineers, CI jobs, worktrees) see
each other's nodes: a second run's ``/pn/vla_policy/reset`` call or latched instruction reaches this
run's node, which then starts episodes nobody asked for. The domain used to be ``1 + pid % 230``,
which two concurrent runs share once in 230 pairs. Now a run holds an exclusive lock on a file per
domain for its lifetime and takes the first free domain from its pid on. Runs that do not take these
locks (older checkouts) can still land on the same domain.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

LOCK_DIR = Path(tempfile.gettempdir()) / "vla_runtime_ros_domains"
DOMAINS = range(1, 231)  # 0 is everyone's default; above 232 Fast DDS's ports leave the valid range


def claim_domain(lock_dir: Path = LOCK_DIR) -> tuple[int, IO]:
    """(a ``ROS_DOMAIN_ID`` no other claiming process holds, its lock file). Keep the file open for as long
    as the domain is in use; the lock ends with the process (or ``close()``)."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    start = os.getpid() % len(DOMAINS)
    for i in range(len(DOMAINS)):
        domain = DOMAINS[(start + i) % len(DOMAINS)]
        lock = (lock_dir / f"{domain}.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return domain, lock
    raise RuntimeError(f"every ROS domain in {DOMAINS} is held by another process (lock files in {lock_dir})")
