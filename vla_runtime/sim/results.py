"""Durable per-episode results of an evaluation: one JSON line per finished episode.

Each line is ``{"job": i, **EpisodeResult}`` (``job``: the episode's place in the run's task-major
job list), written, flushed and fsync-ed as the episode ends, so a kill loses at most the episodes
in progress. A line cut short by a kill is dropped (and trimmed from the file) when the file is
read back. The report is rebuilt from this file alone (``load_results``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, fields
from pathlib import Path

from ..data.durable import fsync_dir
from .evaluate import EpisodeResult

log = logging.getLogger(__name__)

RESULTS_FILE = "episodes.jsonl"


def append_result(path: Path, job: int, result: EpisodeResult) -> None:
    """Append one finished episode durably."""
    record = asdict(result)
    record.pop("retention", None)  # the trace goes into its picture, not the result line
    line = json.dumps({"job": job, **record}) + "\n"
    new = not path.exists()
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    if new:  # the file's own directory entry
        fsync_dir(path.parent)
    log.info("episode %d result durable: %s seed %d %s", job, result.task, result.seed, "success" if result.success else "failure")


def read_results(path: Path) -> dict[int, EpisodeResult]:
    """job -> result for every complete line of ``path``; a torn last line is trimmed off the file."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        log.info("%s: dropping the unfinished last line (%d bytes) a kill left", path, len(data) - len(complete))
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    names = {f.name for f in fields(EpisodeResult)}
    out = {}
    for number, line in enumerate(complete.decode().splitlines(), 1):
        try:
            record = json.loads(line)
            job = int(record.pop("job"))
            out[job] = EpisodeResult(**{k: v for k, v in record.items() if k in names})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} line {number} is not an episode result ({e}); expected one JSON object per line") from e
    return out


def load_results(path: Path) -> list[EpisodeResult]:
    """Every result in ``path`` in job order (task-major, then seed): what the report is built from."""
    return [r for _, r in sorted(read_results(path).items())]
