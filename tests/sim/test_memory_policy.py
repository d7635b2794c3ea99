"""The shipped memory-suite policies: the chunked-cache policy (assets/mw-memory-openvla), the single-frame baseline
and the full-cache column (assets/mw-memory-full-openvla): complete, small, and acting in range on a memory task
under the cache each was trained for."""

import json
from pathlib import Path

import numpy as np
import pytest

from shipped import assert_shipped_checkpoint

pytestmark = pytest.mark.sim

MEMORY = Path(__file__).resolve().parents[2] / "assets" / "mw-memory-openvla"
ROS_CONFIG = Path(__file__).resolve().parents[2] / "ros2_ws" / "src" / "vla_runtime_ros" / "config"
MEMORY_TASKS = ("memory-reference", "memory-tally", "memory-order")


def test_shipped_memory_policy_is_small_complete_and_carded():
    assert_shipped_checkpoint(MEMORY, MEMORY_TASKS, extra=("gates.safetensors", "kv_config.json", "session_config.json"))
    kv = json.loads((MEMORY / "kv_config.json").read_text())["kv"]
    assert kv["max_chunks"] == 128 and kv["chunk_mass"] is True  # the budget and chunk weighting it was trained under


def test_ros_parameters_of_the_memory_policy_match_its_session():
    """The policy node runs the session its parameters give, not the checkpoint's file: the shipped parameter file
    must hold the checkpoint's cache and history."""
    import yaml

    ros = ROS_CONFIG / "openvla_memory.yaml"
    params = yaml.safe_load(ros.read_text())["/**"]["ros__parameters"]
    session = json.loads((MEMORY / "session_config.json").read_text())
    assert params["history"] == session["history"]
    for key, value in params["kv"].items():
        assert session["kv"][key] == value, f"{ros}: kv.{key} is {value!r}, the checkpoint's session has {session['kv'][key]!r}"
    trained = {k: v for k, v in session["kv"].items() if v is not None and k not in ("backend", "aggregator_hidden", "gate_hidden")}
    assert trained.keys() <= params["kv"].keys(), f"{ros} leaves out {sorted(trained.keys() - params['kv'].keys())}"


def steps_in_range(checkpoint: Path, task: str, steps: int):
    """Load ``checkpoint`` in its own session and run ``steps`` closed-loop steps of ``task`` (seed 1000), checking
    every action is 7-D, finite and inside the training data's q01/q99 -> (policy, the step results)."""
    import torch

    from vla_runtime.api import load_policy
    from vla_runtime.sim import MetaWorldConfig, make_env

    torch.set_num_threads(1)
    policy = load_policy(checkpoint, device="cpu")
    (action,) = [v["action"] for v in json.loads((checkpoint / "dataset_statistics.json").read_text()).values()]
    low, high = np.array(action["q01"]), np.array(action["q99"])
    results = []
    with make_env("metaworld", MetaWorldConfig(cameras=("corner",), resolution=(84, 84))) as env:
        obs = env.reset(task, seed=1000)
        session = policy.new_session(obs.instruction)  # the session the checkpoint was trained for
        for _ in range(steps):
            result = session.step(obs.to_policy())
            a = result.actions[0]
            assert a.shape == (7,) and np.all(np.isfinite(a))
            assert np.all(a[:6] >= low[:6] - 1e-6) and np.all(a[:6] <= high[:6] + 1e-6)
            results.append(result)
            obs, *_ = env.step(a)
    return policy, results


def test_shipped_memory_policy_acts_in_range_and_holds_its_budget():
    from vla_runtime.kv import KVMode

    # past the budget: 60 steps x 41 tokens form ~150 chunks per layer
    policy, results = steps_in_range(MEMORY, "memory-order", 60)
    assert policy.kv_gate is not None and policy.session.kv.mode is KVMode.CHUNKED
    assert policy.session.history == "observations"  # frames only: past action tokens leave the context
    last = results[-1].kv
    assert last.chunks_retained <= 128 * policy.info()["llm"]["layers"] and last.chunks_dropped > 0


SINGLE = Path(__file__).resolve().parents[2] / "assets" / "mw-memory-single-openvla"


def test_shipped_single_frame_baseline_is_small_complete_and_carded():
    assert_shipped_checkpoint(SINGLE, MEMORY_TASKS, extra=("session_config.json",))
    assert json.loads((SINGLE / "session_config.json").read_text())["history"] == "single"
    assert json.loads((SINGLE / "dataset_statistics.json").read_text()).keys() == {"metaworld_memory"}


def test_shipped_single_frame_baseline_acts_in_range_and_keeps_no_history():
    policy, results = steps_in_range(SINGLE, "memory-tally", 6)
    assert policy.session.history == "single"
    held = [r.kv.bytes for r in results]
    assert len(set(held)) == 1 and held[0] > 0  # every step starts from an empty context: nothing accumulates


FULL = Path(__file__).resolve().parents[2] / "assets" / "mw-memory-full-openvla"


def test_shipped_full_cache_policy_is_small_complete_and_carded():
    assert_shipped_checkpoint(FULL, MEMORY_TASKS, extra=("session_config.json",))
    session = json.loads((FULL / "session_config.json").read_text())
    assert session["history"] == "observations" and session["kv"] == {"mode": "full", "capacity": 10452}
    assert json.loads((FULL / "dataset_statistics.json").read_text()).keys() == {"metaworld_memory"}


def test_shipped_full_cache_policy_acts_in_range_and_keeps_every_step():
    from vla_runtime.kv import KVMode

    policy, results = steps_in_range(FULL, "memory-tally", 8)
    assert policy.kv_gate is None and policy.session.kv.mode is KVMode.FULL and policy.session.history == "observations"
    held = [r.kv.bytes for r in results]
    assert all(b > a for a, b in zip(held, held[1:]))  # every step stays in the cache: nothing is dropped
