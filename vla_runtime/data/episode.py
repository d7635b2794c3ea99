"""One episode as numpy arrays: what the dataset writer takes and the reader gives back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Episode:
    """Frames of one episode, time on the first axis.

    Args:
        images: camera name -> uint8 [T, H, W, 3] RGB.
        state: [T, S] float32 proprioception (``None`` for datasets without ``observation.state``).
        action: [T, A] float32, the action taken after seeing frame t.
        task: the instruction in natural language (the first frame's, when ``frame_tasks`` is given).
        frame_tasks: one instruction per frame, for episodes whose task changes part-way (LeRobot's per-frame
            ``task_index``); ``None``: every frame has ``task``.
    """

    images: dict[str, np.ndarray]
    state: np.ndarray | None
    action: np.ndarray
    task: str
    frame_tasks: list[str] | None = None

    def __len__(self) -> int:
        return int(self.action.shape[0])

    def tasks_per_frame(self) -> list[str]:
        """The instruction of every frame."""
        return list(self.frame_tasks) if self.frame_tasks is not None else [self.task] * len(self)

    def validate(self) -> None:
        """``ValueError`` naming the first field whose dtype or shape is inconsistent."""
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"episode `task` must be a non-empty string, got {self.task!r}")
        action = self.action
        if not isinstance(action, np.ndarray) or action.ndim != 2 or action.shape[0] < 1:
            raise ValueError(f"episode `action` must be an array [T >= 1, A], got {getattr(action, 'shape', type(action))}")
        n = action.shape[0]
        if self.frame_tasks is not None:
            if len(self.frame_tasks) != n or not all(isinstance(t, str) and t for t in self.frame_tasks):
                raise ValueError(f"episode `frame_tasks` must be {n} non-empty strings, one per frame")
            if self.frame_tasks[0] != self.task:
                raise ValueError(f"episode `task` {self.task!r} must be the first frame's task {self.frame_tasks[0]!r}")
        arrays = {"action": action} if self.state is None else {"action": action, "state": self.state}
        for name, value in arrays.items():
            if not isinstance(value, np.ndarray) or value.ndim != 2 or value.shape[0] != n:
                raise ValueError(f"episode `{name}` must be [T={n}, D], got {getattr(value, 'shape', type(value))}")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"episode `{name}` has non-finite values")
        for camera, frames in self.images.items():
            if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
                raise ValueError(
                    f"episode images[{camera!r}] must be uint8 [T, H, W, 3], got "
                    f"{getattr(frames, 'dtype', type(frames))} {getattr(frames, 'shape', '')}"
                )
            if frames.shape[0] != n:
                raise ValueError(f"episode images[{camera!r}] has {frames.shape[0]} frames, action has {n}")
