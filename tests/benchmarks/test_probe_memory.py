"""probe_memory.py's parts: the cross-validated probe tells a readable label from an unreadable one, the go step
is the expert's first move, and the hook keeps the prefill's last hidden state, not a later decode's."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.policies.base import Observation
from vla_runtime.policies.registry import load_policy

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "probe_memory.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def labelled_noise(n: int, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [n, dims] of pure noise and labels [n], three balanced classes."""
    return torch.randn(n, dims, generator=torch.Generator().manual_seed(0)), torch.arange(n) % 3


def test_the_probe_reads_a_label_written_in_the_features_and_not_one_that_is_absent(probe):
    noise, labels = labelled_noise(90, 32)
    written = noise.clone()
    written[torch.arange(90), labels] += 3.0  # each class has its own direction, as order's pads do
    assert probe.probe_accuracy(written, labels) > 0.9
    assert probe.probe_accuracy(noise, labels) < 0.5  # chance is 1/3


def test_the_count_probe_reads_a_count_coded_along_one_direction_which_the_softmax_probe_misses(probe):
    noise, labels = labelled_noise(300, 128)
    counted = noise.clone()
    counted[:, 5] += 3.0 * labels  # 1, 2, 3 flashes along one direction, the middle between the others
    assert probe.count_accuracy(counted, labels) > 0.7 > probe.probe_accuracy(counted, labels)
    assert probe.count_accuracy(noise, labels) < 0.45


def test_the_go_step_is_the_first_action_that_moves_the_hand(probe):
    actions = np.zeros((12, 7), np.float32)
    actions[:, 6] = 1.0  # the gripper command alone is not a move
    actions[7:, 1] = 0.2
    assert probe.go_step(actions) == 7


def test_the_hook_keeps_the_state_of_the_first_forward_after_it_is_armed(probe, tmp_path):
    policy = load_policy(make_tiny_openvla(tmp_path / "tiny", image_size=28), device="cpu", dtype="float32")
    hook = probe.FirstTokenState(policy)
    seen = []
    hook.norm.register_forward_hook(lambda m, i, out: seen.append(out[0, -1].detach().clone()))
    session = policy.new_session("pick up the cup")
    frame = np.random.default_rng(0).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    hook.arm()
    session.step(Observation(images={"primary": frame}, state=np.zeros(4, np.float32)))
    assert len(seen) > 1  # the prefill, then the decodes of the action tokens
    assert hook.state.shape == seen[0].shape and torch.equal(hook.state, seen[0])
    assert not torch.equal(hook.state, seen[-1])
