"""The Prismatic VLM's input/output processing, shared by every family on it.

- ``ImageProcessor``: upstream ``PrismaticImageProcessor``'s inference path (PIL bicubic resize with
  torchvision's functional ops, ``to_tensor``, per-tower ``normalize``, towers stacked on channels), with
  the normalisation constants read from ``preprocessor_config.json`` ``tvf_normalize_params`` (the
  bf16-rounded DINO values upstream actually runs with). ``center_crop`` is the 0.9-area eval crop.
- Token layout types (cross-team contract 2): ``Segment``s of a model ``Forward``, and ``history_prompt``,
  the pinned prompt every history-mode session starts with. The prompt's ids are in ``prompt_prismatic``;
  OpenVLA's step layouts in ``models.openvla.processing_openvla``.
- ``ActionStats`` (q01/q99 bounds with a mask) and ``resolve_unnorm_key`` (upstream's ``unnorm_key`` rules).
No ``nn.Module`` here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.functional as TVF
from PIL import Image

from ...images import validate_image
from .configuration_prismatic import read_json
from .configuration_vision import VisionConfig
from .prompt_prismatic import PromptIds
from .statistics import read_bounds

# ---- image -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TowerTransform:
    """One tower's input: square ``size`` and the normalisation it was trained with."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def _resize_naive(image: Image.Image, size: int, fill: tuple[int, ...]) -> Image.Image:
    return TVF.resize(image, [size, size], interpolation=TVF.InterpolationMode.BICUBIC, antialias=True)


def _resize_crop(image: Image.Image, size: int, fill: tuple[int, ...]) -> Image.Image:
    image = TVF.resize(image, size, interpolation=TVF.InterpolationMode.BICUBIC, antialias=True)
    return TVF.center_crop(image, [size, size])


def _letterbox(image: Image.Image, size: int, fill: tuple[int, ...]) -> Image.Image:
    (w, h), side = image.size, max(image.size)
    pad_w, pad_h = int((side - w) / 2), int((side - h) / 2)
    image = TVF.pad(image, [pad_w, pad_h, pad_w, pad_h], fill=fill, padding_mode="constant")
    return _resize_crop(image, size, fill)


def _tower_normalization(pre: Mapping, towers: int, source: str | Path) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
    """Per-tower (mean, std) of a preprocessor config: ``tvf_normalize_params`` (what upstream applies), else
    ``means``/``stds``; [] when it has neither. Checked: one pair per tower, 3 finite numbers each, std > 0."""
    if pre.get("tvf_normalize_params"):
        params = pre["tvf_normalize_params"]
        if not isinstance(params, list) or not all(isinstance(p, Mapping) for p in params):
            raise ValueError(f"{source} `tvf_normalize_params` must be a list of {{mean, std}} mappings, one per tower, got {params!r:.80}")
        pairs = [((f"tvf_normalize_params[{i}].mean", p.get("mean")), (f"tvf_normalize_params[{i}].std", p.get("std"))) for i, p in enumerate(params)]
        key = "tvf_normalize_params"
    else:
        means, stds = pre.get("means") or [], pre.get("stds") or []
        if not isinstance(means, list) or not isinstance(stds, list) or len(means) != len(stds):
            raise ValueError(f"{source} `means` and `stds` must be lists of equal length, one entry per tower")
        pairs = [((f"means[{i}]", m), (f"stds[{i}]", s)) for i, (m, s) in enumerate(zip(means, stds))]
        key = "means`/`stds"
    if pairs and len(pairs) != towers:
        raise ValueError(f"{source} `{key}` has {len(pairs)} entries; the vision backbone has {towers} tower(s)")
    return [(_rgb(mean, source, mean_key, positive=False), _rgb(std, source, std_key, positive=True)) for (mean_key, mean), (std_key, std) in pairs]


def _rgb(values: object, source: str | Path, key: str, *, positive: bool) -> tuple[float, float, float]:
    """A mean or std: 3 finite numbers (``positive``: each > 0); a ValueError naming ``source`` and ``key`` otherwise."""
    numbers = isinstance(values, (list, tuple)) and len(values) == 3 and all(type(x) in (int, float) for x in values)
    if not numbers or not all(math.isfinite(x) and (x > 0 or not positive) for x in values):
        raise ValueError(f"{source} `{key}` must be 3 finite numbers{' > 0' if positive else ''} (one per RGB channel), got {values!r}")
    return tuple(float(x) for x in values)


