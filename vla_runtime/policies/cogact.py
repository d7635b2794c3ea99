"""``CogACTPolicy`` (family ``cogact``) and its ``EpisodeSession``.

Each step: one prefill of the step's tokens (``prismatic_session`` layout, ending in ``29871, EOS``),
the cognition feature at EOS, DDIM over the DiT (CFG when ``cfg_scale > 1``), then clip, gripper
binarised at 0.5 and un-normalised. ``StepResult.actions`` is the whole ``[16, 7]`` chunk, which the
``ActionQueue`` executes k of n (``SessionConfig.execution_horizon``); with the adaptive ensemble on
(``ensemble_horizon=K``) it is the one ensembled action ``[1, 7]`` per step, as upstream's deploy.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..checkpoints.prismatic_vlm import load_prismatic
from ..config import CompileMode, SessionConfig
from ..device import synchronize
from ..kv import KVConfig
from ..models.action_postprocess import postprocess_actions
from ..models.cogact.configuration_cogact import AdaptiveEnsembleConfig, CogACTConfig, CogACTSamplingConfig, dit_config_from_run
from ..models.cogact.modeling_cogact import ActionModel, CogACT
from ..models.cogact.processing_cogact import AdaptiveEnsembler, cognition_suffix
from ..models.diffusion import DiffusionConfig, Inpaint, rtc_weights
from ..models.prismatic.prompt_prismatic import PromptIds
from ..models.quantize import QuantMode
from ..models.speed import speed_up
from .base import ActionPrefix, Observation, Policy, StepResult
from .compiled import CompiledDiT, compile_options
from .loading import plan_load
from .prismatic_session import ActionHeadSession, PrismaticPolicy


class CogACTSession(ActionHeadSession):
    """One episode: the cache (history mode), the noise generator and the adaptive ensemble's chunks. With
    ``SessionConfig.compile`` on, the vision towers, the decoder's layer pass and the DiT are the policy's
    compiled ones, warmed up when the session is created (``WARMUP_STEPS`` steps on a black frame, then
    ``reset``, which re-seeds the noise)."""

    def __init__(self, policy: CogACTPolicy, instruction: str, config: SessionConfig) -> None:
        ensemble = policy.config.sampling.ensemble
        self.ensembler = AdaptiveEnsembler(ensemble) if ensemble.horizon else None
        self.denoiser = policy.denoiser(config.compile)
        super().__init__(policy, instruction, config)
        if self.action_stats.dim != policy.action_dim:
            raise ValueError(
                f"statistics {self.unnorm_key!r} have {self.action_stats.dim} action dims; the DiT predicts {policy.action_dim}"
            )
        self._start_compiled()

    def _suffix(self, prompt: PromptIds) -> tuple[int, ...]:
        return cognition_suffix(prompt.empty, self.policy.config.vlm.eos_token_id)

    @property
    def head_tokens(self) -> int:
        return 0

    def _reset_head(self) -> None:
        if self.ensembler is not None:
            self.ensembler.reset()

    def _act(self, embeds: torch.Tensor, obs: Observation, timings: dict) -> np.ndarray:
        policy = self.policy
        hidden = self._prefill(embeds, timings)
        start = time.perf_counter()
        normalized = policy.model.action_model.sample(
            CogACT.cognition(hidden), cfg_scale=policy.config.sampling.cfg_scale, generator=self.generator,
            inpaint=None if obs.prefix is None else self._inpaint(obs.prefix), net=self.denoiser,
        )  # [1, chunk, A]
        synchronize(policy.device)
        timings["denoise"] = (time.perf_counter() - start) * 1e3
        return self.finish(normalized[0])

    def finish(self, normalized: torch.Tensor) -> np.ndarray:
        """One sampled chunk [chunk, A] (normalised) -> robot units: the chunk, or the ensemble's action [1, A]."""
        chunk = postprocess_actions(normalized.float().cpu().numpy(), self.action_stats)  # [chunk, A]
        if self.ensembler is None:
            return chunk
        return self.ensembler(chunk)[None]


    def check_prefix(self, prefix: ActionPrefix | None) -> None:
        """The queued actions must be rows of this policy's actions."""
        if prefix is not None and prefix.actions.shape[1] != self.policy.action_dim:
            raise ValueError(f"observation `prefix` rows have {prefix.actions.shape[1]} values; this policy's actions "
                             f"have {self.policy.action_dim}")  # fmt: skip

    def _inpaint(self, prefix: ActionPrefix) -> Inpaint | None:
        """The queued actions as the chunk's known rows (normalised; weights ``rtc_weights``), ``None`` if none fit."""
        chunk = self.policy.chunk_size
        n = max(0, min(len(prefix.actions), chunk - prefix.start))
        if n == 0:
            return None
        target = np.zeros((prefix.start + n, self.policy.action_dim))
        target[prefix.start :] = self.action_stats.normalize(np.asarray(prefix.actions[:n], dtype=np.float64))
        weight = np.concatenate([np.zeros(prefix.start), rtc_weights(n, prefix.frozen)])
        device = self.policy.device
        return Inpaint(torch.as_tensor(target, dtype=torch.float32, device=device)[None],
                       torch.as_tensor(weight, dtype=torch.float32, device=device))  # fmt: skip


