"""Crash-safe file writes: a file appears under its final name complete or not at all.

Every write goes to ``<name>.tmp`` beside the target, is flushed and fsync-ed, then renamed over
the target (``os.replace`` is atomic on POSIX), and the directory is fsync-ed so the rename itself
survives a power cut. A SIGKILL at any moment leaves either the old file or the new one, plus at
most a stray ``*.tmp`` that ``remove_temporaries`` sweeps away.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

TMP_SUFFIX = ".tmp"


def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (same directory, so the rename is atomic)."""
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_dir(directory: Path) -> None:
    """Make renames inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def commit(tmp: Path, path: Path) -> None:
    """fsync ``tmp`` (already written and closed), rename it to ``path``, fsync the directory."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def make_dirs(directory: Path) -> None:
    """``mkdir -p`` whose new directory entries are themselves fsync-ed (a power cut keeps the folders)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for created in reversed(missing):
        created.mkdir(exist_ok=True)
        fsync_dir(created.parent)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp_path)`` produces the file; it then replaces ``path`` atomically and durably."""
    make_dirs(path.parent)
    tmp = temporary_path(path)
    write(tmp)
    commit(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def remove_temporaries(root: Path) -> list[Path]:
    """Delete every ``*.tmp`` under ``root`` (left by a killed writer); returns what was removed."""
    removed = sorted(root.rglob("*" + TMP_SUFFIX))
    for path in removed:
        path.unlink()
    return removed
