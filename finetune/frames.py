"""Decode a LeRobot dataset once into an on-disk cache the training processes memory-map.

Video decoding (or PNG decoding) would otherwise dominate CPU training: every window reads W frames
per step. The cache holds, for one dataset and camera:

- ``frames.npy``: uint8 [F, H, W, 3], every episode's frames back to back (memory-mapped when read);
- ``actions.npy`` [F, A] float32, ``states.npy`` [F, P] float32 (when the dataset has a state);
- ``episodes.json``: per episode its frame count, per frame its task (a frame's own ``task_index``), plus
  the feature names.

The cache directory name is a hash of the dataset's files (paths, sizes, modification times) and the
camera, so a changed dataset is decoded again. Rank 0 builds it; other ranks wait and read it.
Nothing here is a pickle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from vla_runtime.data import LeRobotDataset
from vla_runtime.data import layout as lerobot

log = logging.getLogger(__name__)

FORMAT = 2  # bump when the cache layout changes (2: tasks per frame)


@dataclass
class DecodedDataset:
    """A dataset's episodes as flat arrays (frames memory-mapped).

    Args:
        frames: uint8 [F, H, W, 3], episode after episode.
        actions: [F, A] float32. states: [F, P] float32 or ``None``.
        lengths: frames per episode (``offsets[e]``, derived, is episode e's first frame).
        tasks: instruction per frame [F].
        action_names, state_names: feature names from ``info.json`` (``None`` when unnamed).
    """

    frames: np.ndarray
    actions: np.ndarray
    states: np.ndarray | None
    lengths: list[int]
    tasks: list[str]
    action_names: list[str] | None
    state_names: list[str] | None

    def __post_init__(self) -> None:
        self.offsets = [0, *np.cumsum(self.lengths).tolist()][:-1]  # episode e's first frame

    def episode_slice(self, episode: int) -> slice:
        start = self.offsets[episode]
        return slice(start, start + self.lengths[episode])


def cache_key(root: Path, camera: str) -> str:
    """Hash of every file under the dataset (relative path, size, mtime) and the camera."""
    h = hashlib.sha1(f"v{FORMAT}:{camera}".encode())
    files = (Path(d) / name for d, _, names in os.walk(root, followlinks=True) for name in names)  # symlinked folders too
    for path in sorted(p for p in files if p.is_file()):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _names(feature: dict | None) -> list[str] | None:
    names = (feature or {}).get("names")
    if isinstance(names, dict):  # LeRobot sometimes nests {"motors": [...]}
        names = next(iter(names.values()), None)
    return [str(n) for n in names] if isinstance(names, list) else None


def build_cache(ds: LeRobotDataset, camera: str, directory: Path, *, progress: bool = True) -> None:
    """Decode every episode of ``ds`` (``camera`` only) into ``directory`` (written atomically)."""
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lengths = [ds.episode_length(i) for i in range(len(ds))]
    total = sum(lengths)
    frames = actions = states = None
    tasks, offset = [], 0
    for i in tqdm(range(len(ds)), desc=f"decoding {ds.root.name} ({camera})", unit="episode", disable=not progress):
        ep = ds.episode(i)
        images = ep.images[camera]
        if frames is None:
            frames = np.lib.format.open_memmap(
                tmp / "frames.npy", mode="w+", dtype=np.uint8, shape=(total, *images.shape[1:])
            )
            actions = np.zeros((total, ep.action.shape[1]), dtype=np.float32)
            states = None if ep.state is None else np.zeros((total, ep.state.shape[1]), dtype=np.float32)
        if images.shape[1:] != frames.shape[1:]:
            raise ValueError(
                f"episode {i}: camera {camera!r} frames are {images.shape[1:]}, episode 0's are {frames.shape[1:]}"
            )
        n = len(ep)
        if n != lengths[i]:
            raise ValueError(f"episode {i}: the episode index says {lengths[i]} frames, its data has {n}")
        frames[offset : offset + n] = images
        actions[offset : offset + n] = ep.action
        if states is not None:
            states[offset : offset + n] = ep.state
        tasks += ep.tasks_per_frame()
        offset += n
    frames.flush()
    del frames
    np.save(tmp / "actions.npy", actions)
    if states is not None:
        np.save(tmp / "states.npy", states)
    meta = {
        "format": FORMAT,
        "dataset": str(ds.root.resolve()),
        "camera": camera,
        "lengths": lengths,
        "tasks": tasks,
        "action_names": _names(ds.features.get(lerobot.ACTION_KEY)),
        "state_names": _names(ds.features.get(lerobot.STATE_KEY)),
    }
    (tmp / "episodes.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def load_cache(directory: Path) -> DecodedDataset:
    meta = json.loads((directory / "episodes.json").read_text())
    states = directory / "states.npy"
    return DecodedDataset(
        frames=np.load(directory / "frames.npy", mmap_mode="r"),
        actions=np.load(directory / "actions.npy"),
        states=np.load(states) if states.is_file() else None,
        lengths=[int(n) for n in meta["lengths"]],
        tasks=list(meta["tasks"]),
        action_names=meta["action_names"],
        state_names=meta["state_names"],
    )


def cached_dataset(
    ds: LeRobotDataset, camera: str, cache_dir: Path, *, build: bool, progress: bool = True
) -> DecodedDataset:
    """The decoded dataset from ``cache_dir``; ``build=True`` decodes it first if absent (rank 0 only;
    the others call with ``build=False`` after a barrier)."""
    directory = Path(cache_dir) / f"{ds.root.name}-{camera}-{cache_key(ds.root, camera)}"
    if not (directory / "episodes.json").is_file():
        if not build:
            raise FileNotFoundError(f"frame cache {directory} is missing (rank 0 builds it before the others read it)")
        log.info("decoding %d episodes of %s once into %s", len(ds), ds.root, directory)
        build_cache(ds, camera, directory, progress=progress)
    held = json.loads((directory / "episodes.json").read_text()).get("camera", camera)
    if held != camera:  # a cache filed under another camera's name (by hand, or an old unpack)
        raise ValueError(f"frame cache {directory} holds camera {held!r} frames, not {camera!r}; delete it to decode again")
    return load_cache(directory)
