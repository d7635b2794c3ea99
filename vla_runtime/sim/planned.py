"""The planner drives the policy in closed loop: the episode's events go into the planner's KEEP memory,
the planner's next subtask becomes the policy's instruction (issue 20, through the runtime API).

Per subtask: ``planner.next_subtask(goal, done)`` (retrieval over the memory, KEEP prefill, greedy
decoding) -> the policy's session is reset to that instruction -> ``subtask_steps`` control steps in the
simulator (or fewer, if the episode ends) -> one event line into the memory: the subtask, the steps it ran,
where the robot is and whether the task is done. The next plan sees it. The ROS bringup does the same over
topics (the planner node publishes the subtask on the policy's ``instruction``).

    planner = Planner(load_causal_lm(model_dir, tokenizer=True), EmbodiedMemory(SentenceEncoder()))
    result = run_planned_episode(env, load_policy(ckpt), planner, "drawer-open-v3", seed=0,
                                 config=PlannedConfig(subtask_steps=40))
    [s.instruction for s in result.subtasks]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..api import ActionQueue, Policy
from ..config import SessionConfig
from ..memory.planner import Planner
from .base import SimEnv, SimObservation


@dataclass
class PlannedConfig:
    """Args:
    goal: what the planner plans for (``None``: the task's own instruction).
    subtask_steps: control steps each subtask runs before the planner is asked again.
    max_subtasks: subtasks before the episode ends (if the simulator has not ended it).
    """

    goal: str | None = None
    subtask_steps: int = 30
    max_subtasks: int = 6

    def __post_init__(self) -> None:
        if self.subtask_steps < 1 or self.max_subtasks < 1:
            raise ValueError(f"`subtask_steps` ({self.subtask_steps}) and `max_subtasks` ({self.max_subtasks}) must be >= 1")


@dataclass
class Subtask:
    """One planned subtask: the instruction the policy ran, from which control step, for how many steps; the
    plan's time to first token and the memory segments its prompt held."""

    instruction: str
    first_step: int
    steps: int
    plan_ttft_ms: float
    retrieved: tuple[str, ...]


@dataclass
class PlannedEpisode:
    task: str
    seed: int
    goal: str
    success: bool
    steps: int
    subtasks: list[Subtask] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # what went into the memory, in order


def where(obs: SimObservation) -> str:
    """The robot's own state in words (the first three state values are the hand's position)."""
    x, y, z = (float(v) for v in np.asarray(obs.state, dtype=float)[:3])
    return f"the hand is at x {x:.2f}, y {y:.2f}, z {z:.2f}"


def run_planned_episode(env: SimEnv, policy: Policy, planner: Planner, task: str, seed: int, *,
                        config: PlannedConfig | None = None, session_config: SessionConfig | None = None) -> PlannedEpisode:
    """One episode of ``task`` in ``env`` in which ``planner`` chooses every instruction ``policy`` runs.

    An empty plan (the model stopped at once) falls back to the goal, so the policy always has an instruction.
    """
    config, session_config = config or PlannedConfig(), session_config or SessionConfig()
    obs = env.reset(task, seed)
    goal = config.goal or obs.instruction
    memory = planner.memory
    start = f"Episode start: the goal is to {goal.rstrip('.')}; {where(obs)}."
    memory.upsert("event:start", start)
    result = PlannedEpisode(task, seed, goal, False, 0, events=[start])
    session, done = None, False
    for k in range(config.max_subtasks):
        plan = planner.next_subtask(goal, [s.instruction for s in result.subtasks])
        instruction = plan.instruction.strip() or goal
        if session is None:
            session = policy.new_session(instruction, session_config)
        else:
            session.reset(instruction)
        queue = ActionQueue(session, horizon=session_config.execution_horizon)
        first = result.steps
        for _ in range(config.subtask_steps):
            action, _ = queue.next(obs.to_policy())
            obs, done, result.success, info = env.step(action)
            result.steps = info.step
            if done:
                break
        state = "done" if result.success else "not done yet"
        event = f"Subtask {k + 1}, {instruction.rstrip('.')}: ran {result.steps - first} steps; {where(obs)}; the goal is {state}."
        memory.upsert(f"event:{k + 1}", event)
        memory.advance(1)
        result.events.append(event)
        result.subtasks.append(Subtask(instruction, first, result.steps - first, plan.ttft_ms, plan.retrieved))
        if done:
            break
    return result