RESIZERS = {"resize-naive": _resize_naive, "resize-crop": _resize_crop, "letterbox": _letterbox}


@dataclass(frozen=True)
class ImageProcessor:
    """uint8 [H, W, 3] RGB -> pixel values [3 * towers, S, S] float32 (towers stacked, DINO first).

    Args:
        towers: per-tower size and normalisation.
        resize_strategy: ``resize-naive`` (squash, OpenVLA), ``resize-crop`` or ``letterbox``.
    """

    towers: tuple[TowerTransform, ...]
    resize_strategy: str = "resize-naive"

    def __post_init__(self) -> None:
        if self.resize_strategy not in RESIZERS:
            raise KeyError(f"unknown image resize strategy {self.resize_strategy!r}; known: {', '.join(sorted(RESIZERS))}")

    @classmethod
    def from_config(
        cls, vision: VisionConfig, preprocessor: Mapping | None = None, *, source: str | Path = "preprocessor_config.json"
    ) -> "ImageProcessor":
        """From the vision config, overridden by a ``preprocessor_config.json`` dict when given (``source`` names
        it in errors). Its per-tower mean/std must be 3 finite numbers each, std > 0, one pair per tower."""
        pre = dict(preprocessor or {})
        normalize = _tower_normalization(pre, len(vision.towers), source)
        resize = pre.get("tvf_resize_params") or []
        if not isinstance(resize, list) or not all(isinstance(r, Mapping) for r in resize):
            raise ValueError(f"{source} `tvf_resize_params` must be a list of {{size, ...}} mappings, one per tower, got {resize!r:.80}")
        towers = []
        for i, tower in enumerate(vision.towers):
            size = tower.image_size
            if i < len(resize):
                want = resize[i].get("size")
                want = [want, want] if isinstance(want, int) else list(want)
                if want != [size, size]:
                    raise ValueError(
                        f"{source} resizes tower {i} to {want}, but config.json `image_sizes` says {size}"
                    )
            mean, std = normalize[i] if normalize else (tower.mean, tower.std)
            towers.append(TowerTransform(size, tuple(mean), tuple(std)))
        return cls(tuple(towers), pre.get("image_resize_strategy", vision.image_resize_strategy))

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, vision: VisionConfig) -> "ImageProcessor":
        file = Path(path) / "preprocessor_config.json"
        return cls.from_config(vision, read_json(file), source=file) if file.is_file() else cls.from_config(vision)

    def to_hf(self, vision: VisionConfig) -> dict:
        """``preprocessor_config.json`` as upstream writes it: ``means``/``stds`` are timm's values,
        ``tvf_normalize_params`` the ones actually applied (this processor's)."""
        naive = self.resize_strategy == "resize-naive"
        letterbox = self.resize_strategy == "letterbox"
        return {
            "auto_map": {
                "AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor",
                "AutoProcessor": "processing_prismatic.PrismaticProcessor",
            },
            "image_processor_type": "PrismaticImageProcessor",
            "image_resize_strategy": self.resize_strategy,
            "input_sizes": [[3, t.size, t.size] for t in self.towers],
            "interpolations": ["bicubic"] * len(self.towers),
            "means": [list(t.mean) for t in vision.towers],
            "processor_class": "PrismaticProcessor",
            "stds": [list(t.std) for t in vision.towers],
            "tvf_crop_params": [{"output_size": [t.size, t.size]} for t in self.towers],
            "tvf_do_letterbox": letterbox,
            "tvf_letterbox_fill": [int(x * 255) for x in self.towers[-1].mean] if letterbox else None,
            "tvf_normalize_params": [{"inplace": False, "mean": list(t.mean), "std": list(t.std)} for t in self.towers],
            "tvf_resize_params": [
                {"antialias": True, "interpolation": 3, "max_size": None, "size": [t.size, t.size] if naive else t.size}
                for t in self.towers
            ],
            "use_fused_vision_backbone": vision.fused,
        }

    @property
    def size(self) -> int:
        return self.towers[0].size

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        """image: uint8 [H, W, 3] -> [3 * towers, S, S] float32."""
        pil = Image.fromarray(validate_image(image)).convert("RGB")
        fill = tuple(int(x * 255) for x in self.towers[-1].mean)
        resized: dict[int, torch.Tensor] = {}
        out = []
        for tower in self.towers:
            if tower.size not in resized:
                resized[tower.size] = TVF.to_tensor(RESIZERS[self.resize_strategy](pil, tower.size, fill))
            out.append(TVF.normalize(resized[tower.size], tower.mean, tower.std))
        return torch.cat(out, dim=0)

    def batch(self, frames: np.ndarray) -> torch.Tensor:
        """frames: uint8 [N, H, W, 3] -> [N, 3 * towers, S, S] float32, equal to stacking ``self(frame)``.

        Frames already square at every tower's size (a training set collected at the model's resolution)
        take one vectorised pass: every resize strategy is then the identity. Others go frame by frame.
        """
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected uint8 frames [N, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        n, h, w = frames.shape[:3]
        if not self.takes_as_is(h, w):
            return torch.stack([self(f) for f in frames]) if n else torch.empty(0, 3 * len(self.towers), self.size, self.size)
        return self.normalize(torch.from_numpy(np.ascontiguousarray(frames)))

    def takes_as_is(self, height: int, width: int) -> bool:
        """Frames of this size are square at every tower's size: no resize, ``normalize`` is the whole transform."""
        return height == width and all(t.size == height for t in self.towers)

    def normalize(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 frames [N, S, S, 3] at the towers' size (``takes_as_is``), on any device -> [N, 3 * towers, S, S]
        float32, as ``TVF.to_tensor`` then ``TVF.normalize`` per tower. Training moves uint8 frames to the GPU
        and normalises there: an eighth of the bytes of two towers' float pixels, and no CPU work."""
        x = frames.permute(0, 3, 1, 2).float().div(255)
        out = []
        for t in self.towers:  # (x - mean) / std in float32
            mean, std = (torch.tensor(v, dtype=torch.float32, device=x.device)[:, None, None] for v in (t.mean, t.std))
            out.append((x - mean) / std)
        return torch.cat(out, dim=1)


def center_crop(image: np.ndarray, *, size: int, area: float = 0.9) -> np.ndarray:
    """The eval-time crop for models trained with ``image_aug``: a centred box covering ``area`` of the
    image (side ``sqrt(area)``), bilinearly resampled to ``size`` x ``size`` as ``tf.image.crop_and_resize``
    does, then back to uint8 as ``tf.image.convert_image_dtype(saturate=True)`` does.

    image: uint8 [H, W, 3] -> uint8 [size, size, 3].
    """
    return crop_resize(image, size=size, area=area)


def crop_resize(image: np.ndarray, *, size: int, area: float = 0.9, at: tuple[float, float] = (0.5, 0.5)) -> np.ndarray:
    """``center_crop`` with the box anywhere: ``at`` = (y, x) place of the box as fractions of the free
    margin (0.5 = centred, the eval crop; training's random resized crop draws them uniformly).

    image: uint8 [H, W, 3] -> uint8 [size, size, 3].
    """
    image = validate_image(image)
    if not 0 < area <= 1:
        raise ValueError(f"crop `area` must be in (0, 1], got {area}")
    if size < 2:
        raise ValueError(f"crop output `size` must be >= 2, got {size}")
    if not all(0.0 <= a <= 1.0 for a in at):
        raise ValueError(f"crop position `at` must be fractions in [0, 1], got {at}")
    h, w = image.shape[:2]
    side = np.float32(math.sqrt(area))
    steps = np.arange(size, dtype=np.float32)

    def coords(n: int, place: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample rows (or columns) of an n-long axis: floor index, ceil index, fraction."""
        lo = (np.float32(1) - side) * np.float32(place)
        at = lo * np.float32(n - 1) + steps * (side * np.float32(n - 1) / np.float32(size - 1))
        low = np.floor(at).astype(np.int64)
        return low, np.minimum(np.ceil(at).astype(np.int64), n - 1), (at - low).astype(np.float32)

    y0, y1, fy = coords(h, at[0])
    x0, x1, fx = coords(w, at[1])
    img = image.astype(np.float32) * np.float32(1.0 / 255.0)
    fx = fx[None, :, None]
    top = img[y0][:, x0] + (img[y0][:, x1] - img[y0][:, x0]) * fx
    bottom = img[y1][:, x0] + (img[y1][:, x1] - img[y1][:, x0]) * fx
    out = np.clip(top + (bottom - top) * fy[:, None, None], 0.0, 1.0)
    return np.clip(out * np.float32(255.5), 0, 255).astype(np.uint8)


# ---- token layout (cross-team contract 2) --------------------------------------------------------


class SegmentKind(Enum):
    TEXT = "text"
    IMAGE = "image"
    PROPRIO = "proprio"


@dataclass(frozen=True)
class Segment:
    """A run of input positions: token ids (TEXT), or the image tokens / proprio token of control ``step``."""

    kind: SegmentKind
    ids: tuple[int, ...] = ()
    step: int = 0

    def length(self, n_image_tokens: int) -> int:
        return {SegmentKind.TEXT: len(self.ids), SegmentKind.IMAGE: n_image_tokens, SegmentKind.PROPRIO: 1}[self.kind]


@dataclass(frozen=True)
class Forward:
    """One model forward: its segments in order; ``pin`` pins the cache afterwards (the prompt)."""

    segments: tuple[Segment, ...]
    pin: bool = False

    def length(self, n_image_tokens: int) -> int:
        return sum(s.length(n_image_tokens) for s in self.segments)


def text_segment(ids: Sequence[int]) -> Segment:
    """A TEXT segment of ``ids``."""
    return Segment(SegmentKind.TEXT, tuple(int(i) for i in ids))


def history_prompt(prompt: PromptIds) -> Forward:
    """History mode, once per episode: ``[BOS] + ids("In: What action ... {instruction}?")``, pinned."""
    return Forward((text_segment([prompt.bos, *prompt.instruction]),), pin=True)


# ---- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionStats:
    """BOUNDS_Q99 statistics of one dataset's actions (or proprio). mask=False dims pass through."""

    q01: np.ndarray
    q99: np.ndarray
    mask: np.ndarray

    @classmethod
    def from_dict(cls, stats: Mapping, *, what: str = "action") -> "ActionStats":
        """A statistics entry ``{q01, q99, mask}`` (mask optional), checked by ``statistics.read_bounds``."""
        return cls(*read_bounds(stats, "q01", "q99", what=what))

    @property
    def dim(self) -> int:
        return len(self.q01)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        """[..., D] in [-1, 1] -> robot units (masked dims only)."""
        return np.where(self.mask, 0.5 * (x + 1.0) * (self.q99 - self.q01) + self.q01, x)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Robot units [..., D] -> [-1, 1] (masked dims; zero-range dims -> 0)."""
        scaled = np.clip(2.0 * (x - self.q01) / (self.q99 - self.q01 + 1e-8) - 1.0, -1.0, 1.0)
        scaled = np.where(self.q99 == self.q01, 0.0, scaled)
        return np.where(self.mask, scaled, x)


def resolve_unnorm_key(norm_stats: Mapping, unnorm_key: str | None) -> str:
    """Upstream's rules: with no key the statistics must hold exactly one dataset; a given key must exist
    (``<key>_no_noops``, LIBERO's modified datasets, is accepted for ``<key>``)."""
    keys = sorted(norm_stats)
    if not keys:
        raise ValueError("the checkpoint has no action statistics (config.json norm_stats / dataset_statistics.json)")
    if unnorm_key is None:
        if len(keys) != 1:
            raise ValueError(
                f"the checkpoint has action statistics for {len(keys)} datasets; choose one with unnorm_key "
                f"(--unnorm-key): {', '.join(keys)}"
            )
        return keys[0]
    if unnorm_key in norm_stats:
        return unnorm_key
    if f"{unnorm_key}_no_noops" in norm_stats:
        return f"{unnorm_key}_no_noops"
    raise KeyError(f"unnorm_key {unnorm_key!r} is not in the checkpoint's action statistics; available: {', '.join(keys)}")
