"""Add ``episode_cue_steps`` (what ``vla-runtime finetune --cue-weight`` regresses) and ``episode_separable_steps``
(what ``--separable-weight`` weighs) to a Meta-World dataset that ``vla-runtime collect`` wrote before it recorded
them: replays each episode's expert from its recorded task and seed (no rendering; the stored states are checked)
and rewrites ``meta/vla_runtime.json``.

    python scripts/record_cue_steps.py runs/memory/data
"""

import argparse
import logging
from pathlib import Path

from vla_runtime.sim.collect import record_cue_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", type=Path, help="the dataset directory collect wrote")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    steps = record_cue_steps(args.dataset)
    print(f"{args.dataset}: cue and separable steps of {len(steps)} episodes recorded ({sum(map(len, steps))} cue steps in all)")


if __name__ == "__main__":
    main()
