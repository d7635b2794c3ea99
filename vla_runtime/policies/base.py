"""The runtime's contract types: what a policy family implements and every edge calls (DESIGN §2).

``Observation`` in, ``StepResult`` out; a ``Policy`` makes ``EpisodeSession``s. Families live in
this package (``openvla``, ``cogact``, ``hybridvla``), built on ``vla_runtime.models``; edges reach
them through ``vla_runtime.api``.
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from ..config import CompileMode, SessionConfig
from ..images import PRIMARY_CAMERA, validate_image
from ..kv.base import KVStats
from ..kv.chunked_gated import ChunkedGatedCache

WARMUP_STEPS = 3  # steps a compiled session runs at creation: the first prefill, decodes at growing lengths,
# history mode's second frame and a compression (the chunked cache's first chunk forms by the third step)
MAX_WARMUP_STEPS = 64  # with the steps a session's ``_warm_up_pending`` adds (a wide window compresses late)

__all__ = [
    "PRIMARY_CAMERA", "ActionQueue", "BatchInputError", "CompiledSession", "EpisodeSession", "Observation", "Policy",
    "StepResult", "validate_image", "validate_instruction",
]

@dataclass
class Observation:
    """One control step's input.

    Args:
        images: camera name -> uint8 [H, W, 3] RGB; ``"primary"`` is the policy camera.
        state: optional proprioception [state_dim] (float).
        t: optional timestamp in seconds.
        prefix: actions already queued for the chunk this step predicts (``ActionPrefix``); policies that
            predict one action, or cannot condition on them, ignore it.
    """

    images: dict[str, np.ndarray]
    state: np.ndarray | None = None
    t: float | None = None
    prefix: ActionPrefix | None = None


@dataclass
class ActionPrefix:
    """What the robot has queued for the coming chunk's first rows (real-time chunking, ``Blend.RTC``): a
    policy that generates whole chunks may continue them instead of starting afresh (CogACT inpaints them).

    Args:
        actions: [n, action_dim] robot units; row ``i`` is for chunk row ``start + i`` (chunk row ``j`` serves
            the ``j``-th tick from the observation's frame).
        frozen: leading rows of ``actions`` that will have executed before the new chunk can land (the
            inference delay, in ticks).
        start: chunk rows before it are for ticks already executed (nothing to continue there).
    """

    actions: np.ndarray
    frozen: int
    start: int = 0

    def __post_init__(self) -> None:
        self.actions = np.asarray(self.actions, dtype=np.float64)
        if self.actions.ndim != 2 or not np.isfinite(self.actions).all():
            raise ValueError(f"ActionPrefix.actions must be finite numbers [n, action_dim], got shape {self.actions.shape}")
        for name in ("frozen", "start"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"ActionPrefix.{name} must be an integer >= 0, got {value!r}")


@dataclass
class StepResult:
    """One ``session.step``'s output.

    Args:
        actions: [horizon, action_dim] float, un-normalised robot units (horizon 1 for OpenVLA).
        timings: per-stage milliseconds (``vision``, ``prefill``, ``decode``/``denoise``, ``total``).
        kv: the cache's stats after this step.
    """

    actions: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)
    kv: KVStats = field(default_factory=KVStats)


def validate_instruction(instruction: object) -> str:
    """The instruction a session starts with: a string with some non-whitespace text, else ``ValueError``."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"instruction must be a non-empty task description, got {instruction!r}")
    return instruction


def finite_state(state: object) -> np.ndarray:
    """``Observation.state`` as float64, flattened; ``ValueError`` naming the bad values unless all are finite (a
    NaN would reach the actions and, in history mode, every later step's context)."""
    values = np.asarray(state, dtype=np.float64).reshape(-1)
    if not np.isfinite(values).all():
        raise ValueError(f"observation `state` must be finite numbers, got {values.tolist()}")
    return values


class BatchInputError(ValueError):
    """``Policy.step_batch`` refused observation ``index`` (``error`` says why) before any session changed."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(f"observation {index} of the batch: {error}")
        self.index = index
        self.error = error


class EpisodeSession(abc.ABC):
    """Single-episode state: the KV cache, gate state, action queue / ensemble. ``reset`` starts a new episode."""

    compiles: ClassVar[bool] = False  # runs a ``torch.compile``-d step (``SessionConfig.compile``)

    def __init__(self, instruction: str, config: SessionConfig) -> None:
        if config.compile is not CompileMode.OFF and not self.compiles:
            raise ValueError(
                f"`compile` is {config.compile.value!r}, but {type(self).__name__} runs eager only (the families "
                f"that compile: OpenVLA, OpenVLA-OFT, CogACT, HybridVLA); use {CompileMode.OFF.value!r}"
            )
        self.instruction = instruction
        self.config = config

    @abc.abstractmethod
    def step(self, obs: Observation) -> StepResult:
        """Run the policy on one observation."""

    @abc.abstractmethod
    def reset(self, instruction: str | None = None) -> None:
        """Forget the episode; optionally switch the instruction."""

    def retained_chunks(self) -> tuple[tuple[int, ...], ...]:
        """Per layer, the first token of each chunk the chunked cache holds (chronological; tokens counted
        like ``KVStats.tokens_seen``); ``()`` for other caches. What ``vla_runtime.sim.retention`` draws."""
        cache = getattr(self, "cache", None)
        return cache.retained_starts() if isinstance(cache, ChunkedGatedCache) else ()


class CompiledSession(EpisodeSession):
    """An episode whose step can run ``torch.compile``-d (``SessionConfig.compile``): every family here. The
    subclass implements ``_step`` and ``blank_observation`` and calls ``_start_compiled`` last in ``__init__``."""

    compiles = True
    _skip_guards = False  # compiled and warmed up (``_start_compiled``) with ``SessionConfig.compile_guards`` off
    warming = False  # inside ``warm_up``

    def step(self, obs: Observation) -> StepResult:
        """Run the policy on one observation (``_step``). A compiled session past its warm-up runs it evaluating
        only the guards that choose between its compiled graphs."""
        if self._skip_guards:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._step(obs)
        return self._step(obs)

    @abc.abstractmethod
    def _step(self, obs: Observation) -> StepResult:
        """One control step."""

    @abc.abstractmethod
    def blank_observation(self) -> Observation:
        """What ``warm_up`` steps on: black images of every camera the policy reads (and a zero state where it
        reads one)."""

    def warm_up(self, steps: int = WARMUP_STEPS) -> None:
        """Run ``steps`` steps on ``blank_observation`` (more while ``_warm_up_pending``, at most
        ``MAX_WARMUP_STEPS``), then ``reset``: compilation (and CUDA graph capture) happens here, at session
        creation, and not in the first control tick. The episode starts afresh."""
        blank = self.blank_observation()
        self.warming = True
        try:
            for step in range(MAX_WARMUP_STEPS):
                if step >= steps and not self._warm_up_pending():
                    break
                self.step(blank)
        finally:
            self.warming = False
        self.reset()

    def _warm_up_pending(self) -> bool:
        """Whether a graph the episode may need has still not compiled after the first ``steps`` (a state the
        first steps did not reach): ``warm_up`` then steps on. Nothing by default."""
        return False

    def _start_compiled(self) -> None:
        """With ``SessionConfig.compile`` on, warm up (compile now, not in the first control tick), then skip the
        guards unless ``compile_guards``."""
        if self.config.compile is not CompileMode.OFF:
            self.warm_up()
            self._skip_guards = not self.config.compile_guards


class Policy(abc.ABC):
    """A loaded model family. Subclasses set ``name`` (registry key) and ``config_class``."""

    name: ClassVar[str]
    config_class: ClassVar[type]
    batched_steps: ClassVar[bool] = False  # ``step_batch`` runs several sessions' steps as one batch

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "__abstractmethods__", None):
            for attr in ("name", "config_class"):
                if not hasattr(cls, attr):
                    raise TypeError(f"{cls.__name__} must define class attribute `{attr}`")

    @property
    @abc.abstractmethod
    def action_dim(self) -> int: ...

    @property
    def chunk_size(self) -> int:
        """Actions predicted per step (1 for OpenVLA, 16 for CogACT)."""
        return 1

    @abc.abstractmethod
    def new_session(self, instruction: str, config: SessionConfig | None = None) -> EpisodeSession:
        """A new episode for ``instruction`` (``validate_instruction``: empty or whitespace-only is a ``ValueError``)."""

    def step_batch(self, sessions: list[EpisodeSession], observations: list[Observation]) -> list[StepResult]:
        """One step of each of ``sessions`` (distinct sessions of this policy) on its observation, run as one
        batch; the same results as ``[s.step(o) for s, o in zip(sessions, observations)]`` up to float
        rounding of the batched matrix products. Observations are checked before any session changes: a bad
        one raises ``BatchInputError`` with its index. Only where ``batched_steps`` is true."""
        raise NotImplementedError(f"policy family {self.name!r} does not step sessions as a batch")

    @abc.abstractmethod
    def info(self) -> dict:
        """Family, sizes, parameter count, dataset keys (what ``vla-runtime info`` prints)."""


class ActionQueue:
    """Executes ``horizon`` actions of each predicted chunk, then asks for a new prediction.

    ``next(obs)`` returns the action to execute now and the ``StepResult`` when a prediction ran
    (``None`` when the action came from the queue). The ROS node and the simulators use it.
    """

    def __init__(self, session: EpisodeSession, horizon: int | None = None) -> None:
        if horizon is not None and horizon < 1:
            raise ValueError(f"execution horizon must be >= 1 or None, got {horizon}")
        self.session = session
        self.horizon = horizon
        self._queue: deque[np.ndarray] = deque()

    def next(self, obs: Observation) -> tuple[np.ndarray, StepResult | None]:
        result = None
        if not self._queue:
            result = self.session.step(obs)
            chunk = result.actions if self.horizon is None else result.actions[: self.horizon]
            self._queue.extend(np.asarray(a, dtype=np.float64) for a in chunk)
        return self._queue.popleft(), result

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)
