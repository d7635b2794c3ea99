"""Policy <-> Meta-World action mapping and the headless GL choice (no simulator needed)."""

import numpy as np
import pytest

from vla_runtime.sim import MetaWorldActions, check_policy_action_dim
from vla_runtime.sim import gl


def test_to_native_scales_metres_and_flips_gripper():
    m = MetaWorldActions()
    native = m.to_native(np.array([0.004, -0.0025, 0.01, 0.3, -0.2, 0.1, 1.0]))
    np.testing.assert_allclose(native, [0.4, -0.25, 1.0, -1.0], atol=1e-12)  # 1 = open -> effort -1 (open)
    assert m.to_native(np.array([0, 0, 0, 0, 0, 0, 0.0]))[3] == 1.0  # closed -> effort +1
    assert m.to_native(np.array([0, 0, 0, 0, 0, 0, 0.5]))[3] == 0.0
    # beyond Meta-World's range: clipped, as the simulator would
    np.testing.assert_array_equal(m.to_native(np.array([0.5, -0.5, 0, 9, 9, 9, 3.0])), [1.0, -1.0, 0.0, -1.0])


def test_rotation_dims_are_ignored():
    m = MetaWorldActions()
    a = np.array([0.001, 0.002, 0.003, 0.0, 0.0, 0.0, 0.3])
    b = a.copy()
    b[3:6] = [1.0, -2.0, 0.5]
    np.testing.assert_array_equal(m.to_native(a), m.to_native(b))


def test_from_native_inverts_to_native():
    m = MetaWorldActions()
    native = np.random.default_rng(0).uniform(-1, 1, size=(200, 4))
    back = np.stack([m.to_native(m.from_native(n)) for n in native])
    np.testing.assert_allclose(back, native, rtol=0, atol=1e-12)
    # float32 storage (what the dataset keeps) stays within float32 rounding of the native action
    back32 = np.stack([m.to_native(m.from_native(n).astype(np.float32)) for n in native])
    np.testing.assert_allclose(back32, native, rtol=0, atol=1e-6)


def test_bad_actions_are_rejected_with_the_expected_layout():
    m = MetaWorldActions()
    with pytest.raises(ValueError, match=r"shape \[7\].*got shape \(4,\)"):
        m.to_native(np.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        m.to_native(np.array([np.nan, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="action_dim=4 cannot be mapped to metaworld"):
        check_policy_action_dim(4, "metaworld")
    check_policy_action_dim(7, "metaworld")
    with pytest.raises(ValueError, match="position_scale"):
        MetaWorldActions(position_scale=0)


def test_gl_backend_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(gl, "gpu_driver_present", lambda probes=(): True)
    env = {}
    assert gl.select_gl_backend(env) == "egl" and env["MUJOCO_GL"] == "egl" and env["PYOPENGL_PLATFORM"] == "egl"
    monkeypatch.setattr(gl, "gpu_driver_present", lambda probes=(): False)
    env = {}
    assert gl.select_gl_backend(env) == "osmesa" and env["PYOPENGL_PLATFORM"] == "osmesa"
    env = {"MUJOCO_GL": "egl"}  # the user's choice wins
    assert gl.select_gl_backend(env) == "egl"
    with pytest.raises(ValueError, match="MUJOCO_GL is 'vulkan'; expected one of egl, osmesa, glfw"):
        gl.select_gl_backend({"MUJOCO_GL": "vulkan"})


def test_gpu_driver_probe(tmp_path):
    nvidia = tmp_path / "version"
    dri = tmp_path / "dri"
    dri.mkdir()
    assert not gl.gpu_driver_present((nvidia, dri))
    (dri / "renderD128").touch()
    assert gl.gpu_driver_present((nvidia, dri))
    nvidia.touch()
    assert gl.gpu_driver_present((nvidia, tmp_path / "missing"))
