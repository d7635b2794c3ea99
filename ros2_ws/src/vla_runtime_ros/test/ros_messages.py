"""Messages for the ROS tests, built the way a driver or a broken publisher would: frames, raw images, raw CDR."""

from __future__ import annotations

import struct

import numpy as np
from sensor_msgs.msg import Image


def solid_image(seed: int, shape: tuple[int, int] = (48, 64)) -> np.ndarray:
    """A uint8 [H, W, 3] frame whose mean colour differs per ``seed`` (so its action does too)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(20, 235, size=3)
    noise = rng.integers(-20, 21, size=(*shape, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def raw_image_msg(pixels: np.ndarray, encoding: str, *, pad: int = 0, bigendian: bool = False) -> Image:
    """An Image built the way a camera driver would: rows of ``pixels`` (uint8 or uint16) + ``pad`` junk bytes."""
    h, w = pixels.shape[:2]
    rows = pixels.reshape(h, -1)
    if pixels.dtype.itemsize > 1:
        rows = rows.astype(">u2" if bigendian else "<u2")
    row_bytes = rows.view(np.uint8).reshape(h, -1)
    junk = np.full((h, pad), 0xAB, dtype=np.uint8)
    msg = Image(height=h, width=w, encoding=encoding, is_bigendian=int(bigendian))
    msg.step = row_bytes.shape[1] + pad
    msg.data = np.concatenate([row_bytes, junk], axis=1).tobytes()
    return msg


def string_cdr(payload: bytes) -> bytes:
    """A serialized std_msgs/String carrying arbitrary bytes (little-endian CDR), for non-UTF-8 input."""
    return b"\x00\x01\x00\x00" + struct.pack("<I", len(payload) + 1) + payload + b"\x00"
