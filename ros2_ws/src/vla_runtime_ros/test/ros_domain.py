"""The DDS domain of a test run: one that no process on this machine is in and no other run has claimed.

Imported by the ROS conftest before rclpy (nothing here needs the ROS wheels).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

DOMAINS = range(1, 231)  # not 0 (ROS's default, a robot's); Fast DDS's port formula overflows past 232
DDS_PORTS_PER_DOMAIN = 250  # domain d's participants bind UDP ports 7400 + 250 d + [0, 250)


def bound_udp_ports() -> set[int]:
    """Local UDP ports bound on this machine (``/proc/net/udp``, ``udp6``); empty where there is no procfs."""
    ports = set()
    for table in (Path("/proc/net/udp"), Path("/proc/net/udp6")):
        if table.is_file():
            ports.update(int(line.split()[1].rsplit(":", 1)[1], 16) for line in table.read_text().splitlines()[1:])
    return ports


def claim_domain() -> tuple[int, socket.socket | None]:
    """A DDS domain no process on this machine is in and no other test run has claimed, and the claim.

    A domain is in use while some participant has a port of its range bound (any version of this suite,
    a developer's ros2 CLI); the claim, an abstract Unix socket held for the life of this process (gone
    with it, not inherited by node processes), settles two runs that start at the same moment. The search
    starts at a pid-derived domain. (A bare ``1 + pid % 230`` put two runs 690 pids apart into one domain,
    with the same node names: each run's nodes answered the other's tests.)
    """
    used = {(port - 7400) // DDS_PORTS_PER_DOMAIN for port in bound_udp_ports() if port >= 7400}
    start = os.getpid() % len(DOMAINS)
    for i in range(len(DOMAINS)):
        domain = DOMAINS[(start + i) % len(DOMAINS)]
        if domain in used:
            continue
        if not sys.platform.startswith("linux"):
            return domain, None
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            claim.bind(f"\0vla_runtime_ros_test_domain_{domain}")
        except OSError:  # another run holds it
            claim.close()
            continue
        return domain, claim
    raise RuntimeError(f"every DDS domain in {DOMAINS} is in use on this machine")
