"""``--time-budget``: the run's length fitted to a wall-clock budget from the rate of its first steps."""

import json

import pytest
import yaml

from vla_finetune import outputs
from vla_finetune.schedule import TimeBudget
from vla_finetune.trainer import Trainer

from .conftest import make_config


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_steps_are_fitted_from_the_measured_rate_and_refitted_when_it_moves():
    clock = Clock()
    budget = TimeBudget(1.0, skip=2, measure=10, margin=1.0, refit_every=20, clock=clock)  # 60 s
    fitted = []
    for done in range(1, 60):
        clock.now += 3.0 if done == 1 else 0.5  # a slow first step (start-up), then 2 steps/s
        fitted.append(budget.after_step(done, max_steps=10_000))
    # timed from step 2 to step 12: 10 steps in 5 s; 8.5 s gone, 51.5 s left -> 103 more steps. The refits at
    # steps 32 and 52 see the same rate, so the same end
    assert fitted[:11] == [None] * 11 and fitted[11] == 12 + 103
    assert {i + 1: f for i, f in enumerate(fitted) if f is not None} == {12: 115, 32: 115, 52: 115}
    slowed = TimeBudget(1.0, skip=2, measure=10, margin=1.0, refit_every=20, clock=(c := Clock()))
    ends = []
    for done in range(1, 33):
        c.now += 0.5 if done <= 12 else 1.5  # other jobs start after the first fit: 3x slower
        ends.append(slowed.after_step(done, max_steps=10_000))
    # at step 32: 30 steps in 6.5 + 30 = 35 s (mean 0.857 steps/s), 36 s gone -> 24 s left: 20 more steps
    assert ends[11] == 12 + 2 * 54 and ends[31] == 32 + 20
    capped = TimeBudget(1.0, clock=Clock())
    assert [capped.after_step(d, max_steps=20) for d in range(1, 13)][-1] == 20  # max_steps stays an upper bound
    late = TimeBudget(0.001, skip=1, measure=1, clock=(c := Clock()))
    c.now = 5.0
    assert late.after_step(6, max_steps=100) is None
    c.now = 6.0
    assert late.after_step(7, max_steps=100) == 7  # the budget is spent already: stop here
    with pytest.raises(ValueError, match="the time budget must be > 0 minutes, got 0"):
        TimeBudget(0)


class Ticking(Clock):
    """Every reading is 0.1 s after the last: the budget sees a machine of exactly 10 steps per second."""

    def __call__(self) -> float:
        self.now += 0.1
        return self.now


def test_a_budgeted_run_ends_where_the_budget_says_and_records_it(tiny_ckpt, tiny_dataset, tmp_path, monkeypatch):
    import vla_finetune.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "TimeBudget", lambda minutes: TimeBudget(minutes, clock=Ticking()))
    out = tmp_path / "budget"
    run = {"max_steps": 500, "log_every": 1, "lr_schedule": "cosine", "lora": {"rank": 4}, "time_budget": 0.03}
    Trainer(make_config(tiny_ckpt, tiny_dataset, out, **run)).train()
    recorded = yaml.safe_load((out / outputs.RUN_CONFIG).read_text())["max_steps"]
    log = [json.loads(line) for line in (out / outputs.LOG).read_text().splitlines()]
    # 1.8 s: timed from step 2 (0.3 s) to 12 (1.3 s), 10 steps/s; 0.6 s left -> 5 more steps (margin 0.97)
    assert recorded == 17 and log[-1]["step"] == 17 and len(log) == 17
    assert log[-1]["lr"] < 0.05 * max(r["lr"] for r in log)  # the cosine schedule ended at the fitted step
    assert json.loads((out / "checkpoints" / "last" / "state.json").read_text())["step"] == 17


class SlowStart(Clock):
    """0.5 s per reading for the first 13 readings (start-up: allocator, autotuning, other jobs starting),
    then 0.05 s: the first fit sees 2 steps/s, the refits ever more."""

    def __init__(self) -> None:
        super().__init__()
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.now += 0.5 if self.readings <= 13 else 0.05
        return self.now


def test_a_refit_lengthens_a_run_whose_first_steps_were_slow(tiny_ckpt, tiny_dataset, tmp_path, monkeypatch):
    """The first fit (step 12: 2 steps/s, 24 s left) ends the run at step 58; the refit at step 32 measures 5
    steps/s and moves the end to the configured ``max_steps`` (60), not to the first fit's 58."""
    import vla_finetune.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "TimeBudget", lambda minutes: TimeBudget(minutes, clock=SlowStart()))
    out = tmp_path / "slow-start"
    run = {"max_steps": 60, "log_every": 30, "lora": {"rank": 4}, "time_budget": 0.5}
    Trainer(make_config(tiny_ckpt, tiny_dataset, out, **run)).train()
    assert yaml.safe_load((out / outputs.RUN_CONFIG).read_text())["max_steps"] == 60
    assert json.loads((out / "checkpoints" / "last" / "state.json").read_text())["step"] == 60
