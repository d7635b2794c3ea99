"""``HybridVLAPolicy`` (family ``hybridvla``) and its ``EpisodeSession``.

Each step runs the shared prefix (``prismatic_session`` layout ending in ``29871, <BOD>, proprio``)
through the LLM once. Both branches use that cached prefix and roll their own tokens back:

- diffusion: DDIM (4 steps: t = 75, 50, 25, 0). In single mode the first step's forward is
  ``prefix + [t, x_0 .. x_fut]`` (so ``timings["denoise"]`` includes the prefix prefill; in history mode the
  prefix has its own forward, after which the cache may compress); every later step appends only ``[t, x]``
  and reads eps at the x positions (``denoise_on_cache``): no step re-runs the prefix;
- autoregressive: ``[t, x_noise] <EOD> 29871`` on the same prefix, then 7 greedy action tokens with
  their confidences.

Upstream prefills twice (once per branch) and, without its KV trick, once per DDIM step.
``StepResult.actions`` is the diffusion chunk ``[future_window + 1, 7]`` (one row upstream) whose first
action is replaced by the collaborative ensemble in ``diff+ar`` mode; ``[1, 7]`` in ``ar`` mode. The
session keeps the AR tokens, their confidences and whether the AR action was used
(``last_tokens``, ``last_confidences``, ``last_used_ar``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..checkpoints.prismatic_vlm import load_prismatic
from ..config import SessionConfig
from ..device import synchronize
from ..kv import KVConfig
from ..models.action_postprocess import postprocess_actions
from ..models.diffusion import DiffusionConfig, GaussianDiffusion
from ..models.hybridvla.configuration_hybridvla import (
    BOD_TOKEN_ID,
    EOD_TOKEN_ID,
    CollaborativeEnsembleConfig,
    HybridVLAConfig,
    HybridVLASamplingConfig,
)
from ..models.hybridvla.modeling_hybridvla import DiffusionHead, HybridVLA, decode_ar_actions, denoise_on_cache
from ..models.hybridvla.processing_hybridvla import STATE_LAYOUTS, ar_action_tokenizer, collaborative_ensemble, to_proprio
from ..models.prismatic.processing_prismatic import ActionStats
from ..models.prismatic.statistics import dataset_stats
from ..models.prismatic.prompt_prismatic import PromptIds
from ..models.quantize import QuantMode
from ..models.speed import speed_up
from .base import Observation, Policy, StepResult, finite_state
from .loading import plan_load
from .prismatic_session import ActionHeadSession, PrismaticPolicy

log = logging.getLogger(__name__)


class HybridVLASession(ActionHeadSession):
    """One episode: the cache, the noise generator, and the last AR tokens / confidences. With
    ``SessionConfig.compile`` on, the vision towers and every LLM forward of the step (prefill, the DDIM steps'
    short forwards, the AR branch's decode) run the policy's compiled modules, warmed up when the session is
    created (``WARMUP_STEPS`` steps on a black frame and a zero state, then ``reset``, which re-seeds the noise)."""

    uses_proprio = True

    def __init__(self, policy: HybridVLAPolicy, instruction: str, config: SessionConfig) -> None:
        super().__init__(policy, instruction, config)
        dim = policy.action_dim
        if self.action_stats.dim != dim:
            raise ValueError(f"statistics {self.unnorm_key!r} have {self.action_stats.dim} action dims; the model has {dim}")
        proprio = dataset_stats(policy.norm_stats, self.unnorm_key, "proprio")
        if proprio is None:
            raise KeyError(f"dataset statistics {self.unnorm_key!r} have no 'proprio' entry; HybridVLA normalises the robot state with it")
        self.proprio_stats = ActionStats.from_dict(proprio, what=f"{self.unnorm_key} proprio")
        if self.proprio_stats.dim != dim:
            raise ValueError(f"proprio statistics have {self.proprio_stats.dim} dims; the proprio embedder takes {dim}")
        self.last_tokens: np.ndarray | None = None  # [1, action_dim] AR ids
        self.last_confidences: np.ndarray | None = None  # [action_dim] max-softmax per AR token
        self.last_used_ar: bool | None = None
        self._start_compiled()

    def blank_observation(self) -> Observation:
        """A black image and a zero robot state."""
        return replace(super().blank_observation(), state=np.zeros(self.policy.action_dim))

    def _suffix(self, prompt: PromptIds) -> tuple[int, ...]:
        return (prompt.empty, BOD_TOKEN_ID)

    @property
    def head_tokens(self) -> int:
        chunk, dim = self.policy.config.head.chunk, self.policy.action_dim
        return max(1 + chunk, 1 + chunk + 2 + dim - 1)  # diffusion step; AR: [t, x] <EOD> 29871 + fed tokens

    def _reset_head(self) -> None:
        self.last_tokens = self.last_confidences = self.last_used_ar = None

    def _proprio_tokens(self, obs: Observation) -> list[torch.Tensor]:
        dim = self.policy.action_dim
        if obs.state is None:
            raise ValueError(
                f"HybridVLA needs the robot state: Observation.state = [{dim}] ([x, y, z, roll, pitch, yaw, gripper], "
                "upstream's cur_robot_state)"
            )
        if dim == 7:
            state = to_proprio(finite_state(obs.state), self.policy.state_layout)
        else:
            state = finite_state(obs.state)
            if state.shape != (dim,):
                raise ValueError(f"observation `state` has shape {np.shape(obs.state)}; HybridVLA expects [{dim}]")
        normed = np.clip(self.proprio_stats.normalize(state), -1.0, 1.0)  # upstream clips every dim, masked or not
        normed = torch.as_tensor(normed, dtype=self.policy.dtype, device=self.policy.device)
        return [self.policy.model.head.embed_proprio(normed[None])]

    def _noise(self) -> torch.Tensor:
        head = self.policy.model.head.cfg
        noise = torch.randn((1, head.chunk, head.action_dim), generator=self.generator)
        return noise.to(self.policy.device, self.policy.dtype)

    def _act(self, embeds: torch.Tensor, obs: Observation, timings: dict) -> np.ndarray:
        policy = self.policy
        model = policy.model
        run_diff, run_ar = policy.config.sampling.branches
        # single mode: the prefix goes in with the first DDIM step's tokens (one forward fewer). History mode
        # prefills it on its own: a cache only compresses after a forward without an open mark.
        fuse = run_diff and not self.history
        if not fuse:
            self._prefill(embeds, timings)
        draws = self.draw()
        normalized = ids = conf = None
        if run_diff:
            start = time.perf_counter()
            normalized = denoise_on_cache(model.lm, model.head, self.cache, policy.diffusion, draws.diff_noise,
                                          prefix=embeds if fuse else None, decoder=self.modules.decoder)[0]  # fmt: skip
            synchronize(policy.device)
            timings["denoise"] = (time.perf_counter() - start) * 1e3
        if run_ar:
            start = time.perf_counter()
            ids, conf = (x[0] for x in decode_ar_branch(policy, self.cache, draws.ar_noise, draws.t, self.prompt.empty,
                                                        decoder=self.modules.decoder))  # fmt: skip
            synchronize(policy.device)
            timings["decode"] = (time.perf_counter() - start) * 1e3
        return self.finish(normalized, ids, conf)

    def draw(self) -> "Draws":
        """This step's random draws from the session's generator, in the order every path takes them."""
        policy = self.policy
        run_diff, run_ar = policy.config.sampling.branches
        diff = self._noise() if run_diff else None
        if not run_ar:
            return Draws(diff, None, None)
        t = torch.randint(0, policy.diffusion.num_timesteps, (1,), generator=self.generator).to(policy.device)
        return Draws(diff, t, self._noise())

    def finish(self, normalized: torch.Tensor | None, ids: torch.Tensor | None, conf: torch.Tensor | None) -> np.ndarray:
        """The branches' outputs for this session (diffusion chunk [chunk, A] normalised; AR ids and confidences
        [A]) -> actions in robot units: the chunk with its first action ensembled, or the AR action [1, A]."""
        policy = self.policy
        diff = ar = None
        if normalized is not None:
            diff = postprocess_actions(normalized.float().cpu().numpy(), self.action_stats)  # [chunk, A]
        if ids is not None:
            self.last_tokens = ids.cpu().numpy()[None]
            self.last_confidences = conf.float().cpu().numpy()
            ar = postprocess_actions(policy.ar_tokens.normalized(self.last_tokens[0]), self.action_stats)  # [A]
        if diff is None:
            self.last_used_ar = True
            return ar[None]
        if ar is not None:
            diff[0], self.last_used_ar = collaborative_ensemble(diff[0], ar, self.last_confidences, policy.config.sampling.ensemble)
        return diff


@dataclass
class Draws:
    """One step's random inputs: the diffusion branch's noise [1, chunk, A]; the AR branch's t [1] and noise."""

    diff_noise: torch.Tensor | None
    t: torch.Tensor | None
    ar_noise: torch.Tensor | None


