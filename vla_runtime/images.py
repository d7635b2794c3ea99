"""Camera images: read from files at the edges (CLI, demos), and the uint8 [H, W, 3] RGB check every policy applies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

PRIMARY_CAMERA = "primary"  # the camera a policy sees (``Observation.images`` key)


def read_image(path: str | Path) -> np.ndarray:
    """An image file (PNG, JPEG, ...) as uint8 [H, W, 3] RGB; grey or RGBA images are converted."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image {path} does not exist")
    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"cannot read image {path}: {e}") from e


def validate_image(image: object, name: str = PRIMARY_CAMERA) -> np.ndarray:
    """Return ``image`` if it is a uint8 [H, W, 3] array, else raise ``ValueError`` saying what it is."""
    if not isinstance(image, np.ndarray):
        raise ValueError(f"image {name!r} must be a numpy uint8 array [H, W, 3], got {type(image).__name__}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
        raise ValueError(
            f"image {name!r} must be uint8 [H, W, 3] with H, W >= 1; got dtype {image.dtype}, shape {tuple(image.shape)}"
        )
    return image
