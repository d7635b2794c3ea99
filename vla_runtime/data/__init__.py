"""LeRobot-format datasets: write episodes of (images, state, action, task) and read them back.

    from vla_runtime.data import Episode, DatasetFeatures, WriterConfig, LeRobotWriter, LeRobotDataset
"""

from __future__ import annotations

from .episode import Episode
from .features import DatasetFeatures
from .reader import LeRobotDataset
from .video import VIDEO_CODECS
from .writer import LeRobotWriter, WriterConfig

__all__ = ["VIDEO_CODECS", "DatasetFeatures", "Episode", "LeRobotDataset", "LeRobotWriter", "WriterConfig"]
