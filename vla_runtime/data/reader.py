"""Read LeRobot datasets (codebase v3.0 and v2.x) back as numpy episodes.

    ds = LeRobotDataset("runs/mw")            # a local dataset directory
    ds.fps, ds.features, ds.tasks, ds.stats   # metadata (stats: {feature: {stat: ndarray}})
    ds.extra                                  # our own metadata (meta/vla_runtime.json; {} for other datasets)
    ep = ds.episode(0)                        # Episode(images={camera: [T,H,W,3] uint8}, state, action, task, frame_tasks)
    for ep in ds: ...

Images come from PNG/JPEG structs in the parquet (``image`` dtype) or from the mp4s (``video``
dtype; v3.0: the episode's [from_timestamp, to_timestamp) range of a shared file; v2.x: one file per
episode). Camera names are the feature keys without ``observation.images.`` (or ``observation.``).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np

from . import layout
from .episode import Episode
from .stats import from_json
from .video import read_frames

log = logging.getLogger(__name__)


def _decode_image(value: dict) -> np.ndarray:
    from PIL import Image

    if value is None or value.get("bytes") is None:
        raise ValueError("image cell without embedded bytes (image paths outside the parquet are not supported)")
    return np.asarray(Image.open(io.BytesIO(value["bytes"])).convert("RGB"))


class LeRobotDataset:
    """A local LeRobot dataset directory, read lazily episode by episode."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        info_path = self.root / layout.INFO_PATH
        if not info_path.is_file():
            raise FileNotFoundError(f"{info_path} does not exist: {self.root} is not a (finished) LeRobot dataset")
        self.info = json.loads(info_path.read_text())
        self.version = self.info.get("codebase_version")
        if self.version != layout.CODEBASE_VERSION and self.version not in layout.LEGACY_VERSIONS:
            raise ValueError(
                f"{info_path}: codebase_version {self.version!r} is not supported; "
                f"expected {layout.CODEBASE_VERSION} or one of {', '.join(layout.LEGACY_VERSIONS)}"
            )
        for key in ("fps", "features", "total_episodes", "data_path"):
            if key not in self.info:
                raise ValueError(f"{info_path} has no {key!r}")
        self.fps = int(self.info["fps"])
        self.features: dict = self.info["features"]
        self.camera_keys = [k for k, ft in self.features.items() if ft["dtype"] in ("image", "video")]
        self._episodes, self.tasks = self._load_index()
        self.extra = self._load_extra()
        self.stats = self._load_stats()
        self._data_cache: tuple[Path, object] | None = None

    # -- metadata ---------------------------------------------------------------------------------
    def _load_index(self) -> tuple[list[dict], list[str]]:
        import pandas as pd

        if self.version == layout.CODEBASE_VERSION:
            tasks_df = pd.read_parquet(self.root / layout.TASKS_PATH)
            tasks = [str(t) for t in tasks_df.sort_values("task_index").index]
            paths = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
            if not paths:
                raise FileNotFoundError(f"{self.root}/meta/episodes has no parquet files")
            rows = pd.concat([pd.read_parquet(p) for p in paths]).sort_values("episode_index")
            # info.json is a writer's commit point: a row past total_episodes is an episode a kill interrupted
            rows = rows[rows["episode_index"] < int(self.info["total_episodes"])]
            keep = [c for c in rows.columns if not c.startswith("stats/")]
            episodes = rows[keep].to_dict("records")
        else:
            tasks_rows = [json.loads(line) for line in (self.root / layout.LEGACY_TASKS_PATH).read_text().splitlines() if line.strip()]
            tasks = [r["task"] for r in sorted(tasks_rows, key=lambda r: r["task_index"])]
            episodes = [json.loads(line) for line in (self.root / layout.LEGACY_EPISODES_PATH).read_text().splitlines() if line.strip()]
            episodes.sort(key=lambda r: r["episode_index"])
        if len(episodes) != self.info["total_episodes"]:
            raise ValueError(f"{self.root}: info.json says {self.info['total_episodes']} episodes, the episode index has {len(episodes)}")
        return episodes, tasks

    def _load_stats(self) -> dict | None:
        """``meta/stats.json``; ``None`` (with a warning) when it is absent or counts other frames than ``info.json``
        (a writer killed between the two files: resuming the collection rewrites it)."""
        path = self.root / layout.STATS_PATH
        if not path.is_file():
            return None
        stats = from_json(json.loads(path.read_text()))
        total = self.info.get("total_frames")
        counts = {int(np.asarray(s["count"]).ravel()[0]) for k, s in stats.items()
                  if "count" in s and self.features.get(k, {}).get("dtype") not in ("image", "video")}  # fmt: skip
        if total is not None and counts and counts != {int(total)}:
            log.warning("%s counts %s frames, info.json %d: statistics of unfinished episodes; ignored (resume the "
                        "collection to rewrite them)", path, sorted(counts), total)  # fmt: skip
            return None
        return stats

    def _load_extra(self) -> dict:
        """Our own metadata (datasets we wrote); per-episode lists cut back to the committed episodes."""
        path = self.root / layout.EXTRA_PATH
        if not path.is_file():
            return {}
        extra = json.loads(path.read_text())
        n = len(self._episodes)
        extra[layout.PER_EPISODE_KEY] = {k: v[:n] for k, v in extra.get(layout.PER_EPISODE_KEY, {}).items()}
        return extra

    def __len__(self) -> int:
        return len(self._episodes)

    @property
    def cameras(self) -> list[str]:
        return [layout.camera_name(k) for k in self.camera_keys]

    def episode_length(self, index: int) -> int:
        return int(self._episodes[index]["length"])

    # -- episodes ---------------------------------------------------------------------------------
    def episode(self, index: int) -> Episode:
        """Episode ``index`` as numpy arrays (frames sorted by frame_index)."""
        if not 0 <= index < len(self._episodes):
            raise IndexError(f"episode {index} out of range; the dataset has {len(self._episodes)}")
        row = self._episodes[index]
        table = self._episode_table(row)
        if len(table) != int(row["length"]):
            raise ValueError(f"episode {index}: index says {row['length']} frames, data has {len(table)}")
        order = np.argsort(np.asarray(table.column("frame_index").to_numpy()))
        table = table.take(order)
        images = {}
        for key in self.camera_keys:
            if self.features[key]["dtype"] == "image":
                images[layout.camera_name(key)] = np.stack([_decode_image(v) for v in table.column(key).to_pylist()])
            else:
                images[layout.camera_name(key)] = self._video_frames(row, key, len(table))
        state = self._vector(table, layout.STATE_KEY) if layout.STATE_KEY in self.features else None
        frame_tasks = [self.tasks[i] for i in table.column("task_index").to_pylist()]  # each frame its own task_index's
        uniform = len(set(frame_tasks)) == 1
        return Episode(images=images, state=state, action=self._vector(table, layout.ACTION_KEY), task=frame_tasks[0],
                       frame_tasks=None if uniform else frame_tasks)

    def __iter__(self):
        for i in range(len(self)):
            yield self.episode(i)

    @staticmethod
    def _vector(table, key: str) -> np.ndarray:
        """[T, D] float32 of a list column; LeRobot stores a feature of shape (1,) as a plain number column."""
        import pyarrow as pa

        column = table.column(key).combine_chunks()
        kind = column.type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(len(table), 1)
        if not (pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind)):
            raise ValueError(f"feature {key!r} is stored as {kind}; expected a list of numbers per frame (or one number)")
        width = kind.list_size if pa.types.is_fixed_size_list(kind) else (len(column[0]) if len(column) else 0)
        return np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.float32).reshape(len(table), width)

    def _episode_table(self, row: dict):
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        ep = int(row["episode_index"])
        if self.version == layout.CODEBASE_VERSION:
            path = self.root / self.info["data_path"].format(chunk_index=int(row["data/chunk_index"]), file_index=int(row["data/file_index"]))
        else:
            chunk = ep // int(self.info.get("chunks_size", layout.CHUNKS_SIZE))
            path = self.root / self.info["data_path"].format(episode_chunk=chunk, episode_index=ep)
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} for episode {ep} does not exist")
        if self._data_cache is None or self._data_cache[0] != path:
            try:
                self._data_cache = (path, pq.read_table(path))
            except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
                raise ValueError(f"data file {path} of episode {ep} is not a readable parquet file: {e}") from e
        table = self._data_cache[1]
        return table.filter(pc.equal(table.column("episode_index"), ep))

    def _video_frames(self, row: dict, key: str, n: int) -> np.ndarray:
        ep = int(row["episode_index"])
        if self.version == layout.CODEBASE_VERSION:
            chunk, file = int(row[f"videos/{key}/chunk_index"]), int(row[f"videos/{key}/file_index"])
            path = self.root / self.info["video_path"].format(video_key=key, chunk_index=chunk, file_index=file)
            start = float(row[f"videos/{key}/from_timestamp"])
        else:
            chunk = ep // int(self.info.get("chunks_size", layout.CHUNKS_SIZE))
            path = self.root / self.info["video_path"].format(episode_chunk=chunk, video_key=key, episode_index=ep)
            start = 0.0
        return read_frames(path, start, n, self.fps)
