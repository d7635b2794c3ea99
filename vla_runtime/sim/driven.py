"""Driven spells: the learner's own mistakes, labelled by the expert (``collect --driver CKPT --driven FRACTION``).

Detours (``memory/detour.py``) drive the arm toward a scripted wrong answer and speed noise (``memory/slowdown.py``)
hides the expert's own slowing down; neither puts the arm where a trained policy puts it. A *driven spell* does: for
``steps`` control steps from the go step of a reach-type memory task (reference, order, tally), the arm executes a
trained policy's actions, from its own session, which has seen every frame of the episode from the first, while the
dataset stores at every step the expert's action at the state reached (which steers toward the right answer). After
the spell the expert drives to the end, so the episode still succeeds and is kept like any other. The frames show
the states the learner itself gets into, the labels the way back: one round of DAgger (Ross, Gordon and Bagnell,
2011) with the expert taking over, against a history policy that copies its own motion.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .base import SimObservation
from .memory.base import MemoryTask
from .memory.detour import draw_disturbed

#: a spell lasts this many control steps (inclusive range): from a nudge to past the decision of memory-tally
DRIVEN_STEPS = (2, 16)
_STREAM = 0xD21E  # the spells' own random stream (independent of the cue's and of the detours'), per task and seed


@dataclass(frozen=True)
class DrivenSpell:
    """The arm executes the policy's actions chosen at observations ``start .. start + steps - 1``."""

    start: int
    steps: int

    @property
    def end(self) -> int:
        """The first observation after the spell: the policy must have seen every frame before it."""
        return self.start + self.steps

    def covers(self, t: int) -> bool:
        return self.start <= t < self.end

    def record(self) -> list[int]:
        """``[start, steps]``: what a dataset keeps per episode (``episode_driven``)."""
        return [self.start, self.steps]


def draw_spell(episode: MemoryTask, seed: int, fraction: float) -> DrivenSpell | None:
    """With probability ``fraction`` (drawn from ``seed`` and the task only, so a rerun or a resumed collection draws
    the same), a spell of 2-16 steps from ``episode``'s go step; ``None`` otherwise. ``ValueError`` for a task
    without a go step or a fraction outside [0, 1]."""
    rng = draw_disturbed(episode, seed, fraction, _STREAM, "driven spells")
    if rng is None:
        return None
    return DrivenSpell(episode.go_step, int(rng.integers(DRIVEN_STEPS[0], DRIVEN_STEPS[1] + 1)))


class PolicyDriver:
    """A trained policy in the session its checkpoint was trained for, run beside an expert rollout.

    ``start(instruction)`` opens a new session for an episode; ``act(observation)`` feeds it one frame and returns
    the 7-D action [7] (float32, policy units) it chooses there, through the same action queue as ``vla-runtime
    eval``; ``stop()`` frees the session."""

    def __init__(self, checkpoint: str | Path, *, device: str = "cpu") -> None:
        from ..api import load_policy

        self.checkpoint = Path(checkpoint)
        self.policy = load_policy(self.checkpoint, device=device)
        self._queue = None

    def start(self, instruction: str) -> None:
        from ..api import ActionQueue

        session = self.policy.new_session(instruction)
        self._queue = ActionQueue(session, horizon=self.policy.session.execution_horizon)

    def act(self, observation: SimObservation) -> np.ndarray:
        if self._queue is None:
            raise RuntimeError("PolicyDriver.act before start(): no session is open")
        action, _ = self._queue.next(observation.to_policy())
        return np.asarray(action, dtype=np.float32)

    def stop(self) -> None:
        self._queue = None
