"""Reading camera images from files at the edges (CLI, demos): always uint8 [H, W, 3] RGB."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError


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
