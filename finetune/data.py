"""A LeRobot dataset prepared for training one policy: checked, decoded once, tokenised, windowed.

    data = TrainingData.prepare(cfg, policy, cache_dir, build_cache=rank == 0)
    data.statistics             # dataset_statistics.json entry (OpenVLA format)
    batches = MicroBatches(data, cfg, rank=r, world=w, start_step=s)   # torch Dataset of micro-batches

Every problem with the data is raised before training starts: missing features, an action or state
size the model cannot take, windows longer than every episode.

Micro-batches are drawn per bucket (windows whose token layouts coincide: same prompt length, same
steps, starting at the episode's start or not), because the parallel form runs one schedule per
forward. Whole-episode windows (``window: 0``) are padded up to a multiple of ``length_bucket`` steps
(the last frame and action repeated, their targets ``IGNORE``): the schedule is causal, so what the
real steps compute does not depend on the padding after them. An epoch shuffles the windows of every bucket, cuts them into micro-batches of
``batch_size`` (a bucket's last one may be smaller) and shuffles the micro-batches. Optimizer step k
uses the ``grad_accum * world`` consecutive micro-batches from ``k * grad_accum * world`` on; rank r
takes ``m * world + r`` for its m-th accumulation step, so 2 ranks x 1 step of accumulation see the
same data as 1 rank x 2. Everything random derives from (seed, epoch, index): a resumed run repeats it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from vla_runtime.config import HistoryMode
from vla_runtime.data import LeRobotDataset
from vla_runtime.data import layout as lerobot
from vla_runtime.models.openvla.processing_openvla import ActionTokenizer
from vla_runtime.models.prismatic.processing_prismatic import ActionStats, crop_resize
from vla_runtime.models.prismatic.prompt_prismatic import PromptIds

from .config import FinetuneConfig
from .cue_targets import CUE_STEPS, SEPARABLE_STEPS, cue_counts, cue_seen, decision_weights, recorded_steps, separable_weights
from .frames import DecodedDataset, cached_dataset
from .layout import FlatLayout, flatten, same_positions, window_forwards
from .statistics import dataset_statistics, default_action_mask

log = logging.getLogger(__name__)

CROP_AREA = 0.9  # OpenVLA's image_aug random resized crop (and the eval centre crop)
IGNORE = -100  # label of a padded step's targets (``F.cross_entropy``'s default ignore_index)


@dataclass(frozen=True)
class Window:
    """Steps ``start .. start + steps - 1`` of ``episode`` (an index into ``task_segments``: an episode, or the
    part of one with a single task), laid out padded to ``TrainingData.padded_steps``."""

    episode: int
    start: int
    steps: int


def task_segments(decoded: DecodedDataset) -> list[tuple[int, int, str]]:
    """(first frame, length, task) of every run of frames with one task inside one episode, in order."""
    segments = []
    for offset, length in zip(decoded.offsets, decoded.lengths):
        start = offset
        for t in range(offset + 1, offset + length + 1):
            if t == offset + length or decoded.tasks[t] != decoded.tasks[start]:
                segments.append((start, t - start, decoded.tasks[start]))
                start = t
    return segments


def window_starts(length: int, window: int, stride: int) -> list[int]:
    """Starts of the windows of an episode: every ``stride`` steps, plus one ending at the last step."""
    if length < window:
        return []
    starts = list(range(0, length - window + 1, stride))
    if starts[-1] != length - window:
        starts.append(length - window)
    return starts


def check_features(ds: LeRobotDataset, *, camera: str | None, action_dim: int, proprio_dim: int | None) -> str:
    """Raise before training when the dataset cannot train this model; returns the camera to use."""
    features = ds.features
    missing = [k for k in (lerobot.ACTION_KEY, "task_index", "episode_index", "frame_index") if k not in features]
    if missing:
        raise ValueError(f"dataset {ds.root} lacks required feature(s) {missing}; its features: {sorted(features)}")
    if not ds.cameras:
        raise ValueError(
            f"dataset {ds.root} has no image or video feature (observation.images.*); its features: {sorted(features)}"
        )
    if camera is None:
        camera = ds.cameras[0]
    elif camera not in ds.cameras:
        raise ValueError(f"camera {camera!r} is not in dataset {ds.root}; its cameras: {', '.join(ds.cameras)}")
    shape = features[lerobot.ACTION_KEY].get("shape") or [0]
    if int(shape[0]) != action_dim:
        names = features[lerobot.ACTION_KEY].get("names")
        raise ValueError(
            f"dataset {ds.root} has {shape[0]}-D actions {names or ''}, but the policy predicts {action_dim}-D actions "
            "(its action statistics / config); convert the dataset to the policy's action convention"
        )
    if proprio_dim is not None:
        if lerobot.STATE_KEY not in features:
            raise ValueError(
                f"the policy has a proprio projector ({proprio_dim}-D input) but dataset {ds.root} has no "
                f"{lerobot.STATE_KEY!r}; its features: {sorted(features)}"
            )
        state = int((features[lerobot.STATE_KEY].get("shape") or [0])[0])
        if state != proprio_dim:
            raise ValueError(
                f"dataset {lerobot.STATE_KEY!r} is {state}-D; the policy's proprio projector takes {proprio_dim}-D"
            )
    return camera


class TrainingData:
    """Decoded frames, tokenised actions, normalised proprio, windows grouped into buckets."""

    def __init__(
        self,
        decoded: DecodedDataset,
        *,
        policy,
        history: bool,
        keep_actions: bool = True,
        window: int,
        stride: int,
        length_bucket: int,
        dataset_name: str,
        action_mask: list[bool],
        image_aug: bool,
        goal_targets: bool = False,
        cue_steps: list[list[int]] | None = None,
        seen_steps: list[list[int]] | None = None,
        step_weight: np.ndarray | None = None,
    ) -> None:
        cfg = policy.config
        self.decoded = decoded
        self.processor = policy.image_processor
        self.history = history
        self.keep_actions = keep_actions  # False: HistoryMode.OBSERVATIONS (no action token stays in the context)
        self.image_aug = image_aug
        self.whole_episodes = history and window == 0
        self.length_bucket = length_bucket
        self.has_proprio = cfg.proprio_dim is not None
        if goal_targets and not self.has_proprio:
            raise ValueError("the goal loss (`goal_weight` > 0) regresses the robot state: it needs a policy with a proprio input")
        self.goal_targets = goal_targets  # each batch carries ``goal``: the normalised state of the segment's last frame
        self.cue_count = None  # [F], standardised over the dataset's frames (a target of scale 1, as the goal's)
        if cue_steps is not None:
            counts = cue_counts(cue_steps, decoded.lengths)
            self.cue_count = (counts - counts.mean()) / max(float(counts.std()), 1e-6)
        self.cue_seen = None if seen_steps is None else cue_seen(seen_steps, decoded.lengths)  # [F] 1 = a cue drawn
        if step_weight is not None and step_weight.shape != (len(decoded.actions),):
            raise ValueError(f"`step_weight` must be one weight per frame ({len(decoded.actions)}), got {step_weight.shape}")
        self.step_weight = step_weight  # [F] action-loss weight of each frame (decision and separable weights)
        self.n_image_tokens = cfg.vision.num_patches
        self.action_dim = decoded.actions.shape[1]
        self.dataset_name = dataset_name
        entry = dataset_statistics(
            decoded.actions,
            decoded.states,
            mask=action_mask,
            n_episodes=len(decoded.lengths),
            action_names=decoded.action_names,
        )
        self.statistics = {dataset_name: entry}
        action_stats = ActionStats.from_dict(entry["action"])
        tokenizer = ActionTokenizer(cfg.n_bins, cfg.vocab_size_text, action_stats)
        self.action_ids = tokenizer.encode(action_stats.normalize(decoded.actions.astype(np.float64)))  # [F, A]
        self.proprio = None
        if self.has_proprio:
            proprio_stats = ActionStats.from_dict(entry["proprio"], what="proprio")
            self.proprio = proprio_stats.normalize(decoded.states.astype(np.float64)).astype(np.float32)  # [F, P]
        # windows never cross a change of task: each run of frames with one task is a segment with its own prompt
        # (at inference a new instruction starts a new session); Window.episode indexes these segments
        self.segments = task_segments(decoded)
        prompts: dict[str, PromptIds] = {}
        self.prompts = [prompts.setdefault(task, policy.tokenizer.prompt(task)) for _, _, task in self.segments]
        steps, stride = (window, stride) if history else (1, 1)
        self.windows: list[Window] = []
        short = 0
        for segment, (_, length, _) in enumerate(self.segments):
            if self.whole_episodes:  # the whole episode, or the whole part of it with one task
                self.windows.append(Window(segment, 0, length))
                continue
            starts = window_starts(length, steps, stride)
            short += not starts
            self.windows += [Window(segment, s, steps) for s in starts]
        longest = max(length for _, length, _ in self.segments)
        if not self.windows:
            raise ValueError(
                f"the history window ({window} steps) is longer than every episode (longest: {longest} steps); "
                "lower `data.window`"
            )
        if short:
            log.warning(
                "%d of %d episodes are shorter than the %d-step window and are not used (an episode whose task changes counts once per task)",
                short,
                len(self.segments),
                window,
            )
        self.buckets: dict[tuple, list[int]] = {}
        for i, w in enumerate(self.windows):
            self.buckets.setdefault(self.bucket_key(w), []).append(i)
        self.layouts = {key: self._layout(self.windows[idx[0]])[0] for key, idx in self.buckets.items()}

    @classmethod
    def prepare(
        cls, cfg: FinetuneConfig, policy, *, cache_dir: Path, build_cache: bool, progress: bool = True
    ) -> "TrainingData":
        """Check ``cfg.dataset`` against the policy, decode it (cached) and build the windows."""
        ds = LeRobotDataset(cfg.dataset)
        camera = check_features(
            ds, camera=cfg.data.camera, action_dim=policy.action_dim, proprio_dim=policy.config.proprio_dim
        )
        decoded = cached_dataset(ds, camera, cache_dir, build=build_cache, progress=progress)
        cue_options = " and ".join(
            name for name, on in (("the cue-count loss (`cue_weight` > 0)", cfg.cue_weight > 0),
                                  ("the cue-seen loss (`cue_seen_weight` > 0)", cfg.cue_seen_weight > 0),
                                  ("the decision weights (`decision_weight` != 1)", cfg.decision_weight != 1)) if on
        )  # fmt: skip
        cue_steps = recorded_steps(ds, CUE_STEPS, wanted_by=cue_options) if cue_options else None
        step_weight = None
        if cfg.decision_weight != 1:
            step_weight = decision_weights(cue_steps, decoded.lengths, span=cfg.decision_span, weight=cfg.decision_weight)
        if cfg.separable_weight != 1:
            separable = recorded_steps(ds, SEPARABLE_STEPS, wanted_by="the separable weights (`separable_weight` != 1)")
            weights = separable_weights(separable, decoded.lengths, span=cfg.separable_span, weight=cfg.separable_weight)
            step_weight = weights if step_weight is None else step_weight * weights
        mask = (
            cfg.data.action_mask if cfg.data.action_mask is not None else default_action_mask(decoded.actions.shape[1])
        )
        return cls(
            decoded,
            policy=policy,
            history=cfg.history.episodic,
            keep_actions=cfg.history is not HistoryMode.OBSERVATIONS,
            window=cfg.data.window,
            stride=cfg.data.stride,
            length_bucket=cfg.data.length_bucket,
            dataset_name=cfg.data.dataset_name or Path(cfg.dataset).resolve().name,
            action_mask=mask,
            image_aug=cfg.data.image_aug,
            goal_targets=cfg.goal_weight > 0,
            cue_steps=cue_steps if cfg.cue_weight > 0 else None,
            seen_steps=cue_steps if cfg.cue_seen_weight > 0 else None,
            step_weight=step_weight,
        )

    # ---- windows -----------------------------------------------------------------------------------
    def padded_steps(self, w: Window) -> int:
        """Steps ``w`` is laid out with: whole episodes round up to a multiple of ``length_bucket``."""
        if not self.whole_episodes:
            return w.steps
        return -(-w.steps // self.length_bucket) * self.length_bucket

    def bucket_key(self, w: Window) -> tuple[int, int, bool]:
        """Windows with equal keys have equal token layouts."""
        return len(self.prompts[w.episode].instruction), self.padded_steps(w), self._continues(w)

    def _rows(self, w: Window) -> np.ndarray:
        """Frame indices of the window's laid-out steps, the last one repeated as padding: [padded_steps]."""
        first = self.segments[w.episode][0] + w.start
        return first + np.minimum(np.arange(self.padded_steps(w)), w.steps - 1)

    def _layout(self, w: Window) -> tuple[FlatLayout, list[int]]:
        rows = self._rows(w)
        prev = int(self.action_ids[rows[0] - 1, -1]) if self._continues(w) else None
        forwards = window_forwards(
            self.prompts[w.episode],
            self.action_ids[rows].tolist(),
            history=self.history,
            has_proprio=self.has_proprio,
            prev_token=prev,
            keep_actions=self.keep_actions,
        )
        return flatten(forwards, n_image_tokens=self.n_image_tokens, action_dim=self.action_dim, keep_actions=self.keep_actions)

    def _continues(self, w: Window) -> bool:
        """``w`` starts mid-episode with the previous step's action token in front of its first frame."""
        return self.history and self.keep_actions and w.start > 0

    def real_tokens(self, layout: FlatLayout, w: Window) -> int:
        """Tokens of ``w``'s own steps in its (padded) layout: the prompt forward + ``action_dim`` per step."""
        return sum(layout.boundaries[: len(layout.boundaries) - (self.padded_steps(w) - w.steps) * self.action_dim])

    # ---- one micro-batch ---------------------------------------------------------------------------
    def pixels(self, frames: np.ndarray, rng: np.random.Generator) -> tuple[str, torch.Tensor]:
        """uint8 [N, H, W, 3] -> ``("frames", uint8 [N, S, S, 3])`` when they are at the model's size (the
        training module normalises them on its device: ``ImageProcessor.normalize``), else ``("pixels",
        [N, C, S, S])``; with ``image_aug`` a random crop of 0.9 of the area first (one draw per frame)."""
        if self.image_aug:
            size = self.processor.size
            frames = np.stack([crop_resize(f, size=size, area=CROP_AREA, at=tuple(rng.random(2))) for f in frames])
        if self.processor.takes_as_is(*frames.shape[1:3]):
            return "frames", torch.from_numpy(np.ascontiguousarray(frames))
        return "pixels", self.processor.batch(frames)

    def batch(self, indices: list[int], rng: np.random.Generator) -> dict:
        """Windows (of one bucket) -> tensors: ``frames`` uint8 [B, S, H, W, 3] (or ``pixels`` [B, S, C, H, W]
        for frames the model's transform must resize: ``pixels``), ``proprio`` [B, S, P] (if any),
        ``text_ids`` [B, Nt], ``labels`` [B, S * A] (``IGNORE`` on padded steps), ``tokens`` (the
        windows' real tokens, padding excluded), the bucket ``key``, with ``goal_targets`` ``goal`` [B, P]
        (the normalised state of each window's segment at its last frame) and with ``cue_steps`` ``cue_count``
        [B, S] (the episode's cue steps at or before each step, standardised over the dataset's frames), with ``seen_steps``
        ``cue_seen`` [B, S] (1 where a cue is drawn into the step's frame); with
        ``step_weight`` ``step_weight`` [B, S] (each step's action-loss weight)."""
        windows = [self.windows[i] for i in indices]
        key = self.bucket_key(windows[0])
        layout = self.layouts[key]
        pixels, text, labels, proprio, goal, cues, seen, weights, tokens = [], [], [], [], [], [], [], [], 0
        for w in windows:
            own, ids = self._layout(w)
            if not same_positions(own, layout):
                raise AssertionError(f"window {w} does not share its bucket's layout")
            rows = self._rows(w)
            image_key, images = self.pixels(self.decoded.frames[rows], rng)
            pixels.append(images)
            text.append(ids)
            step_labels = self.action_ids[rows].copy()  # [S, A]
            step_labels[w.steps :] = IGNORE
            labels.append(step_labels.reshape(-1))
            tokens += self.real_tokens(layout, w)
            if self.proprio is not None:
                proprio.append(torch.from_numpy(self.proprio[rows]))
            if self.goal_targets:
                first, length, _ = self.segments[w.episode]
                goal.append(torch.from_numpy(self.proprio[first + length - 1]))
            if self.cue_count is not None:
                cues.append(torch.from_numpy(self.cue_count[rows]))
            if self.cue_seen is not None:
                seen.append(torch.from_numpy(self.cue_seen[rows]))
            if self.step_weight is not None:
                weights.append(torch.from_numpy(self.step_weight[rows]))
        out = {
            "key": key,
            "tokens": tokens,
            image_key: torch.stack(pixels),
            "text_ids": torch.tensor(text, dtype=torch.long),
            "labels": torch.from_numpy(np.stack(labels)).long(),
        }
        if proprio:
            out["proprio"] = torch.stack(proprio)
        if goal:
            out["goal"] = torch.stack(goal)
        if cues:
            out["cue_count"] = torch.stack(cues)
        if seen:
            out["cue_seen"] = torch.stack(seen)
        if weights:
            out["step_weight"] = torch.stack(weights)
        return out


