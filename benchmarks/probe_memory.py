"""Is a memory task's answer in the policy's hidden state? A linear probe on expert episodes.

The policy watches an expert episode of a memory task (teacher-forced: in frames-only history the context holds
only the frames, so it sees what the expert saw), and at three steps the final-normed hidden state at the position
that predicts the step's first action token is kept: the end of the cue phase (step 19), 10 steps before the go
step, and the go step (the first step the expert moves: the action that answers). A softmax regression on those
vectors, cross-validated over episodes, says whether the answer is linearly readable there (and a ridge regression of
the answer as a number, rounded: a count coded along one direction, which the softmax probe misses):

- ``memory-tally``: the count of flashes (1..3);
- ``memory-order``: the pad that lit first (1..3);
- ``memory-reference``: the spot (x, y), by a ridge regression; reported as the distance from the true spot, per
  5-cm column of x (``reference_map.py``'s columns), beside the distance of a guess of the mean spot. Its cue
  ends at step 5 (the ball is shown for 6 observations).

Chance is the largest class's share. A policy that answers right reads the answer off its state (the shipped
policy on order: 97 % at the go step); one whose probe sits at chance never formed it, whatever its cache kept.

    python benchmarks/probe_memory.py --checkpoint assets/mw-memory-openvla --dataset DATA [--kv full]

DATA: ``vla-runtime collect --sim metaworld --tasks memory-tally --episodes 90 --camera corner --resolution 84
--seed 5000 --out DATA`` (seeds no policy trained on; ``--tasks memory-reference --episodes 200`` for the spot).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from vla_runtime.config import HistoryMode, SessionConfig
from vla_runtime.data import LeRobotDataset
from vla_runtime.kv.config import KVConfig, KVMode
from vla_runtime.policies.base import Observation
from vla_runtime.policies.registry import load_policy
from vla_runtime.sim.memory.order import OrderTask
from vla_runtime.sim.memory.reference import GOAL_HIGH, GOAL_LOW, ReferenceTask

CUE_END = 19  # the last observation of tally's cue phase (5 slots x 4 steps); order's delay has begun by then
FULL_CAPACITY = 10452  # the memory cards' full cache (201 steps x 52 tokens)


COLUMN_M = 0.05  # width of the columns of x the spot's error is reported by


def spot(ds: LeRobotDataset, episode: int) -> tuple[float, float] | None:
    """A memory-reference episode's spot (x, y) in metres, drawn again from its seed; None for another task."""
    per_episode = ds.extra["per_episode"]
    if per_episode["episode_sim_tasks"][episode] != ReferenceTask.name:
        return None
    return ReferenceTask.sample(int(per_episode["episode_seeds"][episode])).goal


def cue_end(ds: LeRobotDataset, episode: int) -> int:
    """The last observation of the episode's cue phase (reference: the ball's 6; the pad tasks: ``CUE_END``)."""
    return ReferenceTask.cue_steps - 1 if spot(ds, episode) is not None else CUE_END


def answer(ds: LeRobotDataset, episode: int) -> int:
    """The episode's answer, 0..2: tally's count - 1, order's first pad."""
    per_episode = ds.extra["per_episode"]
    task = per_episode["episode_sim_tasks"][episode]
    if task == "memory-order":
        return OrderTask.sample(int(per_episode["episode_seeds"][episode])).first
    if task == "memory-tally":
        return len(per_episode["episode_cue_steps"][episode]) // 2 - 1  # each flash is lit in two observations
    raise ValueError(f"episode {episode} is {task!r}; the probe reads memory-tally, memory-order and memory-reference")


def go_step(actions: np.ndarray) -> int:
    """The first step whose action moves the hand ([T, 7] actions; the arm is held before the go lamp)."""
    moving = np.flatnonzero(np.abs(actions[:, :3]).max(axis=1) > 1e-6)
    if not len(moving):
        raise ValueError("the expert never moves in this episode")
    return int(moving[0])


