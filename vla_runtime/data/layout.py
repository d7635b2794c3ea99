"""LeRobot dataset layout: paths, feature keys and the default per-frame columns (v3.0 and v2.1).

Mirrors the rules of LeRobot's ``lerobot.datasets.utils`` (codebase v3.0): many episodes per data
parquet and per mp4, files rolled over by size, ``chunk-XXX/file-YYY`` names, episode rows with
global frame ranges and per-video time ranges.
"""

from __future__ import annotations

CODEBASE_VERSION = "v3.0"
LEGACY_VERSIONS = ("v2.0", "v2.1")

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
EXTRA_PATH = "meta/vla_runtime.json"  # our own metadata: a file of its own, which LeRobot neither reads nor rewrites
PER_EPISODE_KEY = "per_episode"  # in EXTRA_PATH: name -> one value per episode
TASKS_PATH = "meta/tasks.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"

# v2.x: one parquet (and one mp4 per camera) per episode; jsonl metadata
LEGACY_EPISODES_PATH = "meta/episodes.jsonl"
LEGACY_TASKS_PATH = "meta/tasks.jsonl"

CHUNKS_SIZE = 1000  # files per chunk directory
DATA_FILES_SIZE_IN_MB = 100
VIDEO_FILES_SIZE_IN_MB = 200

STATE_KEY = "observation.state"
ACTION_KEY = "action"
IMAGES_PREFIX = "observation.images."

DEFAULT_FEATURES = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def image_key(camera: str) -> str:
    """Feature key of a camera (``corner2`` -> ``observation.images.corner2``)."""
    return IMAGES_PREFIX + camera


def camera_name(key: str) -> str:
    """Camera name of an image feature key (``observation.images.corner2`` -> ``corner2``,
    ``observation.image`` -> ``image``)."""
    if key.startswith(IMAGES_PREFIX):
        return key[len(IMAGES_PREFIX):]
    return key.removeprefix("observation.")


def next_chunk_file(chunk_index: int, file_index: int) -> tuple[int, int]:
    """The file after (chunk, file): ``CHUNKS_SIZE`` files per chunk directory."""
    if file_index == CHUNKS_SIZE - 1:
        return chunk_index + 1, 0
    return chunk_index, file_index + 1
