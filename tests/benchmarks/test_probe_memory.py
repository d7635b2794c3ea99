"""probe_memory.py's parts: the cross-validated probes tell a readable label (or spot) from an unreadable one, the go
step is the expert's first move, and the hook keeps the prefill's last hidden state, not a later decode's."""

import numpy as np
import pytest
import torch

from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.policies.base import Observation
from vla_runtime.policies.registry import load_policy
from vla_runtime.sim.memory.order import OrderTask
from vla_runtime.sim.memory.reference import GOAL_HIGH, GOAL_LOW, ReferenceTask


@pytest.fixture(scope="module")
def probe(load_benchmark):
    return load_benchmark("probe_memory")


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


def test_the_count_probe_does_not_shrink_its_intercept(probe):
    noise, _ = labelled_noise(30, 32)
    # every episode saw 3 flashes (label 2) and the features say nothing: a penalised intercept would shrink the
    # prediction toward 0 (2 * 24 / (24 + alpha) = 1.4 with 24 training episodes), the mean target keeps it at 2
    assert probe.count_accuracy(noise, torch.full((30,), 2)) == 1.0


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


def spots_and_noise(n: int, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Spots [n, 2] uniform over the reference area, and features [n, dims] of pure noise."""
    g = torch.Generator().manual_seed(1)
    low, high = torch.tensor(GOAL_LOW), torch.tensor(GOAL_HIGH)
    return low + (high - low) * torch.rand(n, 2, generator=g), torch.randn(n, dims, generator=g)


def test_the_spot_probe_reads_a_spot_written_in_the_features_and_not_one_that_is_absent(probe):
    spots, noise = spots_and_noise(200, 32)
    written = noise.clone()
    written[:, :2] += 200 * spots  # x and y each along a direction of their own
    guess = probe.spot_errors(torch.zeros(200, 1), spots)
    assert probe.spot_errors(written, spots).median() < 0.02 < 0.5 * guess.median()
    assert probe.spot_errors(noise, spots).median() > 0.9 * guess.median()


def test_the_spot_errors_are_reported_per_column_of_x(probe):
    spots = torch.tensor([[-0.24, 0.5], [-0.23, 0.6], [0.01, 0.7], [0.149, 0.5]], dtype=torch.float64)
    errors = torch.tensor([0.01, 0.03, 0.10, 0.04], dtype=torch.float64)
    assert probe.by_column(errors, spots) == pytest.approx({"-25": 2.0, "+0": 10.0, "+10": 4.0})
    report = probe.spot_report({"go": [torch.randn(8) for _ in range(4)]}, spots)
    assert set(report) == {"guess", "go"} and set(report["go"]["by_column_cm"]) == {"-25", "+0", "+10"}


def test_reference_episodes_give_their_spot_and_cue_end_and_the_pad_tasks_their_answer(probe):
    class Episodes:  # what the probe reads of a LeRobotDataset
        extra = {"per_episode": {"episode_sim_tasks": ["memory-reference", "memory-order"], "episode_seeds": [7, 7],
                                 "episode_cue_steps": [[0, 1, 2, 3, 4, 5], [0, 1]]}}  # fmt: skip

    assert probe.spot(Episodes, 0) == ReferenceTask.sample(7).goal and probe.cue_end(Episodes, 0) == 5
    assert probe.spot(Episodes, 1) is None and probe.cue_end(Episodes, 1) == probe.CUE_END
    assert probe.answer(Episodes, 1) == OrderTask.sample(7).first
