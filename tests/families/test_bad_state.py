"""Every family refuses a state that is not finite numbers (a NaN reached the actions and, in history mode, every
later step) and a reset to an empty instruction, before anything of the episode changes."""

import numpy as np
import pytest

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_hybridvla
from vla_runtime.config import SessionConfig

MAKERS = {
    "openvla": (lambda out: make_tiny_openvla(out, proprio_dim=8), 8),
    "hybridvla": (make_tiny_hybridvla, 7),
    "openvla-oft": (make_tiny_openvla_oft, 8),
}


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_a_state_that_is_not_finite_is_refused_and_the_episode_goes_on_as_before(family, tmp_path, frame):
    make, dim = MAKERS[family]
    policy = load_policy(make(tmp_path / family), device="cpu")
    config = SessionConfig(history="history", seed=0)
    state = np.linspace(-0.5, 0.5, dim)
    images = lambda i: {name: frame(i) for name in ("primary", "wrist")}  # noqa: E731 - OFT's LIBERO layout: two
    refused, clean = policy.new_session("pick up the cube", config), policy.new_session("pick up the cube", config)
    np.testing.assert_array_equal(refused.step(Observation(images(0), state)).actions,
                                  clean.step(Observation(images(0), state)).actions)  # fmt: skip
    bad = state.copy()
    bad[1] = np.nan
    with pytest.raises(ValueError, match=r"observation `state` must be finite numbers, got \[.*nan"):
        refused.step(Observation(images(1), bad))
    with pytest.raises(ValueError, match="instruction must be a non-empty task description"):
        refused.reset("   ")
    for i in (1, 2):  # the refused step and reset changed nothing
        np.testing.assert_array_equal(refused.step(Observation(images(i), state)).actions,
                                      clean.step(Observation(images(i), state)).actions)  # fmt: skip


def test_a_quaternion_without_direction_is_refused(tmp_path, frame):
    policy = load_policy(make_tiny_hybridvla(tmp_path / "hybridvla"), device="cpu")
    session = policy.new_session("close the box", SessionConfig(seed=0))
    with pytest.raises(ValueError, match=r"the state's quaternion \[0.0, 0.0, 0.0, 0.0\] has no direction"):
        session.step(Observation({"primary": frame(0)}, np.zeros(8)))  # xyz_quat_gripper with a zero quaternion
