"""A kill at any moment leaves a run ``--resume`` can continue: during a checkpoint save, before the first
checkpoint, inside a time budget; and a resume refuses data other than the run's."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vla_finetune import outputs
from vla_finetune.schedule import TimeBudget
from vla_finetune.trainer import Trainer

from .conftest import make_config, write_dataset


class Killed(Exception):
    pass


def save(out, value: float, step: int) -> None:
    weight = torch.nn.Parameter(torch.full((2,), value))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    outputs.save_training_state(out, params={"w": weight}, optimizer=optimizer, state={"step": step})


def test_a_save_killed_between_its_renames_leaves_the_new_checkpoint_to_resume(tmp_path, monkeypatch):
    save(tmp_path, 1.0, step=2)
    rename = Path.rename

    def killed_at(name):
        def renamed(self, target):
            if self.name == name:
                raise Killed(f"killed renaming {name}")
            return rename(self, target)

        return renamed

    # the new checkpoint complete as last.tmp, the old one moved aside as last.old, no last
    monkeypatch.setattr(Path, "rename", killed_at("last.tmp"))
    with pytest.raises(Killed):
        save(tmp_path, 2.0, step=4)
    monkeypatch.setattr(Path, "rename", rename)
    assert not (tmp_path / outputs.LAST).exists()
    assert outputs.recover_training_state(tmp_path) == {"step": 4}
    state, params, _ = outputs.load_training_state(tmp_path, device=torch.device("cpu"))
    assert state["step"] == 4 and params["w"].tolist() == [2.0, 2.0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last"]

    # killed while writing the next one (no state.json yet): the last complete one stays
    monkeypatch.setattr(outputs.durable, "write_text_atomic", lambda path, text: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        save(tmp_path, 3.0, step=6)
    monkeypatch.undo()
    assert outputs.recover_training_state(tmp_path) == {"step": 4}


def test_resume_before_the_first_checkpoint_runs_the_same_run_from_the_start(tiny_ckpt, tiny_dataset, tmp_path, monkeypatch):
    run = {"max_steps": 4, "lora": {"rank": 4}, "lr": 1e-2}
    Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "straight", **run)).train()
    micro_step = Trainer._micro_step
    calls = []

    def killed_at_the_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Killed("before the first checkpoint")
        return micro_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_micro_step", killed_at_the_third)
    with pytest.raises(Killed):
        Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "killed", **run)).train()
    monkeypatch.undo()
    assert not (tmp_path / "killed" / outputs.LAST).exists() and (tmp_path / "killed" / outputs.RUN_CONFIG).is_file()
    resumed = Trainer(make_config(tiny_ckpt, tiny_dataset, tmp_path / "killed", **run, resume=True))
    assert resumed.start_step == 0
    resumed.train()
    straight = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    again = load_file(str(tmp_path / "killed" / "adapter_model.safetensors"))
    for name in straight:
        torch.testing.assert_close(again[name], straight[name], atol=1e-6, rtol=1e-5)


class Ticking:
    """0.1 s per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.1
        return self.now


def test_a_budgeted_run_killed_before_its_fit_resumes_with_what_was_left_of_the_budget(
    tiny_ckpt, tiny_dataset, tmp_path, monkeypatch
):
    """Uninterrupted, this budget fits 17 steps (test_budget.py). Killed at its step-5 checkpoint, before the first
    fit (step 12), the run resumes with the budget that checkpoint had left, not with the configured 500 steps."""
    import vla_finetune.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "TimeBudget", lambda minutes: TimeBudget(minutes, clock=Ticking()))
    run = {"max_steps": 500, "save_every": 5, "log_every": 1, "lora": {"rank": 4}, "time_budget": 0.03}
    out = tmp_path / "budget"
    save_state = outputs.save_training_state

    def save_then_die(out, **kwargs):
        save_state(out, **kwargs)
        raise Killed(f"killed after step {kwargs['state']['step']}")

    monkeypatch.setattr(outputs, "save_training_state", save_then_die)
    with pytest.raises(Killed, match="after step 5"):
        Trainer(make_config(tiny_ckpt, tiny_dataset, out, **run)).train()
    monkeypatch.setattr(outputs, "save_training_state", save_state)
    state = json.loads((out / outputs.LAST / "state.json").read_text())
    assert state["max_steps"] == 500 and 0 < state["budget_left_s"] < 1.8  # nothing fitted yet; part of 1.8 s spent
    Trainer(make_config(tiny_ckpt, tiny_dataset, out, **run, resume=True)).train()
    last = json.loads((out / outputs.LAST / "state.json").read_text())
    assert 5 < last["step"] == last["max_steps"] < 40, last  # the budget, not the 500 configured steps, ended it