class FirstTokenState:
    """A forward hook on the language model's final norm: the hidden state [dim] at the last position of the
    first forward after ``arm()`` (a step's prefill: that position predicts the step's first action token)."""

    def __init__(self, policy) -> None:
        self.norm = policy.model.language_model.model.norm  # an OpenVLA's LLaMA: the norm before the LM head
        self.norm.register_forward_hook(self._hook)
        self.armed, self.state = False, None

    def arm(self) -> None:
        self.armed, self.state = True, None

    def _hook(self, module, inputs, output) -> None:
        if self.armed:
            self.state, self.armed = output[0, -1].detach().float().clone(), False


def cross_validated(features: torch.Tensor, labels: torch.Tensor, fit_predict, folds: int = 5) -> float:
    """Accuracy over ``folds`` folds of episodes: features [N, D] (standardised here), labels [N] in 0..C-1;
    ``fit_predict(x_train, y_train, x_test) -> predicted labels``."""
    x = (features - features.mean(0)) / (features.std(0) + 1e-6)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    right = 0
    for fold in range(folds):
        test = order[fold::folds]
        train = order[torch.isin(order, test, invert=True)]
        right += int((fit_predict(x[train], labels[train], x[test]) == labels[test]).sum())
    return right / len(labels)


def fit_softmax(x: torch.Tensor, y: torch.Tensor, classes: int, *, l2: float = 1e-2):
    """An L2-regularised softmax regression fit on x [N, D], y [N] in 0..classes-1 -> ``predict(x) -> labels``."""
    w = torch.zeros(x.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w + b, y) + l2 * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lambda x_test: (x_test @ w + b).detach().argmax(1)


def probe_accuracy(features: torch.Tensor, labels: torch.Tensor, *, folds: int = 5, l2: float = 1e-2) -> float:
    """Cross-validated accuracy of an L2-regularised softmax regression."""

    def fit_predict(x, y, x_test):
        return fit_softmax(x, y, int(labels.max()) + 1, l2=l2)(x_test)

    return cross_validated(features, labels, fit_predict, folds)


def count_accuracy(features: torch.Tensor, labels: torch.Tensor, *, folds: int = 5, alpha: float = 10.0) -> float:
    """Cross-validated accuracy of a ridge regression of the label as a number (a count), rounded to the nearest
    class: reads a count coded along one direction, which the softmax probe, with the middle class between the
    others, misses among many dimensions."""

    def fit_predict(x, y, x_test):
        return (ridge(x.double(), y.double(), alpha)(x_test.double())).round().clamp(0, int(labels.max())).long()

    return cross_validated(features, labels, fit_predict, folds)


def ridge(x: torch.Tensor, y: torch.Tensor, alpha: float):
    """Ridge regression fit on x [N, D], y [N] or [N, K] -> ``predict(x) -> y``. The intercept is not penalised (x and
    y are centred on their means), so a shrunk fit falls back to the mean target, not toward zero."""
    x_mean, y_mean = x.mean(0), y.mean(0)
    a = x - x_mean
    w = torch.linalg.solve(a.T @ a + alpha * torch.eye(a.shape[1], dtype=a.dtype), a.T @ (y - y_mean))
    return lambda x_test: (x_test - x_mean) @ w + y_mean


def spot_errors(features: torch.Tensor, spots: torch.Tensor, *, folds: int = 5, alpha: float = 10.0) -> torch.Tensor:
    """Cross-validated ridge regression of the spot: features [N, D] (standardised here), spots [N, 2] metres ->
    the distance [N] (metres) of each held-out prediction from its spot."""
    x = ((features - features.mean(0)) / (features.std(0) + 1e-6)).double()
    spots = spots.double()
    order = torch.randperm(len(spots), generator=torch.Generator().manual_seed(0))
    errors = torch.empty(len(spots), dtype=torch.float64)
    for fold in range(folds):
        test = order[fold::folds]
        train = order[torch.isin(order, test, invert=True)]
        errors[test] = (ridge(x[train], spots[train], alpha)(x[test]) - spots[test]).norm(dim=1)
    return errors


