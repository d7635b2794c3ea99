"""Each test run gets a DDS domain of its own: not one a process on this machine is in, not one another run claimed."""

import os
import sys

import pytest
import ros_domain
from ros_domain import DDS_PORTS_PER_DOMAIN, DOMAINS, claim_domain

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the claim is an abstract Unix socket")


def test_a_claimed_domain_is_not_given_again():
    ours = int(os.environ["ROS_DOMAIN_ID"])  # this run's, claimed by the conftest
    first, claim = claim_domain()
    try:
        second, other = claim_domain()
        other.close()
    finally:
        claim.close()
    assert len({ours, first, second}) == 3


def test_a_domain_with_a_bound_dds_port_is_skipped(monkeypatch):
    free, probe = claim_domain()  # the domain this process tries first, while nobody holds it
    probe.close()
    # one port of its range is bound (a participant, or any process's UDP socket): the next search passes it by
    monkeypatch.setattr(ros_domain, "bound_udp_ports", lambda: {7400 + DDS_PORTS_PER_DOMAIN * free + 12})
    domain, claim = claim_domain()
    claim.close()
    assert domain != free and domain in DOMAINS
