"""Durable per-episode results of an evaluation: one JSON line per finished episode.

Each line is ``{"job": i, **EpisodeResult}`` (``job``: the episode's place in the run's task-major
job list), written, flushed and fsync-ed as the episode ends, so a kill loses at most the episodes
in progress. A line cut short by a kill is dropped (and trimmed from the file) when the file is
read back. The report is rebuilt from this file alone (``load_results``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, fields
from pathlib import Path

from ..data.durable import fsync_dir, write_text_atomic
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


RUN_FILE = "run.json"


def checkpoint_fingerprint(checkpoint: Path, *, exclude: Path | None = None, sample_bytes: int = 1 << 16) -> str:
    """A cheap digest of what a checkpoint directory (or file) holds: every file's relative name and size, and
    its first and last ``sample_bytes`` (a retrained or re-quantised checkpoint of the same geometry differs there;
    moving or copying it does not change the digest). Files under ``exclude`` (an output directory placed inside
    the checkpoint) are left out."""
    checkpoint = Path(checkpoint)
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else [checkpoint]
    if exclude is not None:
        skip = Path(exclude).resolve()
        files = [p for p in files if not p.resolve().is_relative_to(skip)]
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.relative_to(checkpoint) if checkpoint.is_dir() else path.name}:{size}\n".encode())
        with open(path, "rb") as f:
            h.update(f.read(sample_bytes))
            if size > 2 * sample_bytes:
                f.seek(-sample_bytes, os.SEEK_END)
                h.update(f.read(sample_bytes))
    return h.hexdigest()[:16]


def check_run(out: Path, identity: dict[str, str], *, resume: bool) -> None:
    """Tie ``out``'s results to the settings that produced them. A new run writes ``identity`` to ``out/run.json``;
    a resume refuses (``ValueError`` naming each setting) to add episodes run with other settings (another
    checkpoint, cache, session, simulator or control loop) to the interrupted run's. A run from before this
    file existed gets one and is not checked."""
    path = out / RUN_FILE
    if resume and path.is_file():
        try:
            recorded = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}); it records the settings of the run in {out}") from e
        changed = sorted(k for k in identity.keys() | recorded.keys() if recorded.get(k) != identity.get(k))
        if changed:
            lines = "; ".join(f"{k}: {recorded.get(k)!r} then, {identity.get(k)!r} now" for k in changed)
            raise ValueError(f"--resume of {out} with other settings than the interrupted run ({lines}); resume with the "
                             "interrupted run's flags, or choose a new --out directory")
        return
    write_text_atomic(path, json.dumps(identity, indent=1, sort_keys=True) + "\n")
