"""Write episodes as a LeRobot v3.0 dataset, every finished episode durable before the next starts.

    features = DatasetFeatures(cameras={"corner2": (224, 224)}, state_names=[...], action_names=[...])
    with LeRobotWriter(out_dir, features, WriterConfig(fps=80, robot_type="sawyer")) as writer:
        writer.add_episode(Episode(images={"corner2": frames}, state=s, action=a, task="Open the drawer"))

Layout (LeRobot's rules, codebase v3.0): ``meta/info.json`` (schema, counters, path templates),
``meta/stats.json`` (min/max/mean/std/count/q01/q10/q50/q90/q99 per feature), ``meta/tasks.parquet``
(index = task string, column ``task_index``), ``meta/episodes/chunk-000/file-000.parquet`` (one row
per episode: length, tasks, global frame range, file indices, video time ranges, per-episode stats),
``data/chunk-XXX/file-YYY.parquet`` and, for video storage, ``videos/<key>/chunk-XXX/file-YYY.mp4``.

Durability: each episode gets its own data parquet and its own mp4 per camera (LeRobot v3 allows any
number of files per chunk; ``meta/episodes`` names each episode's file indices). ``add_episode``
writes them, then rewrites ``meta/`` — every file through write-to-temp, fsync and atomic rename
(``durable.py``), ``info.json`` last. ``info.json`` is the commit point: its ``total_episodes``
episodes are complete, whatever else a kill left behind (a stray ``*.tmp``, the files of the
episode in progress, an episode row past ``total_episodes``). ``resume=True`` reopens such a
dataset, removes the leftovers and appends after its last finished episode.

Images are stored as PNG inside the data parquet by default (LeRobot's ``image`` dtype, the
Hugging Face ``Image`` struct ``{bytes, path}``): lossless, so frames read back bit-identically.
``WriterConfig.video_codec`` switches to mp4 (``video`` dtype); see ``video.py`` for which codecs
are lossless.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import durable, layout
from .episode import Episode
from .features import DatasetFeatures
from .schema import arrow_schema, frame_table, info_features
from .stats import ImageStats, to_json, vector_stats
from .video import VideoWriter, get_codec

log = logging.getLogger(__name__)


@dataclass
class WriterConfig:
    """How the dataset is stored.

    Args:
        fps: frames per second (timestamps are ``frame_index / fps``).
        robot_type: free-form robot name for ``info.json``.
        video_codec: ``None`` = PNG images in the parquet (lossless); else a ``VIDEO_CODECS`` name.
        data_files_size_in_mb, video_files_size_in_mb: recorded in ``info.json`` for LeRobot's own
            tools (they roll files over past these sizes when they merge or edit); we write one file per
            episode so that a finished episode is never rewritten.
        extra_info: our own metadata, stored in ``meta/vla_runtime.json`` (LeRobot warns about, then drops, unknown
            ``info.json`` keys; a file of its own it leaves alone).
    """

    fps: int
    robot_type: str | None = None
    video_codec: str | None = None
    data_files_size_in_mb: int = layout.DATA_FILES_SIZE_IN_MB
    video_files_size_in_mb: int = layout.VIDEO_FILES_SIZE_IN_MB
    extra_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if int(self.fps) != self.fps or self.fps < 1:
            raise ValueError(f"`fps` must be a positive integer (LeRobot stores it as int), got {self.fps}")
        if self.video_codec is not None:
            get_codec(self.video_codec)
        for name in ("data_files_size_in_mb", "video_files_size_in_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")


class LeRobotWriter:
    """Appends episodes to a LeRobot v3.0 dataset directory, durably one by one.

    Args:
        root: a new (or empty) directory; with ``resume=True`` also one an earlier writer left.
        resume: continue the dataset in ``root`` after its last finished episode.
    """

    def __init__(self, root: str | Path, features: DatasetFeatures, config: WriterConfig, *, resume: bool = False) -> None:
        self.root = Path(root)
        codec = get_codec(config.video_codec) if config.video_codec else None
        odd = {cam: hw for cam, hw in features.cameras.items() if codec is not None and codec.pix_fmt == "yuv420p" and (hw[0] % 2 or hw[1] % 2)}
        if odd:
            raise ValueError(f"video codec {config.video_codec} stores yuv420p, which needs an even height and width; camera(s) "
                             + ", ".join(f"{cam} are {h}x{w}" for cam, (h, w) in odd.items())
                             + " (use an even resolution, hevc_lossless, or no video codec: PNG frames)")
        started = self.root.exists() and any(self.root.iterdir())
        if started and not resume:
            raise FileExistsError(
                f"dataset directory {self.root} exists and is not empty; pass --resume to continue it, or choose a new --out directory"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self.features = features
        self.config = config
        self._codec = codec
        self._info_features = info_features(features, self._codec, config.fps)
        self._schema = arrow_schema(self._info_features)
        self._tasks: dict[str, int] = {}
        self._episodes: list[dict] = []
        self._per_episode: dict[str, list] = {}
        self._total_frames = 0
        self._numeric: dict[str, list[np.ndarray]] = {}
        self._image_stats = {cam: ImageStats() for cam in features.cameras}
        self._next_file = (0, 0)
        self._closed = False
        if started:
            self._resume()

    # -- writing ----------------------------------------------------------------------------------
    def add_episode(self, episode: Episode, *, per_episode: dict | None = None) -> int:
        """Append one episode and make it durable; returns its episode_index.

        ``per_episode``: values of our own per-episode metadata (e.g. ``{"episode_seeds": 7}``), appended to
        the lists of the same names under ``"per_episode"`` in ``meta/vla_runtime.json``.
        """
        if self._closed:
            raise RuntimeError("the writer is closed")
        self._check(episode)
        per_episode = per_episode or {}
        if self._episodes and set(per_episode) != set(self._per_episode):
            raise ValueError(
                f"per_episode keys {sorted(per_episode)} differ from the ones the dataset's episodes carry "
                f"{sorted(self._per_episode)}: every episode must give the same per-episode metadata"
            )
        ep_index = len(self._episodes)
        log.info("writing episode %d (%d frames)", ep_index, len(episode))
        columns, row, tasks, image_stats = self._register(episode, ep_index)
        chunk, file = self._next_file
        images = {} if self._codec else episode.images
        table = frame_table(self._schema, columns, images)
        data_path = self.root / layout.DATA_PATH.format(chunk_index=chunk, file_index=file)
        durable.write_atomic(data_path, lambda tmp: _write_parquet(table, tmp))
        if self._codec:
            for cam, frames in episode.images.items():
                self._write_video(cam, frames, chunk, file)
        # the episode's files are durable: only now does it count (a failed write above leaves the writer as it was)
        self._accumulate(columns, row, tasks, image_stats)
        self._next_file = layout.next_chunk_file(chunk, file)
        for key, value in per_episode.items():
            self._per_episode.setdefault(key, []).append(value)
        self._write_meta()
        log.info("episode %d durable (%d episodes, %d frames in %s)", ep_index, len(self._episodes), self._total_frames, self.root)
        return ep_index

    def _register(
        self, episode: Episode, ep_index: int
    ) -> tuple[dict[str, np.ndarray], dict, dict[str, int], dict[str, ImageStats]]:
        """The episode's per-frame columns, its ``meta/episodes`` row, the task table with its tasks added and its
        per-camera pixel statistics; changes nothing (``_accumulate`` adds them once the episode is durable)."""
        n = len(episode)
        start = self._total_frames
        frame_tasks = episode.tasks_per_frame()
        tasks = dict(self._tasks)
        task_index = np.array([tasks.setdefault(t, len(tasks)) for t in frame_tasks], dtype=np.int64)
        columns = {
            "timestamp": (np.arange(n) / self.config.fps).astype(np.float32),
            "frame_index": np.arange(n, dtype=np.int64),
            "episode_index": np.full(n, ep_index, dtype=np.int64),
            "index": np.arange(start, start + n, dtype=np.int64),
            "task_index": task_index,
            layout.ACTION_KEY: episode.action.astype(np.float32),
        }
        if episode.state is not None:
            columns[layout.STATE_KEY] = episode.state.astype(np.float32)
        chunk, file = self._next_file
        row = {
            "episode_index": ep_index,
            "tasks": list(dict.fromkeys(frame_tasks)),
            "length": n,
            "data/chunk_index": chunk,
            "data/file_index": file,
            "dataset_from_index": start,
            "dataset_to_index": start + n,
        }
        if self._codec:
            for cam in episode.images:
                key = layout.image_key(cam)
                row.update({f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                            f"videos/{key}/from_timestamp": 0.0, f"videos/{key}/to_timestamp": n / self.config.fps})
        ep_stats, image_stats = {}, {}
        for cam, frames in episode.images.items():
            image_stats[cam] = ImageStats()
            image_stats[cam].update(frames)
            ep_stats[layout.image_key(cam)] = image_stats[cam].stats()
        for key, values in columns.items():
            ep_stats[key] = vector_stats(values)
        ep_stats = {key: ep_stats[key] for key in self._info_features}  # LeRobot's order: the features'
        for key, stats in to_json(ep_stats).items():
            for name, value in stats.items():
                row[f"stats/{key}/{name}"] = value
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})  # LeRobot's column order
        return columns, row, tasks, image_stats

    def _accumulate(self, columns: dict[str, np.ndarray], row: dict, tasks: dict[str, int],
                    image_stats: dict[str, ImageStats]) -> None:  # fmt: skip
        """Count a durable episode (``_register``'s results) into the tasks, the episode rows and the statistics."""
        self._tasks = tasks
        for key, values in columns.items():
            self._numeric.setdefault(key, []).append(values)
        for cam, stats in image_stats.items():
            self._image_stats[cam].add(stats)
        self._episodes.append(row)
        self._total_frames += int(row["length"])

    def _write_video(self, cam: str, frames: np.ndarray, chunk: int, file: int) -> None:
        path = self.root / layout.VIDEO_PATH.format(video_key=layout.image_key(cam), chunk_index=chunk, file_index=file)
        h, w = self.features.cameras[cam]

        def encode(tmp: Path) -> None:
            writer = VideoWriter(tmp, fps=self.config.fps, height=h, width=w, codec=self._codec)
            try:
                writer.write(frames)
            finally:
                writer.close()

        durable.write_atomic(path, encode)

    def _check(self, episode: Episode) -> None:
        episode.validate()
        if set(episode.images) != set(self.features.cameras):
            raise ValueError(f"episode cameras {sorted(episode.images)} differ from the dataset's {sorted(self.features.cameras)}")
        for cam, (h, w) in self.features.cameras.items():
            if episode.images[cam].shape[1:3] != (h, w):
                raise ValueError(f"episode images[{cam!r}] are {episode.images[cam].shape[1:3]}, the dataset's are {(h, w)}")
        if (episode.state is None) != (self.features.state_names is None):
            raise ValueError("episode `state` must be given exactly when the dataset has state_names")
        if episode.state is not None and episode.state.shape[1] != len(self.features.state_names):
            raise ValueError(f"episode state has {episode.state.shape[1]} dims, state_names has {len(self.features.state_names)}")
        if episode.action.shape[1] != len(self.features.action_names):
            raise ValueError(f"episode action has {episode.action.shape[1]} dims, action_names has {len(self.features.action_names)}")

    # -- metadata ---------------------------------------------------------------------------------
    def _write_meta(self) -> None:
        """Rewrite ``meta/`` for the episodes so far; ``info.json`` last (the commit point)."""
        import pandas as pd
        import pyarrow as pa

        tasks = pd.DataFrame({"task_index": list(self._tasks.values())}, index=pd.Index(list(self._tasks), name="task"))
        durable.write_atomic(self.root / layout.TASKS_PATH, lambda tmp: tasks.to_parquet(tmp))
        episodes = pa.Table.from_pylist(self._episodes)
        durable.write_atomic(self.root / layout.EPISODES_PATH.format(chunk_index=0, file_index=0), lambda tmp: _write_parquet(episodes, tmp))
        stats = {key: vector_stats(np.concatenate(parts)) for key, parts in self._numeric.items()}
        stats.update({layout.image_key(cam): s.stats() for cam, s in self._image_stats.items()})
        durable.write_text_atomic(self.root / layout.STATS_PATH, json.dumps(to_json(stats), indent=2))
        durable.write_text_atomic(self.root / layout.EXTRA_PATH, json.dumps(self._extra(), indent=2))
        durable.write_text_atomic(self.root / layout.INFO_PATH, json.dumps(self._info(), indent=4))

    def _info(self) -> dict:
        """``info.json`` with the keys LeRobot 0.6.1 writes, in its order."""
        n = len(self._episodes)
        return {
            "codebase_version": layout.CODEBASE_VERSION,
            "fps": int(self.config.fps),
            "features": self._info_features,
            "total_episodes": n,
            "total_frames": self._total_frames,
            "total_tasks": len(self._tasks),
            "chunks_size": layout.CHUNKS_SIZE,
            "data_files_size_in_mb": self.config.data_files_size_in_mb,
            "video_files_size_in_mb": self.config.video_files_size_in_mb,
            "data_path": layout.DATA_PATH,
            "video_path": layout.VIDEO_PATH if self._codec else None,
            "robot_type": self.config.robot_type,
            "splits": {"train": f"0:{n}"},
        }

    def _extra(self) -> dict:
        return {**self.config.extra_info, layout.PER_EPISODE_KEY: self._per_episode}

    # -- resuming ---------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Take over the finished episodes of the dataset in ``root``; delete everything else a killed writer left."""
        from .resume import finished_state

        state = finished_state(self.root, self._info(), self._codec is not None, self.config.extra_info)
        for ep_index, (episode, row) in enumerate(zip(state.episodes, state.rows)):
            # rebuilds tasks and statistics as the first run did (images: from the stored frames; lossless codecs
            # give the first run's statistics exactly, lossy ones those of the frames as stored)
            columns, _, tasks, image_stats = self._register(episode, ep_index)
            self._accumulate(columns, row, tasks, image_stats)
            self._next_file = layout.next_chunk_file(int(row["data/chunk_index"]), int(row["data/file_index"]))
        stored_tasks = state.dataset.tasks if state.dataset is not None else []
        if list(self._tasks) != stored_tasks[: len(self._tasks)]:  # stored task_index values would name other tasks
            raise ValueError(
                f"cannot resume {self.root}: meta/tasks.parquet numbers its tasks {stored_tasks}, not in the order the "
                f"finished episodes first name them {list(self._tasks)}"
            )
        self._per_episode = state.per_episode
        if self._episodes:  # meta/ may run ahead of info.json (a kill between the two): rewrite it for these episodes
            self._write_meta()
        log.info("resuming %s after %d finished episodes (%d frames)", self.root, len(self._episodes), self._total_frames)

    @property
    def num_episodes(self) -> int:
        return len(self._episodes)

    @property
    def episode_lengths(self) -> list[int]:
        return [int(row["length"]) for row in self._episodes]

    @property
    def per_episode(self) -> dict[str, list]:
        """Our per-episode metadata so far (``add_episode(per_episode=...)``), restored on resume."""
        return {k: list(v) for k, v in self._per_episode.items()}

    def close(self) -> None:
        """Every episode is already durable; a dataset without episodes is an error."""
        if self._closed:
            return
        self._closed = True
        if not self._episodes:
            raise ValueError(f"no episodes were written to {self.root}; the dataset is empty")
        log.info("wrote %d episodes, %d frames to %s", len(self._episodes), self._total_frames, self.root)

    def __enter__(self) -> "LeRobotWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the finished episodes stay durable and resumable
            self._closed = True


def _write_parquet(table, path: Path) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, path, compression="snappy")
