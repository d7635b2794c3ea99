"""``OpenVLAOFTPolicy`` (family ``openvla-oft``) and its ``EpisodeSession``: a step returns a whole action
chunk decoded in parallel (``modeling_oft``), un-normalised with the checkpoint's dataset statistics.

Two history modes (``SessionConfig.history``):

- ``single`` (upstream's): each step is one stand-alone bidirectional forward of ``[BOS] + images (+ proprio)
  + prompt + 29871 + K*A zeros + </s>``; no cache is held.
- ``history``: one cache per episode (any ``KVConfig``). ``[BOS] + ids("In: ... {instruction}?")`` is
  prefilled once and pinned; each step appends and **keeps** its observation, ``images (+ proprio)``,
  attending causally to the history; then the step's action query ``ids("\nOut:") + 29871 + K*A zeros +
  </s>`` runs in a ``bidirectional_block`` (it sees the whole held history and itself both ways) and is
  rolled back, so the history holds observations only. The head reads the query's rows as in single mode.
  The diffusion variant keeps the same per step (pinned prompt once, then ``images (+ proprio)``); then every
  DDIM step runs its own query block ``[timestep token] + ids("\nOut:") + 29871 + K*A noisy-action tokens +
  </s>`` in a ``bidirectional_block`` (``OpenVLAOFT.denoise_history``), so a step adds no more tokens than the
  L1 variant's. A checkpoint trained single-frame has never seen this layout: history mode wants fine-tuning
  for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoints.openvla_oft import OFTCheckpoint, apply_oft_adapter, load_openvla_oft
from ..config import CompileMode, SessionConfig
from ..device import synchronize
from ..kv import KVConfig, KVMode
from ..kv.base import KVStats
from ..models.openvla_oft.configuration_oft import DIFFUSION_STEPS, OFTConfig, OFTPlatform
from ..models.openvla_oft.normalization_oft import BoundsStats
from ..models.prismatic.processing_prismatic import center_crop, resolve_unnorm_key
from ..models.prismatic.statistics import action_stats_entry, dataset_stats
from ..models.quantize import QuantMode
from ..models.speed import speed_up
from .base import (
    PRIMARY_CAMERA, CompiledSession, Observation, Policy, StepResult, finite_state, validate_image, validate_instruction,
)  # fmt: skip
from .compiled import compile_options, static_call
from .loading import plan_load
from .prismatic_session import PrismaticPolicy, parameter_count


class OpenVLAOFTSession(CompiledSession):
    """One episode: the prompt and the statistics; in history mode also the cache (see the module docstring).
    With ``SessionConfig.compile`` on, the vision (with FiLM), every LLM forward and the L1 head are the policy's
    compiled ones, warmed up when the session is created (``WARMUP_STEPS`` steps on black images and a zero
    state, then ``reset``, which re-seeds the diffusion variant's noise)."""

    def __init__(self, policy: OpenVLAOFTPolicy, instruction: str, config: SessionConfig) -> None:
        super().__init__(instruction, config)
        self.policy = policy
        self.history = config.history.episodic
        cfg = policy.config
        if not policy.norm_stats:
            raise ValueError(f"{policy.checkpoint.path} has no dataset statistics (dataset_statistics.json): OFT actions cannot be un-normalised")
        self.unnorm_key = resolve_unnorm_key(policy.norm_stats, config.unnorm_key)
        action = action_stats_entry(policy.norm_stats, self.unnorm_key)
        self.action_stats = BoundsStats.from_dict(action, cfg.normalization, what=f"{self.unnorm_key} action")
        if self.action_stats.dim != cfg.action_dim:
            raise ValueError(f"statistics {self.unnorm_key!r} have {self.action_stats.dim} action dims; the head predicts {cfg.action_dim}")
        self.proprio_stats = None
        if cfg.proprio_dim is not None:
            proprio = dataset_stats(policy.norm_stats, self.unnorm_key, "proprio")
            if proprio is None:
                raise ValueError(f"statistics {self.unnorm_key!r} have no `proprio` entry; the proprio projector needs one")
            self.proprio_stats = BoundsStats.from_dict(proprio, cfg.normalization, what=f"{self.unnorm_key} proprio")
        self.generator = torch.Generator().manual_seed(config.seed)  # the diffusion variant's starting noise
        self.modules = policy.oft_modules(config.compile, config.kv.mode)
        self._build(validate_instruction(instruction))
        self._start_compiled()

    def blank_observation(self) -> Observation:
        """Black images of every camera and, with a proprio projector, a zero state."""
        size, dim = self.policy.image_processor.size, self.policy.config.proprio_dim
        black = np.zeros((size, size, 3), np.uint8)
        return Observation(images=dict.fromkeys(self.policy.cameras, black), state=None if dim is None else np.zeros(dim))

    def _build(self, instruction: str) -> None:
        """Tokenise the prompt; history mode sizes the cache for one step (observation + query block)."""
        policy = self.policy
        self.instruction = instruction
        self.prompt = policy.tokenizer.prompt(instruction)
        with torch.inference_mode():
            self.language = policy.model.language(self.prompt)  # FiLM's conditioning [1, llm_dim], or None
        self.cache = None
        self._pinned = False
        if not self.history:
            return
        self.kv_config = self.config.kv.for_step(self.step_tokens(), whole_context=False)
        self.cache = policy.new_cache(self.kv_config, self.config.compile)

    def step_tokens(self) -> int:
        """History mode's tokens per step: the observation kept (images + proprio) and the query rolled back
        (with the diffusion variant's timestep token)."""
        cfg = self.policy.config
        observation = cfg.num_images * self.policy.checkpoint.base.config.vision.num_patches + (cfg.proprio_dim is not None)
        return observation + int(cfg.diffusion) + len(self.prompt.out) + 1 + cfg.action_tokens + 1

    @torch.inference_mode()  # the cache holds inference tensors from the steps; clear them in the same mode
    def reset(self, instruction: str | None = None) -> None:
        if instruction is not None:
            validate_instruction(instruction)  # before anything of the episode changes (the noise seed too)
        self.generator.manual_seed(self.config.seed)
        if instruction is not None and instruction != self.instruction:
            with torch.inference_mode(False):  # a new cache of normal tensors, like the first one (``__init__``):
                self._build(instruction)  # compiled graphs guard on the kind
        elif self.cache is not None:
            self.cache.reset()
            self._pinned = False

    def inputs(self, obs: Observation) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Validated, preprocessed inputs: pixels per camera [1, 3 * towers, S, S] and the normalised state
        [1, proprio_dim] (``None`` without a proprio projector)."""
        policy = self.policy
        missing = [c for c in policy.cameras if c not in obs.images]
        if missing:
            raise ValueError(f"observation lacks camera(s) {missing}; this policy reads {list(policy.cameras)}, given {sorted(obs.images)}")
        pixels = []
        for name in policy.cameras:
            image = validate_image(obs.images[name], name)
            if self.config.center_crop:
                image = center_crop(image, size=policy.image_processor.size)
            pixels.append(policy.image_processor(image)[None].to(policy.device, policy.dtype))  # [1, C, S, S]
        if self.proprio_stats is None:
            return pixels, None
        dim = policy.config.proprio_dim
        if obs.state is None or np.shape(obs.state) != (dim,):
            raise ValueError(f"this policy has a proprio projector: the observation needs `state` [{dim}], got {None if obs.state is None else np.shape(obs.state)}")
        state = self.proprio_stats.normalize(finite_state(obs.state))
        return pixels, torch.as_tensor(state, dtype=policy.dtype, device=policy.device)[None]  # [1, P]

    @torch.inference_mode()
    def _step(self, obs: Observation) -> StepResult:
        """One chunk -> ``StepResult.actions`` [chunk_size, action_dim] in robot units."""
        start = time.perf_counter()
        pixels, state = self.inputs(obs)
        model, device, decoder = self.policy.model, self.policy.device, self.modules.decoder
        image_tokens = self.modules.embed_images(pixels, self.language)
        proprio = None if state is None else model.embed_proprio(state)
        synchronize(device)
        t1 = time.perf_counter()
        cfg = self.policy.config
        if cfg.diffusion:  # the denoising loop ("decode"): per DDIM step a whole forward (single) or a query block (history) + the head
            noise = torch.randn((1, cfg.chunk_size, cfg.action_dim), generator=self.generator).to(device)  # [1, K, A], drawn on the CPU
            if self.history:
                self._keep_observation(image_tokens, proprio)
                synchronize(device)
                t_kept = time.perf_counter()
                normalized = model.denoise_history(self.prompt, noise, self.cache, decoder)[0].cpu().numpy()  # [K, A]
                kv = self.cache.stats()
            else:
                t_kept = t1
                embeds_len = len(self.prompt.input_ids) + image_tokens.shape[1] + (proprio is not None) + 1 + cfg.action_tokens + 1  # + time, </s>
                normalized = model.denoise(self.prompt, image_tokens, proprio, noise, decoder)[0].cpu().numpy()  # [K, A]
                kv = KVStats(positions_used=embeds_len, tokens_seen=embeds_len * cfg.diffusion_steps)
            t2 = time.perf_counter()
            actions = self.action_stats.unnormalize(normalized)
            t3 = time.perf_counter()
            timings = {"vision": (t1 - start) * 1e3, "prefill": (t_kept - t1) * 1e3, "decode": (t2 - t_kept) * 1e3, "total": (t3 - start) * 1e3}
            return StepResult(actions=actions, timings=timings, kv=kv)
        if self.history:
            hidden = self._history_hidden(image_tokens, proprio)
            kv = self.cache.stats()
        else:
            embeds, first = model.sequence(self.prompt, image_tokens, proprio)
            hidden = model.action_hidden(embeds, first, decoder)
            kv = KVStats(positions_used=embeds.shape[1], tokens_seen=embeds.shape[1])
        synchronize(device)
        t2 = time.perf_counter()
        normalized = self.modules.action_head(hidden).float()[0].cpu().numpy()  # [chunk, A]
        actions = self.action_stats.unnormalize(normalized)
        t3 = time.perf_counter()
        timings = {"vision": (t1 - start) * 1e3, "prefill": (t2 - t1) * 1e3, "decode": (t3 - t2) * 1e3, "total": (t3 - start) * 1e3}
        return StepResult(actions=actions, timings=timings, kv=kv)

    def _history_hidden(self, image_tokens: torch.Tensor, proprio: torch.Tensor | None) -> torch.Tensor:
        """History mode: pin the prompt (first step), keep the observation, evaluate the query block over the
        history and roll it back. image_tokens [1, num_images * N, dim], proprio [1, 1, dim] or None ->
        the head's rows [1, K * A, dim]."""
        model, decoder = self.policy.model, self.modules.decoder
        self._keep_observation(image_tokens, proprio)
        block, first = model.query_block(self.prompt)
        with self.cache.bidirectional_block():
            hidden = decoder(inputs_embeds=block, cache=self.cache)  # [1, Q, dim]
        return model.head_input(hidden, first)

    def _keep_observation(self, image_tokens: torch.Tensor, proprio: torch.Tensor | None) -> None:
        """History mode, both variants: pin the prompt (first step), then append and keep the observation
        (image_tokens [1, num_images * N, dim] + proprio [1, 1, dim] or None), causal over the history."""
        model, decoder = self.policy.model, self.modules.decoder
        if not self._pinned:
            decoder(inputs_embeds=model.history_prompt(self.prompt), cache=self.cache, pin=True)
            self._pinned = True
        decoder(inputs_embeds=model.observation(image_tokens, proprio), cache=self.cache)


@dataclass(frozen=True)
class OFTStepModules:
    """What an OFT step runs. ``embed_images``: ``OpenVLAOFT.embed_images``'s signature (pixels per camera, FiLM's
    language) -> image tokens [B, num_images * N, dim]; ``decoder``: ``LlamaModel.forward``'s; ``action_head``:
    the L1 head's rows [B, K * A, dim] -> [B, K, A]. Eager: the modules themselves."""

    embed_images: Callable[..., torch.Tensor]
    decoder: Callable[..., torch.Tensor]
    action_head: Callable[[torch.Tensor], torch.Tensor]


class OpenVLAOFTPolicy(PrismaticPolicy, Policy):
    """A loaded OFT checkpoint.

    Args (besides ``PrismaticPolicy``'s ``device``, ``dtype``, ``kv``, ``unnorm_key``, ``session``, ``kv_gate``):
        checkpoint: what ``load_openvla_oft`` returned.
        cameras: ``Observation.images`` keys of the model's images in its input order (third-person first,
            then wrist cameras); as many as the model was trained with (``num_images_in_input``).
        kv: default cache of history-mode sessions (single mode holds none). unnorm_key: checked only when the
            checkpoint has statistics (a session without them fails).
    """

    name = "openvla-oft"
    config_class = OFTConfig
    session_class = OpenVLAOFTSession
    config: OFTConfig

    def __init__(self, checkpoint: OFTCheckpoint, *, cameras: tuple[str, ...] = (PRIMARY_CAMERA,),
                 unnorm_key: str | None = None, **kw) -> None:  # fmt: skip
        if len(set(cameras)) != len(cameras):
            raise ValueError(f"cameras {cameras} name a camera twice; each image the model takes needs its own camera")
        if len(cameras) != checkpoint.config.num_images:
            raise ValueError(f"cameras {cameras} are {len(cameras)} names; the model takes {checkpoint.config.num_images} image(s)")
        stats = checkpoint.base.config.norm_stats
        super().__init__(checkpoint, checkpoint.config, checkpoint.model, vlm=checkpoint.model.vla, base=checkpoint.base,
                         unnorm_key=unnorm_key if stats else None, **kw)  # fmt: skip
        self.unnorm_key = unnorm_key
        self.cameras = cameras
        self._oft_modules: dict[tuple[CompileMode, KVMode], OFTStepModules] = {}

    def oft_modules(self, mode: CompileMode, kv: KVMode) -> OFTStepModules:
        """The callables a step runs for ``mode`` with a ``kv`` cache (history mode; single mode's forwards run
        on a ``BidirectionalPass``), eager or compiled, built once per pair and shared by the policy's sessions."""
        if (mode, kv) not in self._oft_modules:
            model = self.model
            if mode is CompileMode.OFF:
                parts = OFTStepModules(model.embed_images, model.vla.language_model.model, model.action_head)
            else:
                options = compile_options(mode, self.device)  # vision and head: one image size, one chunk
                parts = OFTStepModules(static_call(model.embed_images, **options), self.step_modules(mode, kv).decoder,
                                       static_call(model.action_head, **options))  # fmt: skip
            self._oft_modules[mode, kv] = parts
        return self._oft_modules[mode, kv]

    @property
    def norm_stats(self) -> dict:
        return self.checkpoint.base.config.norm_stats

    @property
    def action_dim(self) -> int:
        return self.config.action_dim

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def info(self) -> dict:
        cfg, base = self.config, self.checkpoint.base.config
        count, vla = parameter_count, self.vlm
        return {
            "family": self.name,
            "path": str(self.checkpoint.path),
            "platform": self.checkpoint.platform.value,
            "vision_backbone_id": base.vision.backbone_id,
            "image_tokens": base.vision.num_patches * cfg.num_images,
            "cameras": list(self.cameras),
            "llm": {"dim": base.llm.dim, "layers": base.llm.n_layers, "heads": base.llm.n_heads, "kv_heads": base.llm.n_kv_heads},
            "chunk_size": cfg.chunk_size,
            "action_dim": cfg.action_dim,
            "proprio_dim": cfg.proprio_dim,
            "normalization": cfg.normalization.value,
            "film": cfg.film,
            "diffusion": {"train_steps": cfg.diffusion_train_steps, "steps": cfg.diffusion_steps} if cfg.diffusion else None,
            "components": {k: v.name for k, v in self.checkpoint.components.items()},
            "parameters": {
                "total": count(self.model),
                "vision": count(vla.vision_backbone) + count(self.model.film),
                "projector": count(vla.projector) + count(self.model.proprio_projector) + count(self.model.noisy_action_projector),
                "llm": count(vla.language_model),
                "action_head": count(self.model.action_head),
            },
            "datasets": sorted(self.norm_stats),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def load_openvla_oft_policy(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    kv: KVConfig | None = None,
    adapter: str | Path | None = None,
    unnorm_key: str | None = None,
    platform: str | OFTPlatform | None = None,
    cameras: Sequence[str] = (PRIMARY_CAMERA,),
    diffusion_steps: int = DIFFUSION_STEPS,
    quantize: QuantMode = QuantMode.NONE,
    fuse: bool = False,
    prepack: bool = False,
) -> OpenVLAOFTPolicy:
    """Load an OpenVLA-OFT directory (``load_policy``'s OFT branch).

    platform: ``libero``/``bridge``/``aloha`` (chunk 8/5/25; default: matched by the components' sizes).
    cameras: the ``Observation.images`` keys fed as the model's images, third-person first (1 to 3).
    kv: the history-mode sessions' default cache (single mode holds none). ``session_config.json`` (in the
    adapter, else the checkpoint) gives the default session a fine-tuned model was trained for; a trained ``ChunkGate``
    (``gates.safetensors`` + ``kv_config.json``) in the adapter, else beside the checkpoint, is loaded. adapter: a ``vla_finetune``
    OFT output directory (``apply_oft_adapter``: LoRA merged, its action head / proprio projector and statistics).
    diffusion_steps: DDIM steps per chunk of the diffusion variant (upstream's 50); each session's noise is
    drawn from its own generator, seeded with ``SessionConfig.seed`` (re-seeded on ``reset``). quantize, fuse,
    prepack: the LLM's speed options, as OpenVLA's (``models.speed``, after the adapter; prepacking also reaches
    the action head's large layers).
    """
    if isinstance(platform, str):
        try:
            platform = OFTPlatform(platform)
        except ValueError:
            raise ValueError(f"platform {platform!r} is not one of {', '.join(p.value for p in OFTPlatform)}") from None
    plan = plan_load(path, device=device, dtype=dtype, kv=kv, unnorm_key=unnorm_key, adapter=adapter)
    dev, dt = plan.device, plan.dtype
    cameras = tuple(cameras)
    checkpoint = load_openvla_oft(path, device=dev, dtype=dt, platform=platform, num_images=len(cameras), diffusion_steps=diffusion_steps)
    if adapter is not None:
        apply_oft_adapter(checkpoint, Path(adapter), device=dev, dtype=dt)
    speed_up(checkpoint.model, checkpoint.model.vla.language_model.model.layers, quantize=quantize, fuse=fuse, prepack=prepack)
    return OpenVLAOFTPolicy(checkpoint, device=dev, dtype=dt, unnorm_key=plan.unnorm_key, cameras=cameras, kv=plan.kv,
                            kv_gate=plan.gate, session=plan.session)  # fmt: skip
