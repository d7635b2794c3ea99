"""MP4 encode/decode with PyAV for LeRobot ``video`` features.

A ``VideoWriter`` appends the frames of many episodes to one mp4 (LeRobot v3 concatenates episodes;
an episode is the time range [from_timestamp, to_timestamp) in the file). Frame k has pts k with
time base 1/fps, so frame times are exact multiples of 1/fps.

Codecs (``VIDEO_CODECS``): ``h264`` is what players expect (yuv420p, lossy: colours are subsampled,
so frames do NOT read back bit-identically); ``hevc_lossless`` (libx265 in lossless mode on planar RGB,
``gbrp``, every frame a keyframe) reads back bit-identically, files are several times larger and fewer players show it; ``av1``
is LeRobot's default (libsvtav1, yuv420p, lossy).

Each codec's settings are the fields LeRobot records under ``info.json`` ``features[key]["info"]``
(``video.codec``/``video.pix_fmt`` as PyAV reports the stream, ``video.g``, ``video.crf``,
``video.preset``, ``video.extra_options``) and re-encodes with when it edits a dataset
(``delete_episodes``, merge): with ``VideoCodec.info`` in ``info.json``, its re-encode reproduces ours,
lossless included (LeRobot maps ``hevc`` to libx265 and passes ``x265-params`` through).

Encoding leaves the calling thread's scheduling as it was: libsvtav1 (the ``av1`` encoder, SVT-AV1 4.1 in
PyAV's wheel) switches the thread that opens it to ``SCHED_FIFO`` at priority 99 when the process runs as
root, and every thread and process started from that thread afterwards inherits it (see ``same_scheduling``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class VideoCodec:
    """An encoder and the stream it writes.

    Args:
        encoder: the PyAV/ffmpeg encoder name.
        stream_codec: the codec PyAV reports for the written stream (``codec.canonical_name``).
        pix_fmt: the stream's pixel format as PyAV reports it (``stream.pix_fmt``).
        g: keyframe interval; crf, preset: rate/speed settings (``None``: the encoder's default).
        extra_options: further encoder options, passed as given.
        lossless: frames read back bit-identically.
    """

    encoder: str
    stream_codec: str
    pix_fmt: str
    g: int = 2
    crf: int | None = None
    preset: int | str | None = None
    extra_options: dict = field(default_factory=dict)
    lossless: bool = False

    def options(self) -> dict[str, str]:
        """Encoder options, as LeRobot builds them from the same fields."""
        opts = {"g": str(self.g)}
        if self.crf is not None:
            opts["crf"] = str(self.crf)
        if self.preset is not None:
            opts["preset"] = str(self.preset)
        return {**opts, **{k: str(v) for k, v in self.extra_options.items() if k not in opts}}

    def info(self, height: int, width: int, fps: int) -> dict:
        """The ``info`` block LeRobot 0.6.1 writes for a video feature encoded this way (same keys, same order)."""
        return {
            "video.height": height,
            "video.width": width,
            "video.codec": self.stream_codec,
            "video.pix_fmt": self.pix_fmt,
            "video.fps": int(fps),
            "video.channels": 3,
            "has_audio": False,
            "video.g": self.g,
            "video.crf": self.crf,
            "video.preset": self.preset,
            "video.fast_decode": 0,
            "video.video_backend": "pyav",
            "video.extra_options": dict(self.extra_options),
            "is_depth_map": False,
        }


VIDEO_CODECS: dict[str, VideoCodec] = {
    "h264": VideoCodec("libx264", "h264", "yuv420p", crf=18),
    # intra-only (g=1): x265's lossless inter frames decode a few pixels off in FFmpeg's HEVC decoder (measured on
    # random 16x16 and 64x64 frames); intra frames decode bit-exactly
    "hevc_lossless": VideoCodec("libx265", "hevc", "gbrp", g=1, preset="ultrafast",
                                extra_options={"x265-params": "lossless=1:log-level=error"}, lossless=True),
    "av1": VideoCodec("libsvtav1", "av1", "yuv420p", crf=30, preset=12),
}


@contextlib.contextmanager
def same_scheduling():
    """Restore the calling thread's scheduling policy and priority if the block changed them.

    libsvtav1 switches the thread that opens an encoder to real-time scheduling (``SCHED_FIFO``, priority
    99) when it runs as root (as CI does), and keeps it there. Threads and processes started from that thread
    later inherit the policy: a writer's caller that goes on to start workers or ROS nodes would run them
    all at real-time priority, where a thread that busy-waits for another of equal priority on a busy CPU
    never lets it run (the hang of issue 13's two-bringup test, which ran after an ``av1`` writer test).
    """
    if not hasattr(os, "sched_getscheduler"):  # not Linux: nothing to keep
        yield
        return
    policy, priority = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) != (policy, priority):
            os.sched_setscheduler(0, policy, os.sched_param(priority))


def get_codec(name: str) -> VideoCodec:
    if name not in VIDEO_CODECS:
        raise KeyError(f"unknown video codec {name!r}; available: {', '.join(sorted(VIDEO_CODECS))}")
    return VIDEO_CODECS[name]


def probe(path: Path) -> dict:
    """What PyAV reports for the first video stream of ``path``: codec, pix_fmt, height, width, fps."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return {"video.codec": stream.codec.canonical_name, "video.pix_fmt": stream.pix_fmt, "video.height": stream.height,
                "video.width": stream.width, "video.fps": int(stream.base_rate)}


class VideoWriter:
    """Appends uint8 [H, W, 3] frames to one mp4; ``frames_written / fps`` is the next episode's start."""

    def __init__(self, path: Path, *, fps: int, height: int, width: int, codec: VideoCodec) -> None:
        import av

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fps = fps
        self.codec = codec
        self.frames_written = 0
        self._container = av.open(str(path), mode="w", format="mp4")  # format named: the path may end in .tmp
        self._stream = self._container.add_stream(codec.encoder, rate=fps)
        self._stream.width, self._stream.height = width, height
        self._stream.pix_fmt = codec.pix_fmt
        self._stream.time_base = Fraction(1, fps)
        self._stream.codec_context.time_base = Fraction(1, fps)
        self._stream.options = codec.options()

    def write(self, frames: np.ndarray) -> None:
        """frames: uint8 [T, H, W, 3]."""
        import av

        for frame in frames:
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            vf.pts = self.frames_written
            vf.time_base = Fraction(1, self.fps)
            with same_scheduling():  # the first encode opens the encoder
                packets = self._stream.encode(vf)
            self._container.mux(packets)
            self.frames_written += 1

    def size_mb(self) -> float:
        return self.path.stat().st_size / 2**20 if self.path.exists() else 0.0

    def close(self) -> None:
        if self._container is not None:
            with same_scheduling():
                packets = self._stream.encode()
            self._container.mux(packets)
            self._container.close()
            self._container = None


def read_frames(path: Path, from_timestamp: float, n_frames: int, fps: int) -> np.ndarray:
    """The ``n_frames`` frames from ``from_timestamp`` seconds on -> uint8 [n, H, W, 3].

    Frames are matched to slots by their presentation time (nearest multiple of 1/fps), so a
    file whose time base is not 1/fps (re-muxed, other writers) still reads correctly.
    """
    import av

    if not path.is_file():
        raise FileNotFoundError(f"video file {path} does not exist")
    first = round(from_timestamp * fps)
    out: list[np.ndarray | None] = [None] * n_frames
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if first > 0:
            container.seek(int(from_timestamp / stream.time_base), stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            slot = round(float(frame.pts * stream.time_base) * fps) - first
            if slot >= n_frames:
                break
            if slot >= 0:
                out[slot] = frame.to_ndarray(format="rgb24")
    missing = [i for i, f in enumerate(out) if f is None]
    if missing:
        raise ValueError(f"{path}: no frame at {len(missing)} of {n_frames} timestamps from {from_timestamp:.4f}s (first missing: frame {missing[0]})")
    return np.stack(out)