def by_column(errors: torch.Tensor, spots: torch.Tensor) -> dict[str, float]:
    """Median error (cm) per ``COLUMN_M``-wide column of the spot's x over the spot area, keyed by the column's
    start in cm; columns without a spot are left out."""
    edges = np.arange(GOAL_LOW[0], GOAL_HIGH[0] + 1e-9, COLUMN_M)
    column = np.clip(np.searchsorted(edges, spots[:, 0].numpy(), side="right") - 1, 0, len(edges) - 2)
    cm = 100 * errors.numpy()
    return {f"{round(100 * edges[c]):+d}": float(np.median(cm[column == c]))
            for c in range(len(edges) - 1) if (column == c).any()}  # fmt: skip


def spot_report(points: dict[str, list[torch.Tensor]], spots: torch.Tensor) -> dict:
    """Per probe point: the median error (cm) overall and per column of x; and the same for a guess of the mean
    spot (cross-validated alike: no feature)."""
    guess = spot_errors(torch.zeros(len(spots), 1), spots)
    out = {"guess": {"median_cm": float(100 * np.median(guess.numpy())), "by_column_cm": by_column(guess, spots)}}
    for name, states in points.items():
        errors = spot_errors(torch.stack(states), spots)
        out[name] = {"median_cm": float(100 * np.median(errors.numpy())), "by_column_cm": by_column(errors, spots)}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--dataset", type=Path, required=True,
                   help="expert episodes of memory-tally, memory-order and/or memory-reference")
    p.add_argument("--kv", choices=["checkpoint", "full"], default="checkpoint",
                   help="the checkpoint's own session config (default) or history through a full cache")  # fmt: skip
    p.add_argument("--episodes", type=int, default=0, help="the first N episodes (0 = all)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ds = LeRobotDataset(args.dataset)
    policy = load_policy(args.checkpoint, device="cpu", dtype="float32")
    config = None  # the checkpoint's session_config.json
    if args.kv == "full":
        config = SessionConfig(kv=KVConfig.of(KVMode.FULL, capacity=FULL_CAPACITY), history=HistoryMode.OBSERVATIONS)
    hook = FirstTokenState(policy)
    points = {"cue end": [], "go - 10": [], "go": []}
    spot_points = {name: [] for name in points}
    labels, spots = [], []
    for e in tqdm(range(args.episodes or len(ds)), desc="episodes"):
        ep = ds.episode(e)
        frames = next(iter(ep.images.values()))
        go = go_step(ep.action)
        session = policy.new_session(ep.tasks_per_frame()[0], config)
        states = []
        for t in range(go + 1):
            hook.arm()
            session.step(Observation(images={"primary": frames[t]}, state=ep.state[t], t=t / ds.info["fps"]))
            states.append(hook.state)
        where = spot(ds, e)
        for name, t in (("cue end", cue_end(ds, e)), ("go - 10", go - 10), ("go", go)):
            (points if where is None else spot_points)[name].append(states[t])
        if where is None:
            labels.append(answer(ds, e))
        else:
            spots.append(where)
    result = {"checkpoint": str(args.checkpoint), "dataset": str(args.dataset), "kv": args.kv}
    if labels:
        y = torch.tensor(labels)
        result.update(
            episodes=len(labels), chance=float(np.bincount(labels).max() / len(labels)),
            accuracy={name: probe_accuracy(torch.stack(v), y) for name, v in points.items()},
            count_accuracy={name: count_accuracy(torch.stack(v), y) for name, v in points.items()},
        )  # fmt: skip
    if spots:
        result.update(reference_episodes=len(spots), spot=spot_report(spot_points, torch.tensor(spots)))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
