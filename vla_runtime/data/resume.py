"""What a killed ``LeRobotWriter`` left behind: its finished episodes, and the leftovers to delete.

``info.json`` is the writer's commit point: its ``total_episodes`` episodes are complete. Anything
else — ``*.tmp`` files, the data/video files of the episode in progress, an episode row or a task
past the committed ones — is removed, so the resumed writer starts from exactly the state the
first run had after its last finished episode.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import durable, layout
from .episode import Episode
from .reader import LeRobotDataset

log = logging.getLogger(__name__)

# what LeRobotWriter creates; a directory without info.json may hold only these
WRITER_DIRS = ("data", "videos", "meta")
# info.json keys that must match for the new episodes to belong to the same dataset
MATCHING_KEYS = ("codebase_version", "fps", "robot_type", "features", "data_path", "video_path", "chunks_size")


@dataclass
class FinishedState:
    """The committed episodes of a dataset (read lazily, in order), their ``meta/episodes`` rows and our
    per-episode metadata lists."""

    rows: list[dict] = field(default_factory=list)
    per_episode: dict[str, list] = field(default_factory=dict)
    dataset: LeRobotDataset | None = None

    @property
    def episodes(self) -> Iterator[Episode]:
        if self.dataset is not None:
            yield from self.dataset


def finished_state(root: Path, expected_info: dict, has_video: bool, extra_info: dict) -> FinishedState:
    """Clean ``root`` down to its committed episodes and return them.

    ``expected_info``: the ``info.json`` the resuming writer would write for an empty dataset; the
    dataset's must agree on ``MATCHING_KEYS`` (same features, fps, codec), else ``ValueError``. ``extra_info``:
    the resuming writer's own metadata (``WriterConfig.extra_info``), which must equal the dataset's (it
    describes every episode: e.g. how the episodes were collected), else ``ValueError``.
    """
    info_path = root / layout.INFO_PATH
    if not info_path.is_file():
        _remove_unfinished(root)
        return FinishedState()
    info = json.loads(info_path.read_text())
    for key in MATCHING_KEYS:
        if info.get(key) != expected_info.get(key):
            raise ValueError(
                f"cannot resume {root}: its info.json {key!r} is {info.get(key)!r}, this run would write "
                f"{expected_info.get(key)!r} (resume with the flags the dataset was started with)"
            )
    removed = durable.remove_temporaries(root)
    n = int(info["total_episodes"])
    rows = _committed_rows(root, n)
    removed += _remove_unreferenced(root, rows, has_video)
    if removed:
        log.info("removed %d files of the unfinished episode: %s", len(removed), ", ".join(str(p.relative_to(root)) for p in removed))
    dataset = LeRobotDataset(root)
    stored = {k: v for k, v in dataset.extra.items() if k != layout.PER_EPISODE_KEY}
    wanted = json.loads(json.dumps(extra_info))  # as it would read back
    if stored != wanted:
        differ = sorted(k for k in stored.keys() | wanted.keys() if stored.get(k) != wanted.get(k))
        raise ValueError(
            f"cannot resume {root}: its {layout.EXTRA_PATH} records "
            + ", ".join(f"{k}={stored.get(k)!r}" for k in differ)
            + ", this run would record "
            + ", ".join(f"{k}={wanted.get(k)!r}" for k in differ)
            + " (resume with the flags the dataset was started with)"
        )
    per_episode = dataset.extra.get(layout.PER_EPISODE_KEY, {})
    short = {k: len(v) for k, v in per_episode.items() if len(v) != n}
    if short:
        raise ValueError(f"cannot resume {root}: per-episode metadata {short} does not cover its {n} episodes")
    return FinishedState(rows=rows, per_episode=per_episode, dataset=dataset)


def _remove_unfinished(root: Path) -> None:
    """A dataset killed before its first episode was committed: only the writer's own folders may be there."""
    others = sorted(p.name for p in root.iterdir() if p.name not in WRITER_DIRS)
    if others:
        raise ValueError(
            f"cannot resume {root}: it has no {layout.INFO_PATH} and holds {', '.join(others)}, which the dataset writer "
            "did not create; choose a new --out directory"
        )
    for name in WRITER_DIRS:
        shutil.rmtree(root / name, ignore_errors=True)


def _committed_rows(root: Path, n: int) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for path in sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet")):
        rows += [r for r in pq.read_table(path).to_pylist() if r["episode_index"] < n]
    rows.sort(key=lambda r: r["episode_index"])
    if [r["episode_index"] for r in rows] != list(range(n)):
        raise ValueError(f"cannot resume {root}: meta/episodes does not hold episodes 0..{n - 1} that info.json counts")
    return rows


def _remove_unreferenced(root: Path, rows: list[dict], has_video: bool) -> list[Path]:
    keep = {root / layout.DATA_PATH.format(chunk_index=r["data/chunk_index"], file_index=r["data/file_index"]) for r in rows}
    files = sorted((root / "data").glob("chunk-*/file-*.parquet"))
    if has_video:
        for r in rows:
            for key in (k[len("videos/"):-len("/chunk_index")] for k in r if k.startswith("videos/") and k.endswith("/chunk_index")):
                keep.add(root / layout.VIDEO_PATH.format(video_key=key, chunk_index=r[f"videos/{key}/chunk_index"],
                                                         file_index=r[f"videos/{key}/file_index"]))
        files += sorted((root / "videos").glob("*/chunk-*/file-*.mp4"))
    removed = [p for p in files if p not in keep]
    for path in removed:
        path.unlink()
    return removed
