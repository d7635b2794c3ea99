"""RLBench adapter contract test, against ``fake_rlbench`` (a FAKE of RLBench's API; CoppeliaSim cannot run here)."""

import sys

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

import fake_rlbench
from vla_runtime.sim import RLBenchConfig, make_env
from vla_runtime.sim.rlbench_env import ee_delta_to_pose, pose_to_ee_delta


def test_missing_rlbench_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "rlbench", None)  # `import rlbench` raises ImportError
    with pytest.raises(ImportError, match=r"CoppeliaSim 4\.1.*PyRep and RLBench.*stepjam/RLBench"):
        make_env("rlbench")


@pytest.fixture
def env(monkeypatch):
    fake_rlbench.install(monkeypatch)
    with make_env("rlbench", RLBenchConfig(cameras=("front", "wrist"), resolution=(20, 30), max_steps=6)) as e:
        yield e


def test_observation_config_and_action_mode(env):
    fake = fake_rlbench.Environment.instances[-1]
    assert fake.launched and fake.headless and fake.robot_setup == "panda"
    mode = fake.action_mode
    assert isinstance(mode, fake_rlbench.MoveArmThenGripper)
    assert isinstance(mode.arm_action_mode, fake_rlbench.EndEffectorPoseViaPlanning)
    assert isinstance(mode.gripper_action_mode, fake_rlbench.Discrete)
    oc = fake.obs_config
    for cam in fake_rlbench.CAMERAS:
        cc = getattr(oc, f"{cam}_camera")
        assert cc.rgb == (cam in ("front", "wrist")) and not (cc.depth or cc.mask or cc.point_cloud)
        assert tuple(cc.image_size) == (30, 20)  # RLBench/PyRep: (width, height) for our (height, width) = (20, 30)
    assert oc.gripper_pose and oc.gripper_open and not (oc.joint_positions or oc.joint_velocities or oc.task_low_dim_state)


def test_reset_observation_and_task_lookup(env):
    assert env.tasks == ["close_jar", "open_drawer"]
    obs = env.reset("open_drawer", seed=4)
    assert obs.instruction == "open the bottom drawer" == env.instruction("open_drawer")
    assert list(obs.images) == ["front", "wrist"]
    assert all(im.dtype == np.uint8 and im.shape == (20, 30, 3) for im in obs.images.values())
    np.testing.assert_array_equal(obs.state, np.append(fake_rlbench.HOME, 1.0).astype(np.float32))
    task_env = fake_rlbench.Environment.instances[-1].task_envs[-1]
    assert task_env._variation == 4 % 3  # seed picks the variation
    with pytest.raises(KeyError, match=r"unknown RLBench task 'open_drawers'; valid tasks: close_jar, open_drawer"):
        env.reset("open_drawers", seed=0)


def test_delta_actions_become_absolute_xyzw_poses(env):
    env.reset("open_drawer", seed=0)
    delta = np.array([0.01, -0.02, 0.03, 0.0, 0.0, 0.3, 0.2])  # rotate 0.3 rad about z, close
    obs, done, success, info = env.step(delta)
    sent = fake_rlbench.Environment.instances[-1].task_envs[-1].actions[-1]
    assert sent.shape == (8,)
    np.testing.assert_allclose(sent[:3], fake_rlbench.HOME[:3] + delta[:3])
    np.testing.assert_allclose(sent[3:7], [0, 0, np.sin(0.15), np.cos(0.15)], atol=1e-12)  # xyzw, unit, qw >= 0
    assert sent[7] == pytest.approx(0.2) and obs.state[7] == 0.0  # Discrete: 0.2 < 0.5 -> closed
    np.testing.assert_array_equal(info.native_action, sent)
    # a second rotation composes in the world frame
    obs, *_ = env.step(np.array([0, 0, 0, 0.2, 0, 0, 1.0]))
    expected = (Rotation.from_euler("x", 0.2) * Rotation.from_euler("z", 0.3)).as_quat()
    expected = expected if expected[3] >= 0 else -expected
    np.testing.assert_allclose(obs.state[3:7], expected, atol=1e-6)
    assert obs.state[7] == 1.0


def test_success_step_limit_and_planner_failure(env):
    env.reset("close_jar", seed=0)  # target = HOME + (0, 0.1, -0.1)
    obs, done, success, info = env.step(np.array([0, 0.1, -0.1, 0, 0, 0, 1.0]))
    assert done and success and info.step == 1
    env.reset("close_jar", seed=0)
    for i in range(6):
        obs, done, success, info = env.step(np.zeros(7))
    assert done and not success and info.truncated
    env.reset("close_jar", seed=0)
    obs, done, success, info = env.step(np.array([2.0, 0, 0, 0, 0, 0, 1.0]))  # outside the workspace
    assert done and not success and "outside of workspace" in info.extra["error"]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(np.zeros(7))
    env.reset("close_jar", seed=0)
    with pytest.raises(ValueError, match=r"RLBench expects one policy action of shape \[7\]"):
        env.step(np.zeros(8))


def test_demos_become_delta_actions_that_replay_exactly(env):
    demos = env.get_demos("open_drawer", amount=2, seed=1)
    assert len(demos) == 2
    demo = demos[0]
    assert demo["action"].shape == (5, 7) and demo["state"].shape == (5, 8) and demo["images"]["front"].shape == (5, 20, 30, 3)
    assert demo["instruction"] == "open the bottom drawer"
    # replaying the deltas from the demo's first pose reaches every recorded pose
    env.reset("open_drawer", seed=1)
    for t in range(4):
        obs, done, success, _ = env.step(demo["action"][t])
        np.testing.assert_allclose(obs.state[:3], demo["state"][t + 1, :3], atol=1e-6)
        np.testing.assert_allclose(np.abs(obs.state[3:7] @ demo["state"][t + 1, 3:7]), 1.0, atol=1e-6)  # same rotation
        assert obs.state[7] == demo["state"][t + 1, 7]
    assert success and done


def test_pose_delta_helpers_invert_each_other():
    rng = np.random.default_rng(0)
    for _ in range(20):
        pose = np.concatenate([rng.normal(size=3), Rotation.random(random_state=rng).as_quat()])
        delta = np.concatenate([rng.normal(size=3) * 0.05, rng.uniform(-0.5, 0.5, 3), [1.0]])
        target = ee_delta_to_pose(pose, delta)
        assert np.isclose(np.linalg.norm(target[3:7]), 1.0) and target[6] >= 0
        np.testing.assert_allclose(pose_to_ee_delta(pose, target[:7], 1.0), delta, atol=1e-9)
