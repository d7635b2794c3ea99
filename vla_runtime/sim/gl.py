"""Pick MuJoCo's headless OpenGL backend before MuJoCo is imported.

MuJoCo reads ``MUJOCO_GL`` once, when ``mujoco`` is first imported. ``select_gl_backend`` is called
by the Meta-World backend right before that import: a value the user already set wins; otherwise
EGL where a GPU driver is present (hardware rendering, no X server), else OSMesa (software
rendering, works on any machine with Debian's ``libosmesa6``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

GL_BACKENDS = ("egl", "osmesa", "glfw")
# where a GPU driver shows itself: NVIDIA's proc entry, or a DRM render node (AMD/Intel/NVIDIA open drivers)
_DRIVER_PROBES = (Path("/proc/driver/nvidia/version"), Path("/dev/dri"))


def gpu_driver_present(probes: tuple[Path, ...] = _DRIVER_PROBES) -> bool:
    """True when a GPU driver that EGL can render with is visible."""
    for probe in probes:
        if probe.is_dir():
            if any(probe.glob("renderD*")):
                return True
        elif probe.exists():
            return True
    return False


def select_gl_backend(environ: dict[str, str] | None = None) -> str:
    """Set ``MUJOCO_GL`` (and PyOpenGL's platform) if unset; return the backend in force.

    Raises ``ValueError`` for a ``MUJOCO_GL`` value MuJoCo does not know.
    """
    env = os.environ if environ is None else environ
    chosen = env.get("MUJOCO_GL", "").strip().lower()
    if chosen:
        if chosen not in GL_BACKENDS:
            raise ValueError(f"MUJOCO_GL is {chosen!r}; expected one of {', '.join(GL_BACKENDS)}")
    else:
        chosen = "egl" if gpu_driver_present() else "osmesa"
        env["MUJOCO_GL"] = chosen
        log.info("MUJOCO_GL=%s (%s)", chosen, "GPU driver found" if chosen == "egl" else "no GPU driver: software rendering")
    if chosen in ("egl", "osmesa"):
        env.setdefault("PYOPENGL_PLATFORM", chosen)
    if environ is None and "mujoco" in sys.modules:
        loaded = getattr(sys.modules["mujoco"], "GLContext", None)
        loaded = loaded.__module__.rsplit(".", 1)[-1] if loaded is not None else "none"
        if loaded != chosen:
            raise RuntimeError(
                f"mujoco was imported before the GL backend was chosen and uses {loaded!r}, not {chosen!r}: "
                f"set MUJOCO_GL={chosen} before importing mujoco or metaworld (or create the simulator first)"
            )
    return chosen


def import_triton_before_gl() -> None:
    """Import Triton (when installed) before MuJoCo loads its GL library.

    Mesa's software rasteriser (llvmpipe, behind OSMesa and EGL without a GPU) brings its own libLLVM
    into the process's global symbol scope; Triton, imported afterwards (torch imports it lazily, e.g.
    through torchvision or torch.compile), then binds its LLVM calls to Mesa's LLVM and the process
    dies with a segmentation fault. Loaded in the other order, both work.
    """
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    try:
        importlib.import_module("triton")
    except ImportError as e:  # a broken Triton install only matters to code that uses it
        log.debug("could not pre-import triton: %s", e)
