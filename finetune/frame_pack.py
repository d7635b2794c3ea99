"""Carry a dataset's decoded frames to a machine that cannot take the dataset itself (a GPU lease's transfer limit).

A collected memory dataset is mostly PNG bytes (600 episodes at 84 px: 377 MB); its decoded frame cache
(``frames.py``; 1.1 GB of uint8) compresses to 22 MB with xz, since the frames of one scene differ little. Training
needs only the dataset's ``meta/`` and that cache, found by a name that hashes the dataset's files, which differ
once unpacked elsewhere; ``unpack`` puts the cache under the name the unpacked dataset hashes to.

    python -m vla_finetune.frame_pack pack runs/memory/data .device/data   # here: meta.tar, cache.tar.xz
    python -m vla_finetune.frame_pack unpack .device/data /tmp/work        # there: work/data, work/frame-cache

Then ``vla-runtime finetune --dataset /tmp/work/data --cache-dir /tmp/work/frame-cache ...`` reads the frames
without the dataset's data files.
"""

from __future__ import annotations

import argparse
import shutil
import tarfile
import tempfile
from pathlib import Path

from vla_runtime.data import LeRobotDataset

from .frames import cache_key, cached_dataset

META, CACHE = "meta.tar", "cache.tar.xz"


def pack(dataset: Path, out: Path, *, camera: str = "corner", preset: int = 6) -> list[Path]:
    """Write ``out/meta.tar`` (``dataset/meta`` as ``data/meta``) and ``out/cache.tar.xz`` (the decoded frames of
    ``camera``, decoded here first); returns the two paths."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        cached_dataset(LeRobotDataset(dataset), camera, Path(tmp), build=True)
        (cache,) = Path(tmp).iterdir()
        with tarfile.open(out / META, "w") as t:
            t.add(dataset / "meta", arcname="data/meta")
        with tarfile.open(out / CACHE, "w:xz", preset=preset) as t:
            t.add(cache, arcname="frames")
    return [out / META, out / CACHE]


def unpack(packed: Path, work: Path, *, camera: str = "corner") -> tuple[Path, Path]:
    """``pack``'s files -> (``work/data``, ``work/frame-cache``): the dataset's meta and the cache under the name
    ``vla-runtime finetune --dataset work/data --cache-dir work/frame-cache`` looks for. Idempotent."""
    data, caches = work / "data", work / "frame-cache"
    info = data / "meta" / "info.json"
    with tarfile.open(packed / META) as t:
        if not info.is_file():
            t.extractall(work, filter="data")
        elif t.extractfile(str(info.relative_to(work))).read() != info.read_bytes():
            raise ValueError(f"{work} already holds another dataset ({info} differs from {packed / META}'s); "
                             "unpack into a new work directory")  # fmt: skip
    target = caches / f"{data.name}-{camera}-{cache_key(data, camera)}"
    if not (target / "episodes.json").is_file():
        staging = work / "frames.unpacking"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(packed / CACHE) as t:
            t.extractall(staging, filter="data")
        caches.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        (staging / "frames").rename(target)
        staging.rmdir()
    return data, caches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="dataset -> OUT/meta.tar + OUT/cache.tar.xz")
    p.add_argument("dataset", type=Path, help="the dataset directory `vla-runtime collect` wrote")
    p.add_argument("out", type=Path)
    u = sub.add_parser("unpack", help="PACKED (what pack wrote) -> WORK/data + WORK/frame-cache")
    u.add_argument("packed", type=Path)
    u.add_argument("work", type=Path)
    for s in (p, u):
        s.add_argument("--camera", default="corner", help="the camera the training reads (default corner)")
    args = parser.parse_args(argv)
    if args.command == "pack":
        for path in pack(args.dataset, args.out, camera=args.camera):
            print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
    else:
        data, caches = unpack(args.packed, args.work, camera=args.camera)
        print(f"--dataset {data} --cache-dir {caches}")


if __name__ == "__main__":
    main()
