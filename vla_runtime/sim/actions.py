"""Policy actions <-> simulator actions.

The policy convention (OpenVLA / Open-X RLDS) is a 7-D end-effector delta per control step:
``[dx, dy, dz, droll, dpitch, dyaw, gripper]`` with positions in metres, rotations in radians and
``gripper`` in [0, 1] where **1 = open, 0 = closed**.

Meta-World's action is 4-D ``[x, y, z, effort]`` in [-1, 1]: the hand's mocap target moves by
``xyz * 0.01`` m per step (``SawyerXYZEnv.action_scale = 1/100``) and ``effort`` drives the two
fingers (**+1 closes, -1 opens**). So, with ``position_scale = 100`` (1 / action_scale):

    metaworld_xyz    = clip(position_scale * [dx, dy, dz], -1, 1)     # metres -> Meta-World units
    metaworld_effort = clip(1 - 2 * gripper, -1, 1)                   # open 1 -> -1, closed 0 -> +1
    (droll, dpitch, dyaw are ignored: Meta-World's gripper orientation is fixed)

``MetaWorldActions.from_native`` is the exact inverse on the clipped range; ``collect`` stores
the 7-D form and executes it through ``to_native``, so a policy trained on the dataset maps back
through the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICY_ACTION_DIM = 7
POLICY_ACTION_NAMES = ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"]
GRIPPER_OPEN = 1.0  # the policy convention's open gripper


def check_policy_action(action: np.ndarray, simulator: str) -> np.ndarray:
    """Return ``action`` as float64 [7]; ``ValueError`` naming the simulator and the expected layout otherwise."""
    a = np.asarray(action, dtype=np.float64)
    if a.shape != (POLICY_ACTION_DIM,):
        raise ValueError(
            f"{simulator} expects one policy action of shape [7] = [dx, dy, dz, droll, dpitch, dyaw, gripper], "
            f"got shape {tuple(a.shape)}"
        )
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{simulator} got a non-finite action {a.tolist()}")
    return a


def check_policy_action_dim(action_dim: int, simulator: str) -> None:
    """``ValueError`` when a policy's action space cannot drive the simulators (before an episode starts)."""
    if action_dim != POLICY_ACTION_DIM:
        raise ValueError(
            f"a policy with action_dim={action_dim} cannot be mapped to {simulator}: the simulators take the 7-D "
            "end-effector delta convention [dx, dy, dz, droll, dpitch, dyaw, gripper (1 = open)]"
        )


@dataclass(frozen=True)
class MetaWorldActions:
    """7-D policy action <-> Meta-World's 4-D action (module docstring has the formulas).

    Args:
        position_scale: Meta-World units per metre (1 / ``action_scale``; 100 for every v3 task).
    """

    position_scale: float = 100.0

    def __post_init__(self) -> None:
        if not self.position_scale > 0:
            raise ValueError(f"`position_scale` must be > 0, got {self.position_scale}")

    def to_native(self, action: np.ndarray) -> np.ndarray:
        """action: [7] policy convention -> [4] Meta-World (float64)."""
        a = check_policy_action(action, "Meta-World")
        out = np.empty(4)
        out[:3] = np.clip(a[:3] * self.position_scale, -1.0, 1.0)
        out[3] = np.clip(1.0 - 2.0 * a[6], -1.0, 1.0)
        return out

    def from_native(self, native: np.ndarray) -> np.ndarray:
        """native: [4] Meta-World (clipped to [-1, 1] first) -> [7] policy convention (float64)."""
        n = np.clip(np.asarray(native, dtype=np.float64).reshape(4), -1.0, 1.0)
        out = np.zeros(POLICY_ACTION_DIM)
        out[:3] = n[:3] / self.position_scale
        out[6] = (1.0 - n[3]) / 2.0
        return out
