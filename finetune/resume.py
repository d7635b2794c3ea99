"""What a run's output directory must hold before it starts: nothing of another run (a fresh run), or the run
``--resume`` continues, with its checkpoint made whole and its time budget's state read back."""

from __future__ import annotations

import logging
from typing import Callable

from . import outputs
from .config import FinetuneConfig

log = logging.getLogger(__name__)


def prepare_out_dir(cfg: FinetuneConfig, *, world: int, is_main: bool, barrier: Callable[[], None]) -> float | None:
    """Check ``cfg.out`` for ``cfg`` (``ValueError`` / ``FileNotFoundError`` naming what is wrong) and return the
    minutes left of the time budget (``cfg.time_budget`` for a fresh run, ``None`` without one).

    Resuming: the config must equal the run's (but for ``outputs.RESUMABLE_CHANGES``); rank 0 finishes a checkpoint
    save a kill interrupted (``barrier`` then lets the other ranks read it), and it must run on the ``world``
    processes its checkpoint was trained on (their number sets the data order and the batch per optimizer step;
    checkpoints from before ``world`` was recorded are not checked). A run killed before its first checkpoint
    starts again from step 0 (``cfg.resume`` is cleared). A budgeted run goes on with the length it was fitted to
    and what its checkpoint had left of the budget (``cfg.max_steps`` is set)."""
    out = cfg.out
    if not cfg.resume:
        if any((out / name).exists() for name in (outputs.RUN_CONFIG, outputs.LOG, str(outputs.LAST))):
            raise ValueError(f"{out} already holds a fine-tuning run; pass --resume to continue it or choose a new --out")
        return cfg.time_budget
    if not (out / outputs.RUN_CONFIG).is_file():
        raise FileNotFoundError(f"--resume: {out} holds no fine-tuning run ({outputs.RUN_CONFIG} is missing)")
    changes = outputs.config_changes(out, cfg)
    if changes:
        raise ValueError(f"--resume: the config differs from the run in {out}: {'; '.join(changes)}")
    if is_main:
        outputs.recover_training_state(out)
    barrier()
    state = outputs.training_state(out)
    if state is None:  # killed before its first checkpoint: nothing to continue, the same run from the start
        log.warning("--resume: %s has no checkpoint yet; starting the run from step 0", out)
        cfg.resume = False
        return cfg.time_budget
    trained_on = state.get("world")
    if trained_on is not None and trained_on != world:
        raise ValueError(f"--resume: the checkpoint in {out} (step {state['step']}) was trained on {trained_on} "
                         f"process(es), this run has {world}: the data order and the batch of each step would change; "
                         f"resume with torchrun --nproc-per-node {trained_on}, or start a new --out")
    recorded = int(outputs.recorded_config(out)["max_steps"])
    if cfg.time_budget is None:
        if recorded != cfg.max_steps and (cfg.lr_schedule != "constant" or cfg.gate.temperature_final is not None):
            log.warning("--resume: max_steps %d -> %d stretches the lr / gate-temperature schedules from here on",
                        recorded, cfg.max_steps)  # fmt: skip
        return None
    cfg.max_steps = int(state.get("max_steps", recorded))
    left = state.get("budget_left_s")
    if left is not None and left <= 0:
        cfg.max_steps = int(state["step"])  # the budget was spent
    return left / 60 if left is not None and left > 0 else None