class MicroBatches(Dataset):
    """The micro-batches one rank consumes from ``start_step`` to ``max_steps`` (``grad_accum`` per step).

    Item i is the micro-batch of step ``start_step + i // grad_accum``, accumulation index
    ``i % grad_accum``; see the module docstring for the order.
    """

    def __init__(
        self,
        data: TrainingData,
        *,
        batch_size: int,
        grad_accum: int,
        max_steps: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        start_step: int = 0,
    ) -> None:
        self.data, self.batch_size, self.grad_accum = data, batch_size, grad_accum
        self.seed, self.rank, self.world, self.start_step = seed, rank, world, start_step
        self.n_steps = max_steps - start_step
        self.per_epoch = sum(-(-len(idx) // batch_size) for idx in data.buckets.values())
        self.steps_per_epoch = self.per_epoch // (grad_accum * world)
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the dataset yields {self.per_epoch} micro-batches of {batch_size} windows per epoch, fewer than one optimizer "
                f"step needs (grad_accum {grad_accum} x {world} process(es)); lower batch_size / grad_accum or add data"
            )

    def __len__(self) -> int:
        return self.n_steps * self.grad_accum

    @lru_cache(maxsize=2)
    def epoch(self, epoch: int) -> list[list[int]]:
        """The epoch's micro-batches (window indices), in order."""
        rng = np.random.default_rng([self.seed, epoch])
        micro = []
        for key in sorted(self.data.buckets):
            idx = rng.permutation(self.data.buckets[key])
            micro += [idx[i : i + self.batch_size].tolist() for i in range(0, len(idx), self.batch_size)]
        return [micro[i] for i in rng.permutation(len(micro))]

    def locate(self, i: int) -> tuple[int, int]:
        """Item i -> (epoch, index of its micro-batch in the epoch)."""
        step, m = divmod(i, self.grad_accum)
        epoch, k = divmod(self.start_step + step, self.steps_per_epoch)
        return epoch, (k * self.grad_accum + m) * self.world + self.rank

    def __getitem__(self, i: int) -> dict:
        epoch, j = self.locate(i)
        return self.data.batch(self.epoch(epoch)[j], np.random.default_rng([self.seed, epoch, j, 1]))
