"""collect -> LeRobot dataset -> closed-loop eval through the runtime API, end to end in Meta-World."""

import importlib.util
import json
from functools import partial

import numpy as np
import pytest

from vla_runtime import api
from vla_runtime.cli import main
from vla_runtime.config import SessionConfig
from vla_runtime.data import LeRobotDataset
from vla_runtime.sim import MetaWorldConfig, MetaWorldEnv, make_env
from vla_runtime.sim.collect import CollectConfig, collect
from vla_runtime.sim.evaluate import EvalConfig, evaluate

from replay_policy import BYTES_PER_STEP, make_replay_policy

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed"),
]
# tasks whose scene variations differ in the image (the replay policy recognises a scene by its first frame;
# reach-v3's goal is invisible, so its seeds all start from the same picture)
TASKS = ["button-press-topdown-v3", "button-press-v3"]
ENV = MetaWorldConfig(resolution=(40, 48))


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos") / "mw"
    results = collect(CollectConfig(tasks=TASKS, episodes=2, out=root, seed=5, env=ENV), progress=False)
    return root, results


def test_collect_writes_a_valid_dataset(demos):
    root, results = demos
    assert [(r.kept, r.failed) for r in results.values()] == [(2, 0), (2, 0)]
    ds = LeRobotDataset(root)
    info = json.loads((root / "meta/info.json").read_text())
    assert info["fps"] == 80 and info["total_episodes"] == 4 and ds.extra["per_episode"]["episode_seeds"] == [5, 6, 5, 6]
    assert info["features"]["action"]["names"] == ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"]
    assert info["features"]["observation.state"]["names"] == ["hand_x", "hand_y", "hand_z", "gripper_opening"]
    assert ds.tasks == ["Press the button from the top", "Press the button"]
    assert info["total_frames"] == sum(r.frames for r in results.values())
    ep = ds.episode(0)
    assert ep.images["corner2"].shape == (len(ep), 40, 48, 3)
    assert np.all(ep.action[:, 3:6] == 0)  # Meta-World has no rotation: stored as zeros
    assert np.all((ep.action[:, 6] >= 0) & (ep.action[:, 6] <= 1)) and np.abs(ep.action[:, :3]).max() <= 0.01
    np.testing.assert_allclose(ds.stats["action"]["q99"], np.quantile(np.concatenate([e.action for e in ds]), 0.99, axis=0), rtol=1e-6)


def test_stored_actions_reproduce_the_recorded_episode(demos):
    """The 7-D actions in the dataset, executed through the 7 -> 4 mapping, replay frames and states exactly."""
    root, _ = demos
    ds = LeRobotDataset(root)
    seeds = ds.extra["per_episode"]["episode_seeds"]
    ep = ds.episode(3)
    with MetaWorldEnv(ENV) as env:
        obs = env.reset(TASKS[1], seeds[3])
        for t in range(len(ep)):
            np.testing.assert_array_equal(obs.images["corner2"], ep.images["corner2"][t])
            np.testing.assert_array_equal(obs.state, ep.state[t])
            obs, done, success, _ = env.step(ep.action[t])
        assert done and success


def test_collect_skips_and_counts_failed_expert_episodes(tmp_path):
    # reach-v3's expert needs 51, 44, 34, 40 steps for seeds 0..3: with a 40-step limit seeds 0 and 1 fail
    config = CollectConfig(tasks=["reach-v3"], episodes=2, out=tmp_path / "ds", seed=0, env=MetaWorldConfig(resolution=(16, 16), max_steps=40))
    results = collect(config, progress=False)
    assert (results["reach-v3"].kept, results["reach-v3"].failed) == (2, 2)
    assert LeRobotDataset(tmp_path / "ds").extra["per_episode"]["episode_seeds"] == [2, 3]
    assert [len(ep) for ep in LeRobotDataset(tmp_path / "ds")] == [34, 40]


