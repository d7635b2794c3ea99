"""Runs under LeRobot 0.6.1's own interpreter (``LEROBOT_PYTHON``), driven by ``test_lerobot_interop.py``.

    $LEROBOT_PYTHON tests/data/lerobot_interop.py OUT DATASET... [--read-only DATASET...]

For each of our DATASETs (named by their directory): LeRobot's ``LeRobotDataset`` reads every frame
(saved to ``OUT/<name>-read.npz`` with the per-frame tasks in ``OUT/<name>-tasks.json``),
``delete_episodes`` removes episode 1 (``OUT/<name>-deleted``), ``merge_datasets`` merges the result
with the original (``OUT/<name>-merged``, episodes packed into shared files) and ``delete_episodes`` removes
episodes 1 and 3 of that (``OUT/<name>-merged-deleted``: re-encodes parts of shared video files). Then LeRobot writes a dataset of its own
(``OUT/lerobot-written``, AV1 video, two episodes; the frames it was given in ``OUT/lerobot-written.npz``).
``--read-only`` datasets (a dataset a kill interrupted) are only read.
Frames are 64x64: the SVT-AV1 inside LeRobot's PyAV wheel dies with SIGFPE encoding 16x16 frames.
No pickles: numpy ``.npz`` of plain arrays and JSON.
"""

import argparse
import json
from pathlib import Path

import numpy as np
from lerobot.datasets.dataset_tools import delete_episodes, merge_datasets
from lerobot.datasets.lerobot_dataset import LeRobotDataset

CAMERA = "observation.images.front"


def read_all(ds: LeRobotDataset) -> tuple[dict, list[str]]:
    actions, images, episode, frame, tasks = [], [], [], [], []
    for i in range(len(ds)):
        item = ds[i]
        actions.append(item["action"].numpy())
        images.append((item[CAMERA].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        episode.append(int(item["episode_index"]))
        frame.append(int(item["frame_index"]))
        tasks.append(item["task"])
    return {"action": np.stack(actions), "images": np.stack(images), "episode_index": np.array(episode),
            "frame_index": np.array(frame)}, tasks


def write_lerobot_dataset(root: Path) -> dict:
    rng = np.random.default_rng(7)
    features = {
        CAMERA: {"dtype": "video", "shape": (64, 64, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": ["s0", "s1"]},
        "action": {"dtype": "float32", "shape": (3,), "names": ["a0", "a1", "a2"]},
    }
    ds = LeRobotDataset.create("local/lerobot-written", fps=10, features=features, root=root, robot_type="sawyer")
    given = {"action": [], "state": [], "images": [], "lengths": [3, 4]}
    for n, task in zip(given["lengths"], ["pick the cube", "place the cube"]):
        for _ in range(n):
            frame = {CAMERA: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
                     "observation.state": rng.normal(size=2).astype(np.float32),
                     "action": rng.normal(size=3).astype(np.float32), "task": task}
            given["action"].append(frame["action"])
            given["state"].append(frame["observation.state"])
            given["images"].append(frame[CAMERA])
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()
    return {k: np.asarray(v) for k, v in given.items()}


def read(root: Path, out: Path) -> LeRobotDataset:
    ds = LeRobotDataset(f"local/{root.name}", root=root)
    arrays, tasks = read_all(ds)
    np.savez(out / f"{root.name}-read.npz", **arrays)
    (out / f"{root.name}-tasks.json").write_text(json.dumps(tasks))
    return ds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("datasets", type=Path, nargs="+")
    parser.add_argument("--read-only", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for root in args.read_only:
        read(root, out)
    for root in args.datasets:
        name = root.name
        ds = read(root, out)
        deleted = delete_episodes(ds, episode_indices=[1], output_dir=out / f"{name}-deleted", repo_id=f"local/{name}-deleted")
        merged = merge_datasets([deleted, ds], output_repo_id=f"local/{name}-merged", output_dir=out / f"{name}-merged")
        # merging packs the episodes into shared files; deleting from those re-encodes the kept parts of a file with
        # the encoder settings info.json records
        delete_episodes(merged, episode_indices=[1, 3], output_dir=out / f"{name}-merged-deleted", repo_id=f"local/{name}-md")
    np.savez(out / "lerobot-written.npz", **write_lerobot_dataset(out / "lerobot-written"))
    print("lerobot interop: done", flush=True)


if __name__ == "__main__":
    main()
