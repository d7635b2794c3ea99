"""Changes to a Meta-World scene at runtime (model properties only) and the markers drawn into renders."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Marker, MarkerShape


def remove_body(mw: Any, body: str) -> None:
    """Take ``body``'s geoms out of the scene: invisible, no contacts, and the body gravity-compensated so it
    stays where it is (its free joint would otherwise let it fall through the table)."""
    model = mw.model
    body_id = model.body(body).id
    for geom in range(model.ngeom):
        if model.geom_bodyid[geom] == body_id:
            model.geom_rgba[geom, 3] = 0.0
            model.geom_contype[geom] = 0
            model.geom_conaffinity[geom] = 0
    model.body_gravcomp[body_id] = 1.0


def remove_site(mw: Any, site: str) -> None:
    """Make ``site`` invisible."""
    mw.model.site(site).rgba[3] = 0.0


def set_joint_stiffness(mw: Any, joint: str, stiffness: float) -> None:
    """Spring stiffness of ``joint`` (N/m or N m/rad), e.g. so a button springs back after a press."""
    mw.model.joint(joint).stiffness[:] = stiffness


def draw_markers(scene: Any, markers: list[Marker]) -> None:
    """Append ``markers`` to a MuJoCo ``MjvScene`` after ``update_scene`` (render-only geoms)."""
    import mujoco

    shapes = {MarkerShape.SPHERE: mujoco.mjtGeom.mjGEOM_SPHERE, MarkerShape.CYLINDER: mujoco.mjtGeom.mjGEOM_CYLINDER}
    if scene.ngeom + len(markers) > scene.maxgeom:
        raise RuntimeError(f"the render scene holds {scene.maxgeom} geoms; {scene.ngeom} + {len(markers)} markers do not fit")
    identity = np.eye(3).ravel()
    for marker in markers:
        mujoco.mjv_initGeom(
            scene.geoms[scene.ngeom],
            shapes[marker.shape],
            np.asarray(marker.size, dtype=np.float64),
            np.asarray(marker.pos, dtype=np.float64),
            identity,
            np.asarray(marker.rgba, dtype=np.float32),
        )
        scene.ngeom += 1
