"""Memory tasks: Meta-World episodes whose success depends on something seen (or done) long before.

    MEMORY_TASKS["memory-reference"].sample(seed)   # one episode's cue, delay and layout
    MetaWorldEnv().reset("memory-counting", seed)   # the simulator runs them like any other task

Each task is a ``MemoryTask`` (``base.py``) over a real Meta-World v3 env; the README's memory-suite section
describes them. Nothing here imports MuJoCo at import time.
"""

from __future__ import annotations

from .base import Marker, MarkerShape, MemoryTask, Outcome
from .counting import CountingExpert, CountingTask
from .order import OrderTask
from .reference import ReferenceTask
from .tally import TallyTask

#: task name -> episode class
MEMORY_TASKS: dict[str, type[MemoryTask]] = {cls.name: cls for cls in (ReferenceTask, CountingTask, OrderTask, TallyTask)}
#: the CLI's ``memory`` group: the suite the shipped memory policies were trained and evaluated on (since
#: 2026-11-28 with ``memory-tally``, which counts what was seen; ``memory-counting``, whose presses a memoryless
#: policy reads off the frame, runs by its name)
MEMORY_GROUP: tuple[str, ...] = ("memory-reference", "memory-tally", "memory-order")
#: the camera the cues and the go lamp are placed and sized for (the demo policy's); from Meta-World's default
#: ``corner2`` the arm hides the lamp while it is held
MEMORY_CAMERA = "corner"


def chance_level(task: str) -> float | None:
    """Success rate of the best cue-blind answer in memory task ``task``; ``None`` for a task without a cue."""
    return MEMORY_TASKS[task].chance_level() if task in MEMORY_TASKS else None


def answers(task: str, infos: list[dict[str, float]]) -> dict[str, int]:
    """How the episodes of memory task ``task`` answered (``MemoryTask.answers``); ``{}`` for other tasks."""
    return MEMORY_TASKS[task].answers(infos) if task in MEMORY_TASKS else {}


def memory_task(name: str) -> type[MemoryTask]:
    """The memory task called ``name``; ``KeyError`` listing the known ones otherwise."""
    if name not in MEMORY_TASKS:
        raise KeyError(f"unknown memory task {name!r}; known: {', '.join(MEMORY_TASKS)}")
    return MEMORY_TASKS[name]


__all__ = [
    "MEMORY_CAMERA",
    "MEMORY_GROUP",
    "MEMORY_TASKS",
    "CountingExpert",
    "CountingTask",
    "Marker",
    "MarkerShape",
    "MemoryTask",
    "OrderTask",
    "Outcome",
    "ReferenceTask",
    "TallyTask",
    "answers",
    "chance_level",
    "memory_task",
]
