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
import json
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


def unpack(packed: Path, work: Path, *, camera: str | None = None) -> tuple[Path, Path]:
    """``pack``'s files -> (``work/data``, ``work/frame-cache``): the dataset's meta and the cache under the name
    ``vla-runtime finetune --dataset work/data --cache-dir work/frame-cache`` looks for. Idempotent; each part is
    extracted beside its place and renamed into it, so a kill leaves it whole or absent. ``camera``: the camera the
    training reads, checked against the one the pack was made from (``None``: that one)."""
    data, caches = work / "data", work / "frame-cache"
    with tarfile.open(packed / META) as t:
        packed_meta = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    if (data / "meta").is_dir():
        held = {str(p.relative_to(work)): p.read_bytes() for p in (data / "meta").rglob("*") if p.is_file()}
        if held != packed_meta:  # info.json alone is equal for two datasets of the same shape
            raise ValueError(f"{work} already holds another dataset ({data / 'meta'} differs from {packed / META}); "
                             "unpack into a new work directory")  # fmt: skip
    else:
        _extract_into_place(packed / META, work / "meta.unpacking", "data/meta", data / "meta")
    with tarfile.open(packed / CACHE) as t:
        packed_camera = json.loads(t.extractfile("frames/episodes.json").read())["camera"]
    if camera is not None and camera != packed_camera:
        raise ValueError(f"{packed / CACHE} holds camera {packed_camera!r} frames, not {camera!r}; pack that camera "
                         f"(pack --camera {camera}) or train on {packed_camera!r}")  # fmt: skip
    target = caches / f"{data.name}-{packed_camera}-{cache_key(data, packed_camera)}"
    if not (target / "episodes.json").is_file():
        shutil.rmtree(target, ignore_errors=True)
        _extract_into_place(packed / CACHE, work / "frames.unpacking", "frames", target)
    return data, caches


def _extract_into_place(tar: Path, staging: Path, member: str, target: Path) -> None:
    """Extract ``tar`` into ``staging`` and rename its ``member`` to ``target``."""
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(tar) as t:
        t.extractall(staging, filter="data")
    target.parent.mkdir(parents=True, exist_ok=True)
    (staging / member).rename(target)
    shutil.rmtree(staging)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="dataset -> OUT/meta.tar + OUT/cache.tar.xz")
    p.add_argument("dataset", type=Path, help="the dataset directory `vla-runtime collect` wrote")
    p.add_argument("out", type=Path)
    u = sub.add_parser("unpack", help="PACKED (what pack wrote) -> WORK/data + WORK/frame-cache")
    u.add_argument("packed", type=Path)
    u.add_argument("work", type=Path)
    p.add_argument("--camera", default="corner", help="the camera the training reads (default corner)")
    u.add_argument("--camera", default=None, help="the camera the training reads, checked against the pack's "
                   "(default: the pack's)")
    args = parser.parse_args(argv)
    if args.command == "pack":
        for path in pack(args.dataset, args.out, camera=args.camera):
            print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
    else:
        data, caches = unpack(args.packed, args.work, camera=args.camera)
        print(f"--dataset {data} --cache-dir {caches}")


if __name__ == "__main__":
    main()
