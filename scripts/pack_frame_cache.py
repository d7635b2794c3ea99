"""Pack a collected dataset for a GPU machine that cannot take the dataset itself: its ``meta/`` and its decoded
frame cache (``vla-runtime finetune``'s, built here if absent), xz-compressed. 600 memory episodes at 84 px: 377 MB
of dataset, 1.1 GB of decoded frames, 22 MB packed (the frames of one scene differ little).

    python scripts/pack_frame_cache.py runs/memory/data .device/data15 [--camera corner]

writes ``OUT/meta.tar`` and ``OUT/cache.tar.xz``; ``scripts/gpu_memory_train.sh`` unpacks them on the device and
puts the cache where the training looks for it (the cache's name hashes the dataset's files, which differ there).
"""

import argparse
import subprocess
import tarfile
import tempfile
from pathlib import Path

from vla_finetune.frames import cached_dataset
from vla_runtime.data import LeRobotDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", type=Path, help="the dataset directory `vla-runtime collect` wrote")
    parser.add_argument("out", type=Path, help="directory for meta.tar and cache.tar.xz")
    parser.add_argument("--camera", default="corner", help="the camera the training reads (default corner)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        cached_dataset(LeRobotDataset(args.dataset), args.camera, Path(tmp), build=True)
        (cache,) = Path(tmp).iterdir()
        with tarfile.open(args.out / "meta.tar", "w") as t:
            t.add(args.dataset / "meta", arcname="data/meta")
        with (args.out / "cache.tar.xz").open("wb") as f:  # xz -T0: tarfile's lzma runs on one core
            tar = subprocess.Popen(["tar", "-C", tmp, "-cf", "-", cache.name], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=f, check=True)
            if tar.wait():
                raise SystemExit(f"tar of {cache} failed")
    sizes = {p.name: p.stat().st_size / 2**20 for p in args.out.iterdir()}
    print(f"{args.out}: " + ", ".join(f"{n} {mb:.1f} MiB" for n, mb in sorted(sizes.items())))


if __name__ == "__main__":
    main()