def test_eval_cli_end_to_end(demos, tmp_path, monkeypatch, capsys):
    root, _ = demos
    (root / "REPLAY").touch()  # marks the dataset as a checkpoint of the test family below
    monkeypatch.setitem(api.FAMILIES, "test-replay", (lambda p: (p / "REPLAY").exists(), lambda p, **kw: make_replay_policy(p)))
    out = tmp_path / "eval"
    code = main(["eval", "--checkpoint", str(root), "--sim", "metaworld", "--tasks", ",".join(TASKS), "--episodes", "2",
                 "--seed", "5", "--resolution", "40x48", "--kv", "full", "--history", "single", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert TASKS[0] in printed and "overall" in printed and "report:" in printed
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert report["family"] == "test-replay" and len(report["episodes"]) == 4
    for task in TASKS:
        m = summary["tasks"][task]
        assert m["success_rate"] == 1.0 and m["episodes"] == 2
        assert m["control_rate_hz"] > 0 and 0 <= m["step_latency_ms"]["p50"] <= m["step_latency_ms"]["p95"]
        # the replay policy's stand-in memory grows by one 64-byte token per step
        longest = max(e["steps"] for e in report["episodes"] if e["task"] == task)
        assert m["kv_bytes_max"] == longest * BYTES_PER_STEP
    png = (out / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    import av

    first = next(e for e in report["episodes"] if e["task"] == TASKS[0])
    with av.open(str(out / "videos" / f"{TASKS[0]}.mp4")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == first["steps"] + 1 and frames[0].shape == (40, 48, 3)
    assert first["video"].endswith(f"{TASKS[0]}.mp4")

    # the same --out again: a one-line error naming --resume; with --resume nothing is left to run, the report is rebuilt
    assert main(["eval", "--checkpoint", str(root), "--sim", "metaworld", "--tasks", ",".join(TASKS), "--out", str(out)]) == 2
    assert "episodes.jsonl exists: pass --resume to continue that run" in capsys.readouterr().err
    (out / "report.json").unlink()
    assert main(["eval", "--checkpoint", str(root), "--sim", "metaworld", "--tasks", ",".join(TASKS), "--episodes", "2",
                 "--seed", "5", "--resolution", "40x48", "--kv", "full", "--history", "single", "--out", str(out), "--resume"]) == 0
    assert json.loads((out / "report.json").read_text())["summary"] == summary

    # a resume with another session, or of another checkpoint, would mix two runs' episodes: refused, naming what changed
    capsys.readouterr()
    resume = ["eval", "--checkpoint", str(root), "--sim", "metaworld", "--tasks", ",".join(TASKS), "--episodes", "2",
              "--seed", "5", "--resolution", "40x48", "--kv", "full", "--out", str(out), "--resume"]
    assert main([*resume, "--history", "history"]) == 2
    err = capsys.readouterr().err
    assert "other settings than the interrupted run (session:" in err and "history=<HistoryMode.HISTORY" in err
    (root / "README.md").write_text("retrained")  # the checkpoint directory holds something else now
    try:
        assert main([*resume, "--history", "single"]) == 2
        assert "(checkpoint: " in capsys.readouterr().err
    finally:
        (root / "README.md").unlink()


def test_eval_parallel_workers_with_action_chunks(demos, capfd):
    root, _ = demos
    config = EvalConfig(tasks=["button-press-v3"], episodes=2, seed=5, session=SessionConfig(execution_horizon=None), workers=2)
    results = evaluate(partial(make_replay_policy, root, chunk=4), partial(make_env, "metaworld", ENV), config, progress=False)
    assert [(r.task, r.seed, r.success) for r in results] == [("button-press-v3", 5, True), ("button-press-v3", 6, True)]
    for r in results:
        assert len(r.step_ms) == r.steps and len(r.inference_ms) == -(-r.steps // 4)  # one prediction per 4-action chunk
    # the workers exited (the pool joined them) without MuJoCo's GL-context traceback at interpreter exit
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_a_worker_episode_that_raises_keeps_the_results_of_the_others_and_is_raised():
    """Episodes that finished are handed on (made durable) before the failure is raised; what had not started is
    not run (``--resume`` runs it). The error raised is the first failed episode's in job order (seed 0), whichever
    worker failed first: bad seed 0 is handed to a worker before bad seed 1, so it runs even when seed 1's failure
    cancels the rest (a loaded machine once raised seed 1's error here)."""
    from eval_fakes import make_policy, make_world

    recorded = []
    config = EvalConfig(tasks=["good", "bad"], episodes=3, seed=0, workers=2)
    with pytest.raises(RuntimeError, match="the simulator crashed on bad seed 0"):
        evaluate(make_policy, make_world, config, progress=False, on_result=lambda i, r: recorded.append(i))
    assert sorted(recorded) == [0, 1, 2]  # every "good" episode (queued before any "bad" one) was recorded
    with pytest.raises(ValueError, match="`tasks` names good more than once"):
        EvalConfig(tasks=["good", "bad", "good"], episodes=1)


def test_each_episode_of_a_task_draws_its_own_noise_seed():
    """Sampling heads (CogACT's diffusion) get ``session.seed + i`` for episode i, not one seed for every episode."""
    from eval_fakes import StillPolicy, make_world

    seeds = []

    class RecordingPolicy(StillPolicy):
        def new_session(self, instruction, config):
            seeds.append(config.seed)
            return super().new_session(instruction, config)

    config = EvalConfig(tasks=["a", "b"], episodes=3, seed=10, session=SessionConfig(seed=7))
    evaluate(RecordingPolicy, make_world, config, progress=False)
    assert seeds == [7, 8, 9, 7, 8, 9]


def test_eval_rejects_a_policy_it_cannot_map(demos, monkeypatch):
    root, _ = demos
    policy, env = partial(make_replay_policy, root, action_dim=4), partial(make_env, "metaworld", ENV)
    with pytest.raises(ValueError, match="action_dim=4 cannot be mapped to metaworld"):
        evaluate(policy, env, EvalConfig(tasks=TASKS[:1], episodes=1), progress=False)
    # a worker process surfaces the same error to the caller (run here in-process: same functions, no spawn)
    import torch

    from vla_runtime.sim import evaluate as evaluate_module

    monkeypatch.setattr(evaluate_module, "_worker", {})
    evaluate_module._init_worker(policy, env, torch.get_num_threads())
    with pytest.raises(ValueError, match="action_dim=4 cannot be mapped to metaworld"):
        evaluate_module._worker_episode(TASKS[0], 5, SessionConfig(), None)


def test_eval_counts_an_episode_with_unusable_actions_as_failed(demos):
    root, _ = demos
    config = EvalConfig(tasks=TASKS[1:], episodes=1, seed=5)
    (result,) = evaluate(partial(make_replay_policy, root, nan_after=3), partial(make_env, "metaworld", ENV), config, progress=False)
    assert not result.success and result.steps == 3 and "non-finite" in result.error


def test_eval_tiny_openvla_end_to_end(tmp_path, capsys):
    """A real (tiny, random) OpenVLA checkpoint through load_policy -> session -> Meta-World, both history modes."""
    ckpt = tmp_path / "tiny-openvla"
    assert main(["make-tiny", str(ckpt), "--family", "openvla", "--dtype", "float32"]) == 0
    kv_max = {}
    for history in ("single", "history"):
        out = tmp_path / f"eval-{history}"
        code = main(["eval", "--checkpoint", str(ckpt), "--sim", "metaworld", "--tasks", "button-press-v3", "--episodes", "1",
                     "--max-steps", "6", "--resolution", "56", "--kv", "full", "--history", history, "--out", str(out)])
        assert code == 0
        report = json.loads((out / "report.json").read_text())
        assert report["family"] == "openvla"
        (episode,) = report["episodes"]
        assert episode["steps"] == 6 and episode["error"] is None and episode["kv_final"]["tokens_raw"] > 0
        m = report["summary"]["tasks"]["button-press-v3"]
        assert m["control_rate_hz"] > 0 and m["inference_latency_ms"]["p50"] > 0
        assert (out / "summary.png").stat().st_size > 5000 and (out / "videos" / "button-press-v3.mp4").stat().st_size > 0
        kv_max[history] = m["kv_bytes_max"]
    # history mode keeps the whole episode in one cache; single mode holds one step's context
    assert kv_max["history"] > kv_max["single"] > 0


def test_eval_kv_capacity_sets_how_much_a_full_history_cache_holds(tmp_path, capsys):
    """A history-mode full cache holds the whole episode: too small a --kv-capacity is a clear error, enough runs."""
    ckpt = tmp_path / "tiny-openvla"
    assert main(["make-tiny", str(ckpt), "--family", "openvla", "--dtype", "float32"]) == 0
    common = ["eval", "--checkpoint", str(ckpt), "--sim", "metaworld", "--tasks", "button-press-v3", "--episodes", "1",
              "--max-steps", "5", "--resolution", "56", "--kv", "full", "--history", "history", "--no-video"]  # fmt: skip
    assert main(common + ["--kv-capacity", "60", "--out", str(tmp_path / "small")]) == 2
    err = capsys.readouterr().err
    assert "FullCache is full" in err and "capacity 60" in err
    assert main(common + ["--kv-capacity", "400", "--out", str(tmp_path / "enough")]) == 0
    (episode,) = json.loads((tmp_path / "enough" / "report.json").read_text())["episodes"]
    assert episode["steps"] == 5 and episode["kv_final"]["tokens_raw"] > 60


def test_collect_tries_each_tasks_own_seeds_in_order_and_resumes_after_the_last_kept(tmp_path):
    # reach-v3's expert needs 51, 44, 34, 40 steps for seeds 0..3: with a 40-step limit seeds 0 and 1 fail
    env = MetaWorldConfig(resolution=(16, 16), max_steps=40)
    config = partial(CollectConfig, tasks=["reach-v3"], out=tmp_path / "ds", env=env)
    seeds = {"reach-v3": [3, 1, 2, 0]}
    first = collect(config(episodes=1, seeds=seeds), progress=False)
    assert (first["reach-v3"].kept, first["reach-v3"].failed) == (1, 0)
    resumed = collect(config(episodes=2, seeds=seeds, resume=True), progress=False)
    assert (resumed["reach-v3"].kept, resumed["reach-v3"].failed) == (2, 1)  # seed 1 failed, seed 2 kept
    assert LeRobotDataset(tmp_path / "ds").extra["per_episode"]["episode_seeds"] == [3, 2]
    # failures before the interruption count in the resumed run's tally, as in an uninterrupted one
    failing_first = {"reach-v3": [1, 3, 2, 0]}
    config = partial(CollectConfig, tasks=["reach-v3"], out=tmp_path / "ds2", env=env)
    assert (collect(config(episodes=1, seeds=failing_first), progress=False)["reach-v3"].failed) == 1
    resumed = collect(config(episodes=2, seeds=failing_first, resume=True), progress=False)
    assert (resumed["reach-v3"].kept, resumed["reach-v3"].failed) == (2, 1)
    config = partial(CollectConfig, tasks=["reach-v3"], out=tmp_path / "ds", env=env)
    with pytest.raises(ValueError, match="seed 3, which this run would not try"):
        collect(config(episodes=3, seeds={"reach-v3": [2, 0]}, resume=True), progress=False)
    with pytest.raises(ValueError, match="holds more than --episodes 1 episodes of reach-v3"):
        collect(config(episodes=1, seeds=seeds, resume=True), progress=False)


@pytest.mark.parametrize(
    ("seeds", "message"),
    [({}, "missing reach-v3"), ({"reach-v3": []}, "missing reach-v3"), ({"reach-v3": [1, 1]}, "distinct"),
     ({"reach-v3": [-1]}, "distinct seeds >= 0"),
     ({"reach-v3": [1], "button-press-v3": [2]}, "not in tasks button-press-v3")],
)  # fmt: skip
def test_a_seed_list_must_name_every_task_and_only_those_with_distinct_seeds(tmp_path, seeds, message):
    with pytest.raises(ValueError, match=message):
        CollectConfig(tasks=["reach-v3"], episodes=1, out=tmp_path / "ds", seeds=seeds)


def test_the_seed_file_is_read_as_task_name_to_integer_seeds(tmp_path):
    from vla_runtime.cli.collect import read_seed_file

    good = tmp_path / "good.json"
    good.write_text('{"memory-reference": [7, 19]}')
    assert read_seed_file(good) == {"memory-reference": [7, 19]}
    for text in ('[7, 19]', '{"memory-reference": [7, true]}', '{"memory-reference": 7}', "{not json"):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match="--seed-file"):
            read_seed_file(tmp_path / "bad.json")
