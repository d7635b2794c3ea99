"""The policy node's worker side: episodes and steps of one ``EpisodeSession``.

Everything here runs on the node's one worker thread (``PolicyRunner``), never on an executor thread;
the node hands it jobs and takes what they return at its next control tick.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
from sensor_msgs.msg import Image
from vla_runtime.api import PRIMARY_CAMERA, ActionPrefix, Observation, Policy, StepResult
from vla_runtime.config import SessionConfig

from . import conversions
from .inputs import Frame


@dataclass
class EpisodeRequest:
    """A new episode asked for by an instruction, the reset service or activation."""

    instruction: str
    applied: threading.Event = field(default_factory=threading.Event)
    episode: int = 0  # set when applied
    error: str = ""
    frames_before: int = 0  # frames received before the episode started: never acted on in it


@dataclass
class StepOutcome:
    """What one worker step produced."""

    episode: int
    actions: np.ndarray  # [horizon, action_dim]: the chunk's first execution_horizon actions
    result: StepResult
    step_ms: float  # decoding + session.step
    frame: Frame
    started: float  # time.monotonic() when the step took its frame
    turnaround_s: float  # from the planned start to the actions: waking up, decoding, the step (what a plan needs)
    frame_wait_s: float = 0.0  # how long past its planned start the step waited for its frame (``frame_wait_ms``)


class BadInputError(ValueError):
    """A camera frame that cannot be decoded."""


class PolicyRunner:
    """The session of the current episode and the steps on it (worker thread only).

    Each step keeps the first ``session_config.execution_horizon`` actions of the predicted chunk (``None``:
    all); ``max_image_pixels``: larger frames are rejected at decoding.
    """

    def __init__(self, policy: Policy, session_config: SessionConfig, *, max_image_pixels: int) -> None:
        self.policy = policy
        self.session_config = session_config
        self.max_image_pixels = max_image_pixels
        self.session = None  # EpisodeSession, made by the first episode

    def start_episode(self, request: EpisodeRequest) -> EpisodeRequest:
        """A new session, or the current one reset to ``request.instruction``; failures go into ``request.error``."""
        try:
            if self.session is None:
                self.session = self.policy.new_session(request.instruction, self.session_config)
            else:
                self.session.reset(request.instruction)
        except Exception as e:  # noqa: BLE001 - reported to the service caller and on /diagnostics
            self.session = None
            request.error = f"could not start episode {request.episode}: {type(e).__name__}: {e}"
        return request

    def step(self, frame: Frame, state: np.ndarray | None, *, episode: int, start_at: float,
             prefix: ActionPrefix | None = None) -> StepOutcome:
        """Decode ``frame`` and run ``session.step`` with ``state`` [state_dim] and the queued ``prefix``
        (``Blend.RTC``) (``BadInputError``: undecodable)."""
        started, start = time.monotonic(), time.perf_counter()
        try:
            if isinstance(frame.msg, Image):
                image = conversions.image_msg_to_array(frame.msg, max_pixels=self.max_image_pixels)
            else:
                image = conversions.compressed_msg_to_array(frame.msg, max_pixels=self.max_image_pixels)
        except ValueError as e:
            raise BadInputError(str(e)) from e
        obs = Observation(images={PRIMARY_CAMERA: image}, state=state, t=frame.stamp, prefix=prefix)
        result = self.session.step(obs)
        horizon = self.session_config.execution_horizon or len(result.actions)
        step_ms = (time.perf_counter() - start) * 1e3
        return StepOutcome(episode, np.asarray(result.actions[:horizon]), result, step_ms, frame, started,
                           time.monotonic() - start_at)

    def release(self) -> None:
        self.session = self.policy = None
