"""Shared by the control-loop tests: a loop at 10 Hz on a fake clock, and chunks whose rows are easy to read."""

import numpy as np
from vla_runtime.control import ControlConfig, ControlLoop

P = 0.1  # 10 Hz


def make(chunked=False, t0=0.0, **kw) -> ControlLoop:
    return ControlLoop(ControlConfig(rate_hz=1 / P, **kw), t0=t0, chunked=chunked)


def chunk(n, base=0.0, dim=2):
    """[n, dim]: row i is base + i in every dimension."""
    return np.repeat((base + np.arange(n, dtype=float))[:, None], dim, axis=1)
