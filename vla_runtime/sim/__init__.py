"""Simulators behind one protocol (``SimEnv``), looked up by name.

    from vla_runtime.sim import make_env, MetaWorldConfig
    with make_env("metaworld", MetaWorldConfig(resolution=(128, 128))) as env:
        obs = env.reset("reach-v3", seed=0)
        obs, done, success, info = env.step(action_7d)

Backends import their simulator lazily: importing this package needs neither MuJoCo nor RLBench.
"""

from __future__ import annotations

from .actions import POLICY_ACTION_DIM, POLICY_ACTION_NAMES, MetaWorldActions, check_policy_action_dim
from .base import SimEnv, SimObservation, StepInfo
from .metaworld_env import METAWORLD_CAMERAS, MetaWorldConfig, MetaWorldEnv
from .memory import MEMORY_TASKS
from .metaworld_tasks import METAWORLD_ALL_TASKS, METAWORLD_INSTRUCTIONS, METAWORLD_TASKS
from .rlbench_env import RLBenchConfig, RLBenchEnv

# name -> (env class, its config class)
SIMULATORS: dict[str, tuple[type[SimEnv], type]] = {
    "metaworld": (MetaWorldEnv, MetaWorldConfig),
    "rlbench": (RLBenchEnv, RLBenchConfig),
}


def make_env(name: str, config: object | None = None) -> SimEnv:
    """Build simulator ``name`` with ``config`` (its config dataclass; ``None`` = defaults)."""
    if name not in SIMULATORS:
        raise KeyError(f"unknown simulator {name!r}; available: {', '.join(sorted(SIMULATORS))}")
    env_cls, config_cls = SIMULATORS[name]
    if config is not None and not isinstance(config, config_cls):
        raise ValueError(f"simulator {name!r} takes a {config_cls.__name__}, got {type(config).__name__}")
    return env_cls(config)


__all__ = [
    "MEMORY_TASKS",
    "METAWORLD_ALL_TASKS",
    "METAWORLD_CAMERAS",
    "METAWORLD_INSTRUCTIONS",
    "METAWORLD_TASKS",
    "POLICY_ACTION_DIM",
    "POLICY_ACTION_NAMES",
    "SIMULATORS",
    "MetaWorldActions",
    "MetaWorldConfig",
    "MetaWorldEnv",
    "RLBenchConfig",
    "RLBenchEnv",
    "SimEnv",
    "SimObservation",
    "StepInfo",
    "check_policy_action_dim",
    "make_env",
]
