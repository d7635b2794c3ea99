"""What every frame of a dataset holds: cameras, state and action names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DatasetFeatures:
    """What every frame of the dataset holds.

    Args:
        cameras: camera name -> (height, width).
        state_names: one name per state dimension (``None``: no ``observation.state``).
        action_names: one name per action dimension.
    """

    cameras: dict[str, tuple[int, int]]
    state_names: list[str] | None
    action_names: list[str]

    def __post_init__(self) -> None:
        self.cameras = {str(k): (int(v[0]), int(v[1])) for k, v in self.cameras.items()}
        for camera, (h, w) in self.cameras.items():
            if "/" in camera or not camera:
                raise ValueError(f"camera name {camera!r} must be non-empty and contain no '/'")
            if min(h, w) < 1:
                raise ValueError(f"camera {camera!r} size must be (height, width) >= 1, got {(h, w)}")
        if not self.action_names:
            raise ValueError("`action_names` must name at least one action dimension")