class CogACTPolicy(PrismaticPolicy, Policy):
    """A loaded CogACT run: the VLM, the DiT (float32), tokenizer, image transform and statistics."""

    name = "cogact"
    config_class = CogACTConfig
    session_class = CogACTSession
    config: CogACTConfig
    model: CogACT

    batched_steps = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._denoisers: dict[CompileMode, nn.Module | CompiledDiT] = {}

    def denoiser(self, mode: CompileMode) -> nn.Module | CompiledDiT:
        """What sessions of ``mode`` predict the noise with: the DiT itself (``OFF``) or its compiled form, built
        once per mode and shared by the policy's sessions (compiled code included)."""
        if mode not in self._denoisers:
            net = self.model.action_model.net
            self._denoisers[mode] = net if mode is CompileMode.OFF else CompiledDiT(net, **compile_options(mode, self.device))
        return self._denoisers[mode]

    @property
    def action_dim(self) -> int:
        return self.config.action_model.action_dim

    def step_batch(self, sessions: list[CogACTSession], observations: list[Observation]) -> list[StepResult]:
        from .cogact_batching import step_batch

        return step_batch(self, sessions, observations)

    @property
    def chunk_size(self) -> int:
        return 1 if self.config.sampling.ensemble.horizon else self.config.action_model.chunk

    def info(self) -> dict:
        dit, sampling = self.config.action_model, self.config.sampling
        return self._info("action_model", self.model.action_model, {
            "action_model": {"hidden": dit.hidden, "depth": dit.depth, "heads": dit.heads, "chunk": dit.chunk,
                             "action_dim": dit.action_dim},  # fmt: skip
            "sampling": {"ddim_steps": sampling.diffusion.sample_steps, "cfg_scale": sampling.cfg_scale,
                         "ensemble_horizon": sampling.ensemble.horizon, "ensemble_alpha": sampling.ensemble.alpha},  # fmt: skip
        })


def load_cogact_policy(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    kv: KVConfig | None = None,
    adapter: str | Path | None = None,
    unnorm_key: str | None = None,
    checkpoint: str | Path | None = None,
    tokenizer: str | Path | None = None,
    cfg_scale: float = 1.5,
    ddim_steps: int = 10,
    ensemble_horizon: int | None = None,
    ensemble_alpha: float = 0.1,
    use_ema: bool = False,
    quantize: QuantMode = QuantMode.NONE,
    fuse: bool = False,
    prepack: bool = False,
) -> CogACTPolicy:
    """Load a CogACT run directory (``load_policy``'s CogACT branch).

    checkpoint: a ``.pt`` under ``checkpoints/`` (default: the only / latest one). tokenizer: directory or
    ``tokenizer.json`` of the LLaMA-2 tokenizer (default: the run directory's). cfg_scale: 1.5 as upstream
    (1 = no guidance). ddim_steps: 10 -> t in {90, ..., 0}. ensemble_horizon: K of the adaptive ensemble
    (2 Google robot, 7 WidowX; None = return whole chunks). use_ema: sample with ``ema_diffusion`` weights.
    device ``"meta"`` builds the structure only (``vla-runtime info``). A trained ``ChunkGate`` beside the run
    (``gates.safetensors``) is loaded and, without ``kv``, sets the default cache, as does a ``session_config.json``
    there (``loading.plan_load``). quantize, fuse, prepack: the LLM's speed options, as OpenVLA's
    (``models.speed``; prepacking also reaches the DiT's layers that are large enough).
    """
    plan = plan_load(path, device=device, dtype=dtype, kv=kv, unnorm_key=unnorm_key, adapter=adapter, full_only="CogACT")
    dev, dt = plan.device, plan.dtype
    ckpt = load_prismatic(path, checkpoint=checkpoint, tokenizer=tokenizer, device=dev, dtype=dt)
    head = "ema_diffusion" if use_ema else "action_model"
    ckpt.run.require(ckpt.modules, (head,), why="CogACT samples actions with its DiT")
    sampling = CogACTSamplingConfig(
        diffusion=DiffusionConfig(sample_steps=ddim_steps),
        cfg_scale=cfg_scale,
        ensemble=AdaptiveEnsembleConfig(horizon=ensemble_horizon, alpha=ensemble_alpha),
    )
    state = ckpt.modules[head]
    config = CogACTConfig(vlm=ckpt.config, action_model=dit_config_from_run(ckpt.run.config, state), sampling=sampling)
    with torch.device("meta"):
        action_model = ActionModel(config.action_model, sampling.diffusion)
    ckpt.run.check_module(head, state, action_model.state_dict())
    if dev.type != "meta":
        action_model.load_state_dict({k: v.to(dev, torch.float32) for k, v in state.items()}, strict=True, assign=True)
    model = CogACT(ckpt.vlm, action_model.eval())
    speed_up(model, ckpt.vlm.language_model.model.layers, quantize=quantize, fuse=fuse, prepack=prepack)
    return CogACTPolicy(ckpt, config, model, vlm=ckpt.vlm, device=dev, dtype=dt, kv=plan.kv,
                        unnorm_key=plan.unnorm_key, session=plan.session, kv_gate=plan.gate)  # fmt: skip
