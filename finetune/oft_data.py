"""A LeRobot dataset prepared for OpenVLA-OFT's single-frame recipe: one sample per frame, its target the
chunk of the frame's next ``chunk_size`` actions (upstream's ``NUM_ACTIONS_CHUNK``: the current action and
the ones after it), normalised to [-1, 1] with the dataset's statistics the way the runtime un-normalises
them (``BoundsStats``, the platform's ``NormalizationType``; masked dimensions, OpenVLA's gripper, pass
through). A chunk running past the end of its task segment repeats the segment's last action. Proprio is
normalised the same way and clipped.

History mode (``window`` = S steps): a sample is S consecutive steps of one task segment (every ``stride``
steps, plus one ending at the segment's last step, as OpenVLA's windows), each with its own chunk target.

Micro-batches hold samples of one task (one prompt, so one token layout per forward); an epoch shuffles the
samples of every task, cuts them into ``batch_size`` micro-batches and shuffles those; everything random
derives from (seed, epoch, index).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from vla_runtime.data import LeRobotDataset
from vla_runtime.models.openvla_oft.normalization_oft import BoundsStats
from vla_runtime.models.prismatic.processing_prismatic import crop_resize

from .config import FinetuneConfig
from .data import CROP_AREA, check_features, task_segments, window_starts
from .frames import DecodedDataset, cached_dataset
from .statistics import dataset_statistics, default_action_mask


@dataclass(frozen=True)
class Sample:
    """Frame ``frame`` (a flat index into the decoded dataset; history mode: the window's first) of task
    segment ``segment``."""

    segment: int
    frame: int


def chunk_rows(first: int, length: int, t: int, chunk: int) -> np.ndarray:
    """Frame indices of the chunk of step ``t`` of a segment starting at frame ``first`` with ``length``
    frames: ``t .. t + chunk - 1``, the last frame repeated past the end. -> [chunk] int."""
    return first + np.minimum(np.arange(t, t + chunk), length - 1)


class OFTTrainingData:
    """Decoded frames, normalised action chunks and proprio, samples grouped by task."""

    def __init__(
        self, decoded: DecodedDataset, *, policy, dataset_name: str, action_mask: list[bool], image_aug: bool,
        window: int | None = None, stride: int = 1,
    ) -> None:  # fmt: skip
        """window: history mode's steps per sample (``None`` = single frame); stride: between window starts."""
        cfg = policy.config
        self.window = window
        self.decoded = decoded
        self.processor = policy.image_processor
        self.image_aug = image_aug
        self.chunk_size, self.action_dim = cfg.chunk_size, cfg.action_dim
        entry = dataset_statistics(
            decoded.actions, decoded.states, mask=action_mask, n_episodes=len(decoded.lengths), action_names=decoded.action_names
        )  # fmt: skip
        self.statistics = {dataset_name: entry}
        action_stats = BoundsStats.from_dict(entry["action"], cfg.normalization, what=f"{dataset_name} action")
        self.actions = action_stats.normalize(decoded.actions).astype(np.float32)  # [F, A]
        self.proprio = None
        if cfg.proprio_dim is not None:
            proprio_stats = BoundsStats.from_dict(entry["proprio"], cfg.normalization, what=f"{dataset_name} proprio")
            self.proprio = proprio_stats.normalize(decoded.states).astype(np.float32)  # [F, P]
        self.segments = task_segments(decoded)
        tasks = sorted({task for _, _, task in self.segments})
        self.prompts = {task: policy.tokenizer.prompt(task) for task in tasks}
        if window is None:
            self.samples = [Sample(i, first + t) for i, (first, length, _) in enumerate(self.segments) for t in range(length)]
        else:
            self.samples = [Sample(i, first + t) for i, (first, length, _) in enumerate(self.segments)
                            for t in window_starts(length, window, stride)]  # fmt: skip
            if not self.samples:
                longest = max(length for _, length, _ in self.segments)
                raise ValueError(f"the history window ({window} steps) is longer than every episode (longest: {longest}); lower `data.window`")
        self.buckets: dict[str, list[int]] = {}
        for i, s in enumerate(self.samples):
            self.buckets.setdefault(self.segments[s.segment][2], []).append(i)

    @classmethod
    def prepare(cls, cfg: FinetuneConfig, policy, *, cache_dir: Path, progress: bool = True) -> "OFTTrainingData":
        """Check ``cfg.dataset`` against the policy, decode it (cached) and build the samples."""
        ds = LeRobotDataset(cfg.dataset)
        camera = check_features(ds, camera=cfg.data.camera, action_dim=policy.action_dim, proprio_dim=policy.config.proprio_dim)
        decoded = cached_dataset(ds, camera, cache_dir, build=True, progress=progress)
        mask = cfg.data.action_mask if cfg.data.action_mask is not None else default_action_mask(decoded.actions.shape[1])
        history = cfg.history.episodic
        return cls(
            decoded, policy=policy, dataset_name=cfg.data.dataset_name or Path(cfg.dataset).resolve().name, action_mask=mask,
            image_aug=cfg.data.image_aug, window=cfg.data.window if history else None, stride=cfg.data.stride,
        )  # fmt: skip

    def targets(self, sample: Sample) -> np.ndarray:
        """The sample's normalised chunk [chunk_size, action_dim] (history mode: [S, chunk_size, action_dim])."""
        first, length, _ = self.segments[sample.segment]
        t = sample.frame - first
        if self.window is None:
            return self.actions[chunk_rows(first, length, t, self.chunk_size)]
        return np.stack([self.actions[chunk_rows(first, length, t + i, self.chunk_size)] for i in range(self.window)])

    def frames_of(self, sample: Sample) -> list[int]:
        """The sample's frame indices: [1] single frame, [S] history mode."""
        return [sample.frame] if self.window is None else list(range(sample.frame, sample.frame + self.window))

    def batch(self, indices: list[int], rng: np.random.Generator) -> dict:
        """Samples of one task -> ``pixels`` [B, C, H, W], ``targets`` [B, K, A], ``proprio`` [B, P] (if any) and
        the ``task``; history mode: ``pixels`` [B, S, C, H, W], ``targets`` [B, S, K, A], ``proprio`` [B, S, P]."""
        samples = [self.samples[i] for i in indices]
        rows = [f for s in samples for f in self.frames_of(s)]
        frames = self.decoded.frames[rows]
        if self.image_aug:
            size = self.processor.size
            frames = np.stack([crop_resize(f, size=size, area=CROP_AREA, at=tuple(rng.random(2))) for f in frames])
        pixels = self.processor.batch(frames)  # [B * S, C, H, W]
        shape = (len(samples),) if self.window is None else (len(samples), self.window)
        out = {
            "task": self.segments[samples[0].segment][2],
            "pixels": pixels.view(*shape, *pixels.shape[1:]),
            "targets": torch.from_numpy(np.stack([self.targets(s) for s in samples])),
        }
        if self.proprio is not None:
            out["proprio"] = torch.from_numpy(self.proprio[rows]).view(*shape, -1)
        return out


class OFTMicroBatches(Dataset):
    """The ``max_steps * grad_accum`` micro-batches of a run, in order (see the module docstring)."""

    def __init__(self, data: OFTTrainingData, *, batch_size: int, grad_accum: int, max_steps: int, seed: int) -> None:
        self.data, self.batch_size, self.grad_accum, self.max_steps, self.seed = data, batch_size, grad_accum, max_steps, seed
        self.per_epoch = sum(-(-len(idx) // batch_size) for idx in data.buckets.values())

    def __len__(self) -> int:
        return self.max_steps * self.grad_accum

    @lru_cache(maxsize=2)
    def epoch(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        micro = []
        for task in sorted(self.data.buckets):
            idx = rng.permutation(self.data.buckets[task])
            micro += [idx[i : i + self.batch_size].tolist() for i in range(0, len(idx), self.batch_size)]
        return [micro[i] for i in rng.permutation(len(micro))]

    def __getitem__(self, i: int) -> dict:
        epoch, j = divmod(i, self.per_epoch)
        return self.data.batch(self.epoch(epoch)[j], np.random.default_rng([self.seed, epoch, j, 1]))