def decode_ar_branch(policy: "HybridVLAPolicy", cache, noise: torch.Tensor, t: torch.Tensor, empty_id: int,
                     decoder: Callable[..., torch.Tensor] | None = None):  # fmt: skip
    """The AR branch on the cached prefixes (rolled back afterwards): ids, confidences [B, action_dim]. ``decoder``:
    the LLM forward to run (default: the eager model)."""
    model = policy.model
    mark = cache.mark()
    ids, conf = decode_ar_actions(model.lm, model.head, cache, noise=noise, t=t, tail_ids=(EOD_TOKEN_ID, empty_id),
                                  n_tokens=policy.action_dim, decoder=decoder)  # fmt: skip
    cache.rollback(mark)
    return ids, conf


class HybridVLAPolicy(PrismaticPolicy, Policy):
    """A loaded HybridVLA run: the VLM with the diffusion modules, tokenizer, image transform, statistics.

    Args (besides ``PrismaticPolicy``'s):
        state_layout: how ``Observation.state`` is laid out (``STATE_LAYOUTS``); ``None`` = by its length.
    """

    name = "hybridvla"
    config_class = HybridVLAConfig
    session_class = HybridVLASession
    config: HybridVLAConfig
    model: HybridVLA

    def __init__(self, checkpoint, config: HybridVLAConfig, model: HybridVLA, *, state_layout: str | None = None, **kw) -> None:
        if state_layout is not None and state_layout not in STATE_LAYOUTS:
            raise KeyError(f"unknown state layout {state_layout!r}; known: {', '.join(STATE_LAYOUTS)}")
        super().__init__(checkpoint, config, model, **kw)
        self.state_layout = state_layout
        self.diffusion = GaussianDiffusion(config.sampling.diffusion)
        self.ar_tokens = ar_action_tokenizer(config.sampling.need_to_sub)

    batched_steps = True

    @property
    def action_dim(self) -> int:
        return self.config.head.action_dim

    def step_batch(self, sessions: list[HybridVLASession], observations: list[Observation]) -> list[StepResult]:
        from .hybridvla_batching import step_batch

        return step_batch(self, sessions, observations)

    @property
    def chunk_size(self) -> int:
        return 1 if self.config.sampling.mode == "ar" else self.config.head.chunk

    def info(self) -> dict:
        head, sampling = self.config.head, self.config.sampling
        return self._info("diffusion_modules", self.model.head, {
            "diffusion": {"action_dim": head.action_dim, "future_window": head.future_window,
                          "ddim_steps": sampling.diffusion.sample_steps},  # fmt: skip
            "mode": sampling.mode,
            "ensemble": {"rule": sampling.ensemble.rule, "threshold": sampling.ensemble.resolved_threshold},
            "ar_token_range": [self.ar_tokens.first_id, self.ar_tokens.last_id],
        })