def test_resume_refuses_a_dataset_that_changed(tiny_ckpt, tmp_path, monkeypatch):
    data = write_dataset(tmp_path / "data", lengths=(10, 10, 9, 10))
    run = {"max_steps": 4, "save_every": 2, "lora": {"rank": 4}}
    out = tmp_path / "run"
    Trainer(make_config(tiny_ckpt, data, out, **run)).train()
    write_dataset(tmp_path / "other", lengths=(10, 10, 9, 10), gripper_max=0.5)
    (tmp_path / "data").rename(tmp_path / "old")
    (tmp_path / "other").rename(tmp_path / "data")  # new content at the run's path
    with pytest.raises(ValueError, match="the dataset's statistics differ from .*dataset_statistics.json"):
        Trainer(make_config(tiny_ckpt, data, out, **{**run, "max_steps": 6}, resume=True))


def test_resume_refuses_another_number_of_processes(tiny_ckpt, tiny_dataset, tmp_path):
    """The processes set the data order and the batch of each step: a checkpoint trained on 2 does not resume on 1."""
    run = {"max_steps": 2, "save_every": 2, "lora": {"rank": 4}}
    out = tmp_path / "run"
    Trainer(make_config(tiny_ckpt, tiny_dataset, out, **run)).train()
    state_file = out / outputs.LAST / "state.json"
    state = json.loads(state_file.read_text())
    assert state["world"] == 1
    state_file.write_text(json.dumps({**state, "world": 2}))
    with pytest.raises(ValueError, match=r"step 2\) was trained on 2 process\(es\), this run has 1.*--nproc-per-node 2"):
        Trainer(make_config(tiny_ckpt, tiny_dataset, out, **{**run, "max_steps": 4}, resume=True))


def test_a_budgeted_run_that_a_refit_lengthens_after_its_resume_runs_to_the_new_length(tiny_ckpt, tmp_path, monkeypatch):
    """Resumed with its fitted 8 steps, a refit lengthens the run to 12 (within --max-steps 40): the data must last.
    The loader was sized to the fitted length, and step 9 raised a bare StopIteration."""
    import vla_finetune.trainer as trainer_module

    data = write_dataset(tmp_path / "data", lengths=(10, 10, 9, 10))
    run = {"max_steps": 40, "time_budget": 1.0, "save_every": 2, "log_every": 2, "lora": {"rank": 4}}
    out = tmp_path / "run"

    def first_run(self, done, cap):  # fits 8 steps after step 2; killed after the step-4 checkpoint
        if done == 5:
            raise Killed("killed after step 5")
        return 8 if done == 2 else None

    monkeypatch.setattr(trainer_module.TimeBudget, "after_step", first_run)
    with pytest.raises(Killed):
        Trainer(make_config(tiny_ckpt, data, out, **run)).train()
    monkeypatch.setattr(trainer_module.TimeBudget, "after_step", lambda self, done, cap: 12 if done == 5 else None)
    resumed = Trainer(make_config(tiny_ckpt, data, out, **run, resume=True))
    assert (resumed.start_step, resumed.cfg.max_steps) == (4, 8)
    resumed.train()
    assert json.loads((out / outputs.LAST / "state.json").read_text())["step"] == 12
