"""Preview videos of episodes: mp4 (H.264 via PyAV) where PyAV is available, else an animated GIF."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def write_preview(path: Path, frames: np.ndarray, *, fps: int) -> Path:
    """frames: uint8 [T, H, W, 3] -> ``path`` (mp4; ``.gif`` beside it when PyAV is missing). Returns the file written.

    Odd heights/widths are padded by one black row/column (H.264 in yuv420p needs even sizes). The file
    appears under its name only once it is complete (written beside it, fsync-ed, renamed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("av") is None:
        return _write_gif(path.with_suffix(".gif"), frames, fps=fps)
    from ..data.durable import write_atomic
    from ..data.video import VIDEO_CODECS, VideoWriter

    t, h, w, _ = frames.shape
    padded = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))

    def encode(tmp: Path) -> None:
        writer = VideoWriter(tmp, fps=fps, height=h + h % 2, width=w + w % 2, codec=VIDEO_CODECS["h264"])
        try:
            writer.write(padded)
        finally:
            writer.close()

    write_atomic(path, encode)
    return path


def _write_gif(path: Path, frames: np.ndarray, *, fps: int) -> Path:
    from PIL import Image

    from ..data.durable import write_atomic

    images = [Image.fromarray(f) for f in frames]
    write_atomic(path, lambda tmp: images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                                                  duration=max(1, round(1000 / fps)), loop=0))
    log.info("PyAV is not installed: wrote a GIF instead of an mp4 (%s)", path)
    return path