def load_hybridvla_policy(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    kv: KVConfig | None = None,
    adapter: str | Path | None = None,
    unnorm_key: str | None = None,
    checkpoint: str | Path | None = None,
    tokenizer: str | Path | None = None,
    mode: str = "diff+ar",
    ddim_steps: int = 4,
    ensemble_rule: str = "code",
    ensemble_threshold: float | None = None,
    need_to_sub: int | None = None,
    state_layout: str | None = None,
    quantize: QuantMode = QuantMode.NONE,
    fuse: bool = False,
    prepack: bool = False,
) -> HybridVLAPolicy:
    """Load a HybridVLA run directory (``load_policy``'s HybridVLA branch).

    mode: ``diff+ar`` (default), ``diff`` or ``ar``. ddim_steps: 4 -> t in {75, 50, 25, 0}.
    ensemble_rule: ``code`` (sum of the first 6 AR confidences > 5.8, what upstream's sim.py runs) or
    ``paper`` (mean > 0.96); ensemble_threshold overrides the rule's default. need_to_sub: shift of the
    action token ids; default config.json's ``need_to_sub`` (the value training used), else 0.
    state_layout: the layout of ``Observation.state`` (``processing_hybridvla.STATE_LAYOUTS``: 7 = upstream's
    x, y, z, roll, pitch, yaw, gripper; 8 = RLBench's position + xyzw quaternion + gripper; 4 = Meta-World's
    position + gripper); ``None`` = by the state's length.
    ``future_action_window_size`` cannot be read from the weights: it comes from config.json (default 0).
    A trained ``ChunkGate`` beside the run (``gates.safetensors``) is loaded and, without ``kv``, sets the default cache,
    as does a ``session_config.json`` there (``loading.plan_load``). quantize, fuse, prepack: the LLM's speed
    options, as OpenVLA's (``models.speed``; prepacking also reaches the diffusion modules' large layers).
    """
    plan = plan_load(path, device=device, dtype=dtype, kv=kv, unnorm_key=unnorm_key, adapter=adapter, full_only="HybridVLA")
    dev, dt = plan.device, plan.dtype
    ckpt = load_prismatic(path, checkpoint=checkpoint, tokenizer=tokenizer, device=dev, dtype=dt)
    run_config = ckpt.run.config
    if need_to_sub is None:
        need_to_sub = int(run_config.get("need_to_sub", 0))
        log.info("action token ids: 32000 - %d - bin (need_to_sub from %s)", need_to_sub, "config.json" if "need_to_sub" in run_config else "the default")
    sampling = HybridVLASamplingConfig(
        mode=mode,
        diffusion=DiffusionConfig(sample_steps=ddim_steps),
        ensemble=CollaborativeEnsembleConfig(rule=ensemble_rule, threshold=ensemble_threshold),
        need_to_sub=need_to_sub,
    )
    future_window = int(run_config.get("future_action_window_size", 0))
    with torch.device("meta"):
        head = DiffusionHead(DiffusionHead.config_from_state_dicts(ckpt.modules, future_window=future_window))
    for name, expected in head.module_state_dicts().items():
        ckpt.run.check_module(name, ckpt.modules[name], expected)
    if dev.type != "meta":
        head.load_module_state_dicts(ckpt.modules, device=dev, dtype=dt)
    config = HybridVLAConfig(vlm=ckpt.config, head=head.cfg, sampling=sampling)
    model = HybridVLA(ckpt.vlm, head.eval())
    speed_up(model, ckpt.vlm.language_model.model.layers, quantize=quantize, fuse=fuse, prepack=prepack)
    return HybridVLAPolicy(
        ckpt, config, model, vlm=ckpt.vlm, device=dev, dtype=dt, kv=plan.kv,
        unnorm_key=plan.unnorm_key, session=plan.session, kv_gate=plan.gate, state_layout=state_layout,
    )  # fmt: skip
