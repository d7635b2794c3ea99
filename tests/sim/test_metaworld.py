"""Meta-World backend: headless rendering, seeds, step limit, experts, clear errors."""

import importlib.util

import numpy as np
import pytest

from vla_runtime.sim import METAWORLD_INSTRUCTIONS, MetaWorldConfig, MetaWorldEnv, make_env

# find_spec, not importorskip: importing mujoco here would fix its GL backend before the env picks it
pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed"),
]


def test_reset_step_render_headless():
    config = MetaWorldConfig(cameras=("corner2", "gripperPOV"), resolution=(32, 40))
    with make_env("metaworld", config) as env:
        assert env.gl_backend in ("egl", "osmesa")
        obs = env.reset("button-press-v3", seed=3)
        assert list(obs.images) == ["corner2", "gripperPOV"]
        for image in obs.images.values():
            assert image.dtype == np.uint8 and image.shape == (32, 40, 3)
            assert image.std() > 5  # a rendered scene, not a blank buffer
        assert obs.state.dtype == np.float32 and obs.state.shape == (4,)
        assert 0.0 <= obs.state[3] <= 1.0 and obs.instruction == "Press the button"
        policy_obs = obs.to_policy()
        assert policy_obs.images["primary"] is obs.images["corner2"] and "gripperPOV" in policy_obs.images

        # +x at 1 cm per step: the mocap target moves 5 cm, the hand follows it (with lag) along +x only
        for _ in range(5):
            moved, done, success, info = env.step(np.array([0.01, 0, 0, 0, 0, 0, 1.0]))
        assert not done and not success and info.step == 5
        dx, dy, dz = moved.state[:3] - obs.state[:3]
        assert 0.01 < dx < 0.05 and abs(dy) < 0.005 and abs(dz) < 0.005
        np.testing.assert_array_equal(info.native_action, [1.0, 0.0, 0.0, -1.0])
        assert not np.array_equal(moved.images["corner2"], obs.images["corner2"])

        # the same seed gives the same scene, pixel for pixel; another variation differs
        again = env.reset("button-press-v3", seed=3)
        np.testing.assert_array_equal(again.images["corner2"], obs.images["corner2"])
        np.testing.assert_array_equal(again.state, obs.state)
        other = env.reset("button-press-v3", seed=4)
        assert not np.array_equal(other.images["corner2"], obs.images["corner2"])

        # images are rotated 180 degrees to stand upright (flip_images=True); the raw render is upside down
        env.config.flip_images = False
        raw = env.reset("button-press-v3", seed=3)
        np.testing.assert_array_equal(raw.images["corner2"], obs.images["corner2"][::-1, ::-1])


@pytest.fixture(scope="module")
def blind_env():
    """State-only env (no rendering): the experts do not need images."""
    with MetaWorldEnv(MetaWorldConfig(cameras=(), max_steps=300)) as env:
        yield env


@pytest.mark.parametrize("task", ["reach-v3", "button-press-v3", "drawer-open-v3"])
def test_expert_succeeds_within_step_limit(blind_env, task):
    blind_env.reset(task, seed=0)
    done = success = False
    while not done:
        _, done, success, info = blind_env.step(blind_env.expert_action())
    assert success and info.step < 300 and not info.truncated


def test_step_limit_ends_episode():
    with MetaWorldEnv(MetaWorldConfig(cameras=(), max_steps=5)) as env:
        env.reset("reach-v3", seed=0)
        for i in range(5):
            _, done, success, info = env.step(np.zeros(7))
            assert done == (i == 4) and not success
        assert info.truncated and info.step == 5
        with pytest.raises(RuntimeError, match="call reset"):
            env.step(np.zeros(7))


def test_bad_task_and_camera_errors_list_valid_names(blind_env):
    with pytest.raises(KeyError, match=r"unknown Meta-World task 'reach-v2'; valid tasks: .*reach-v3"):
        blind_env.reset("reach-v2", seed=0)
    with pytest.raises(ValueError, match=r"unknown Meta-World camera\(s\) \['front'\]; valid cameras: .*corner2.*gripperPOV"):
        MetaWorldConfig(cameras=("front",))
    with pytest.raises(ValueError, match="max_steps"):
        MetaWorldConfig(max_steps=501)
    with pytest.raises(KeyError, match="unknown simulator 'mujoco'; available: metaworld, rlbench"):
        make_env("mujoco")


def test_instructions_cover_metaworld_tasks():
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS
    from metaworld.policies import ENV_POLICY_MAP

    assert set(METAWORLD_INSTRUCTIONS) == set(ALL_V3_ENVIRONMENTS) == set(ENV_POLICY_MAP)
    assert len(METAWORLD_INSTRUCTIONS) == 50 and len(set(METAWORLD_INSTRUCTIONS.values())) == 50


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_imports_after_rendering():
    """Mesa's llvmpipe and Triton both bring LLVM; the env imports Triton first so a later import cannot crash.

    Runs in a child process: the failure mode is a segmentation fault.
    """
    import subprocess
    import sys

    code = (
        "from vla_runtime.sim import MetaWorldConfig, MetaWorldEnv\n"
        "env = MetaWorldEnv(MetaWorldConfig(resolution=(8, 8)))\n"
        "env.reset('reach-v3', 0)\n"
        "import triton, triton.runtime\n"
        "env.close()\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
