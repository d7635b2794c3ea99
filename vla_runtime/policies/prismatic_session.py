"""What every family over the Prismatic VLM shares: the policy's loaded parts and defaults
(``PrismaticPolicy``: OpenVLA, OpenVLA-OFT, CogACT, HybridVLA) and the episode (``PrismaticSession``:
the prompt, the cache with its chunk gate, the image input, the pinned-prompt prefill; OpenVLA, CogACT,
HybridVLA). ``ActionHeadSession`` adds what the families with their own action head share.

The step's tokens in both history modes (``SessionConfig.history``), one view:

- ``single``: ``[BOS] + image (+ proprio) + ids(prompt) + ids("\\nOut:") + suffix`` in one forward on a
  fresh cache (upstream's sequence; OpenVLA's proprio token follows the image, the heads' families end
  with it).
- ``history``: ``[BOS] + ids(prompt)`` once per episode, pinned; then per control step a frame,
  ``image (+ proprio) + ids("\\nOut:") + suffix`` (OpenVLA's starts with the previous step's last action
  token).

OpenVLA's suffix is ``[29871]`` and it decodes action tokens; CogACT's is ``[29871, 2]`` (EOS is the
cognition token); HybridVLA's is ``[29871, <BOD>]`` then its proprio token. Whatever a head appends after
the prefix (HybridVLA's diffusion and AR tokens) it rolls back, so the history holds observations and
prompts only; the cache decides how much of it stays.
"""

from __future__ import annotations

import abc
import time
from dataclasses import replace
from typing import ClassVar

import numpy as np
import torch

from ..config import CompileMode, SessionConfig
from ..device import synchronize
from ..kv import ChunkGate, KVCache, KVConfig, KVMode, make_cache
from ..kv.geometry import CacheGeometry
from ..models.prismatic.processing_prismatic import (
    ActionStats,
    Forward,
    Segment,
    SegmentKind,
    center_crop,
    history_prompt,
    resolve_unnorm_key,
)
from ..models.prismatic.prompt_prismatic import PromptIds
from ..models.prismatic.statistics import action_stats_entry
from .base import (
    PRIMARY_CAMERA, ActionPrefix, CompiledSession, EpisodeSession, Observation, StepResult, validate_instruction,
)  # fmt: skip
from .compiled import StepModules, step_modules

STATIC_SHAPE_CACHES = (KVMode.FULL, KVMode.CHUNKED)  # the caches a CUDA-graph session builds with static shapes


def parameter_count(module: torch.nn.Module | None) -> int:
    """Parameters of ``module`` (0 for ``None``: a part the checkpoint lacks), for ``Policy.info``."""
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


class PrismaticPolicy:
    """What the policies over the Prismatic VLM share (a mixin before ``Policy``: ``class X(PrismaticPolicy,
    Policy)``): the loaded parts, the default session settings and the ``ChunkGate`` (contract 3: owned by
    the policy, handed to chunked caches, trained by ``finetune/``).

    Args:
        checkpoint: the loaded checkpoint. config: the family's config (``norm_stats``). model: the weights.
        vlm: the Prismatic VLM inside ``model`` (vision towers, projector, LLaMA decoder).
        device, dtype: where the weights live (fixed at construction). kv: default cache for sessions.
        unnorm_key: default dataset key of the statistics (checked here: a wrong one fails at load).
        session: default ``SessionConfig`` of ``new_session(instruction)`` (its ``kv``/``unnorm_key`` are
            replaced by the two arguments above); a fine-tuned model brings the one it was trained for.
        kv_gate: the trained ``ChunkGate`` for a chunked ``KVConfig`` (``None`` = untrained default).
        base: what holds the tokenizer and image processor (default ``checkpoint``; OFT: its OpenVLA base).
    """

    name: ClassVar[str]
    session_class: ClassVar[type[EpisodeSession]]

    def __init__(self, checkpoint, config, model: torch.nn.Module, *, vlm: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype, kv: KVConfig | None = None, unnorm_key: str | None = None,
                 session: SessionConfig | None = None, kv_gate: ChunkGate | None = None, base=None) -> None:  # fmt: skip
        self.checkpoint = checkpoint
        self.config = config
        self.model = model
        self.vlm = vlm
        base = checkpoint if base is None else base
        self.tokenizer = base.tokenizer
        self.image_processor = base.image_processor
        self.device, self.dtype = device, dtype
        self.kv = kv or KVConfig()
        self.kv_gate = kv_gate
        self.session = session or SessionConfig()
        self._step_modules: dict[tuple[CompileMode, KVMode], StepModules] = {}
        if unnorm_key is not None:
            resolve_unnorm_key(self.norm_stats, unnorm_key)  # fail at load, not at the first step
        self.unnorm_key = unnorm_key

    @property
    def norm_stats(self) -> dict:
        return self.config.norm_stats

    @property
    def gate_geometry(self) -> CacheGeometry:
        return self.vlm.cfg.llm.geometry

    def chunk_gate(self, kv: KVConfig) -> ChunkGate | None:
        """The ``ChunkGate`` the cache of ``kv`` uses, ``None`` when it needs none (``KVConfig.gate_config``): the
        loaded one, else an untrained default (mean-pooling aggregator, keeps every chunk) built once for ``kv``'s
        chunk size and kept on the policy."""
        gate_cfg = kv.gate_config(self.gate_geometry)
        if gate_cfg is None:
            return None
        if self.kv_gate is None:
            self.kv_gate = ChunkGate(gate_cfg).to(self.device)
        return self.kv_gate

    def step_modules(self, mode: CompileMode, kv: KVMode) -> StepModules:
        """The vision and decoder callables a step runs for ``mode`` with a ``kv`` cache (``policies.compiled``),
        built once per pair and shared by the policy's sessions (compiled code included)."""
        if (mode, kv) not in self._step_modules:
            self._step_modules[mode, kv] = step_modules(self.vlm, mode, self.device)
        return self._step_modules[mode, kv]

    def new_cache(self, kv: KVConfig, compile_mode: CompileMode = CompileMode.OFF) -> KVCache:
        """One episode's cache (batch 1) of ``kv`` for the VLM's decoder, with the policy's ``ChunkGate`` when
        ``kv`` needs one. Sessions that replay CUDA graphs (``compile_mode`` ``REDUCE_OVERHEAD``) get a full or
        chunked cache with static shapes (``static_shapes=True``: one graph per forward length, not per held length
        and layout); the sink window and the other modes keep dynamic shapes. Eager sessions get a store that grows
        with the episode (``grow=True``: memory for what the robot holds, not for every position the model has);
        a compiled session's graphs take the buffers as inputs, so its store is allocated whole."""
        gate = self.chunk_gate(kv)
        extra = {} if gate is None else {"gate": gate}
        if compile_mode is CompileMode.OFF:
            extra["grow"] = True
        elif compile_mode is CompileMode.REDUCE_OVERHEAD and kv.mode in STATIC_SHAPE_CACHES:
            extra["static_shapes"] = True
        return make_cache(kv, self.gate_geometry, batch=1, device=self.device, dtype=self.dtype, **extra)

    def new_session(self, instruction: str, config: SessionConfig | None = None) -> EpisodeSession:
        validate_instruction(instruction)
        config = config or replace(self.session, kv=self.kv, unnorm_key=self.unnorm_key)
        if config.unnorm_key is None and self.unnorm_key is not None:
            config = replace(config, unnorm_key=self.unnorm_key)
        return self.session_class(self, instruction, config)

    def _info(self, head_name: str, head: torch.nn.Module, details: dict) -> dict:
        """``info()`` of a Prismatic run (CogACT, HybridVLA): the run and VLM, the family's ``details``, parameter
        counts (the whole model, the VLM and the action ``head`` as ``head_name``), datasets, device and dtype."""
        vlm = self.config.vlm
        run = self.checkpoint.run
        return {
            "family": self.name,
            "path": str(run.path),
            "checkpoint": run.checkpoint.name,
            "base_vlm": run.config.get("vla", {}).get("base_vlm"),
            "vision_backbone_id": vlm.vision.backbone_id,
            "image_tokens": vlm.vision.num_patches,
            "llm": {"dim": vlm.llm.dim, "layers": vlm.llm.n_layers, "heads": vlm.llm.n_heads, "vocab_size": vlm.llm.vocab_size},
            **details,
            "parameters": {"total": parameter_count(self.model), "vlm": parameter_count(self.vlm), head_name: parameter_count(head)},
            "datasets": sorted(self.norm_stats),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


class PrismaticSession(CompiledSession):
    """One episode over the Prismatic VLM: the prompt, the cache, the step's layout (see the module doc).

    Subclasses give the step's layout (``_layout``) and ``head_tokens``, and set what those read before
    calling ``__init__``, which builds the episode.
    """

    def __init__(self, policy: PrismaticPolicy, instruction: str, config: SessionConfig) -> None:
        super().__init__(instruction, config)
        self.policy = policy
        self.history = config.history.episodic
        self.modules = policy.step_modules(config.compile, config.kv.mode)
        self._build(instruction)

    @abc.abstractmethod
    def _layout(self) -> Forward:
        """The step's forward for ``self.prompt``: the whole single-mode sequence, or the history-mode frame."""

    @property
    @abc.abstractmethod
    def head_tokens(self) -> int:
        """Most tokens a step feeds after its prefix (decoded tokens, head tokens rolled back), for cache sizing."""

    def blank_observation(self) -> Observation:
        """A black primary image at the processor's size."""
        size = self.policy.image_processor.size
        return Observation(images={PRIMARY_CAMERA: np.zeros((size, size, 3), np.uint8)})

    def _step_frame(self) -> Forward:
        """This step's forward (the episode's ``frame`` unless a subclass varies it per step)."""
        return self.frame

    def _reset_head(self) -> None:
        """Forget per-episode head state (last tokens, ensembles)."""

    # ---- episode state ---------------------------------------------------------------------------

    def _build(self, instruction: str) -> None:
        """Tokenise the prompt, lay out the step and size the cache for it (single mode: the step is the whole
        context; history mode: the default raw window is one step)."""
        policy = self.policy
        self.instruction = instruction
        self.prompt = policy.tokenizer.prompt(instruction)
        self.frame = self._layout()
        step_tokens = self.frame.length(policy.vlm.cfg.vision.num_patches) + self.head_tokens
        self.kv_config = self.config.kv.for_step(step_tokens, whole_context=not self.history)
        self.cache = policy.new_cache(self.kv_config, self.config.compile)
        self._pinned = False

    @torch.inference_mode()  # the cache holds inference tensors from the steps; clear them in the same mode
    def reset(self, instruction: str | None = None) -> None:
        if instruction is not None:
            validate_instruction(instruction)  # before anything of the episode changes
        if instruction is not None and instruction != self.instruction:
            with torch.inference_mode(False):  # a new cache of normal tensors, like the first one (``__init__``):
                self._build(instruction)  # compiled graphs guard on the kind, so an inference-mode cache recompiles
        else:
            self.cache.reset()
            self._pinned = False
        self._reset_head()

    # ---- the phases of a step --------------------------------------------------------------------

    def check_observation(self, obs: Observation) -> None:
        """``ValueError`` for an observation ``step`` would refuse (its image, its state); nothing of the episode
        changes. What a server checks before a step it runs alone (``serve`` with ``compile``), as ``step_batch``
        checks every row first."""
        self.pixels(obs)
        self._proprio_tokens(obs)
        self.check_prefix(obs.prefix)

    def check_prefix(self, prefix: ActionPrefix | None) -> None:
        """``ValueError`` for an ``Observation.prefix`` this session's head would refuse (checked before the step
        changes anything); a head that conditions on none ignores it."""

    def check_room(self) -> None:
        """``CacheFullError`` when the episode's cache (a bounded full cache, history mode) cannot take this step
        whole: the prompt first at the episode's start, then a step's tokens as the cache was sized for them
        (``_build``; OpenVLA's first step feeds one fewer, the action token later steps carry over); nothing
        changes. What ``step_batch`` checks for every row before any of them runs, so that one robot's full cache
        fails its own step only."""
        check = getattr(self.cache, "check_room", None)  # only a full cache is bounded; the others make room
        if check is None or not self.history:  # single mode starts every step from an empty cache sized for it
            return
        patches = self.policy.vlm.cfg.vision.num_patches
        prompt = 0 if self._pinned else history_prompt(self.prompt).length(patches)
        check(prompt + self.frame.length(patches) + self.head_tokens)

    def pixels(self, obs: Observation) -> torch.Tensor:
        """The primary camera's pixel values [1, 3 * towers, S, S] (``ValueError`` for a missing or bad image;
        nothing of the episode changes)."""
        policy = self.policy
        if PRIMARY_CAMERA not in obs.images:
            raise ValueError(f"observation has no {PRIMARY_CAMERA!r} image; cameras given: {sorted(obs.images)}")
        image = obs.images[PRIMARY_CAMERA]
        if self.config.center_crop:
            image = center_crop(image, size=policy.image_processor.size)
        return policy.image_processor(image)[None].to(policy.device, policy.dtype)

    def context(self, image_tokens: torch.Tensor, proprio: list[torch.Tensor], timings: dict) -> torch.Tensor:
        """The step's prefix embeddings [1, T, dim], not yet in the cache, from its image tokens [1, N, dim] and
        proprio tokens ([1, 1, dim] each): history mode pins the prompt at the episode's first step (one forward
        of its own, counted in ``timings["prefill"]``), single mode starts from an empty cache."""
        vlm = self.policy.vlm
        if self.history and not self._pinned:
            t0 = time.perf_counter()
            prompt = vlm.embed_forward(history_prompt(self.prompt), images=[])
            self.modules.decoder(inputs_embeds=prompt, cache=self.cache, pin=True)
            self._pinned = True
            timings["prefill"] = timings.get("prefill", 0.0) + (time.perf_counter() - t0) * 1e3
        elif not self.history:
            self.cache.reset()
        return vlm.embed_forward(self._step_frame(), images=[image_tokens], proprio=proprio)


def frame_layout(prompt: PromptIds, *, history: bool, suffix: tuple[int, ...], proprio: bool) -> Forward:
    """An action-head family's step forward: the whole single-mode sequence, or the history-mode frame (see the
    module doc; the proprio token comes last)."""
    tail = (Segment(SegmentKind.PROPRIO),) if proprio else ()
    out = Segment(SegmentKind.TEXT, (*prompt.out, *suffix))
    if history:
        return Forward((Segment(SegmentKind.IMAGE), out, *tail))
    head = (Segment(SegmentKind.TEXT, (prompt.bos,)), Segment(SegmentKind.IMAGE))
    return Forward((*head, Segment(SegmentKind.TEXT, (*prompt.instruction, *prompt.out, *suffix)), *tail))


class ActionHeadSession(PrismaticSession):
    """One episode of a family that hands the LLM's output to its own action head (CogACT, HybridVLA): the
    dataset statistics, the noise generator (seeded with ``SessionConfig.seed``, re-seeded on ``reset``).

    Subclasses give the prompt ``_suffix`` and ``uses_proprio``, say how many tokens their head appends after
    the prefix (``head_tokens``), and implement ``_act`` (the step's prefix -> actions).
    """

    uses_proprio: bool = False

    def __init__(self, policy: PrismaticPolicy, instruction: str, config: SessionConfig) -> None:
        self.unnorm_key = resolve_unnorm_key(policy.norm_stats, config.unnorm_key)
        stats = action_stats_entry(policy.norm_stats, self.unnorm_key)
        self.action_stats = ActionStats.from_dict(stats, what=f"{self.unnorm_key} action")
        self.generator = torch.Generator().manual_seed(config.seed)
        super().__init__(policy, instruction, config)

    @abc.abstractmethod
    def _suffix(self, prompt: PromptIds) -> tuple[int, ...]:
        """Ids appended after ``\nOut:``."""

    @abc.abstractmethod
    def _act(self, embeds: torch.Tensor, obs: Observation, timings: dict) -> np.ndarray:
        """embeds: [1, T, dim] the step's prefix, not yet in the cache -> actions [horizon, action_dim].
        ``_prefill`` runs it as one forward; a head may instead fuse it with its first forward."""

    def _layout(self) -> Forward:
        return frame_layout(self.prompt, history=self.history, suffix=self._suffix(self.prompt), proprio=self.uses_proprio)

    def _prefill(self, embeds: torch.Tensor, timings: dict) -> torch.Tensor:
        """One forward of the step's prefix into the cache -> final (post-norm) hidden states [1, T, dim]."""
        start = time.perf_counter()
        hidden = self.modules.decoder(inputs_embeds=embeds, cache=self.cache)
        synchronize(self.policy.device)
        timings["prefill"] = timings.get("prefill", 0.0) + (time.perf_counter() - start) * 1e3
        return hidden

    def _proprio_tokens(self, obs: Observation) -> list[torch.Tensor]:
        """[1, 1, dim] per proprio segment (none by default)."""
        return []

    @torch.inference_mode()
    def reset(self, instruction: str | None = None) -> None:
        super().reset(instruction)
        self.generator.manual_seed(self.config.seed)

    @torch.inference_mode()
    def _step(self, obs: Observation) -> StepResult:
        policy = self.policy
        start = time.perf_counter()
        self.check_prefix(obs.prefix)
        image_tokens = self.modules.embed_image(self.pixels(obs))  # [1, N, dim]
        proprio = self._proprio_tokens(obs)
        synchronize(policy.device)
        timings = {"vision": (time.perf_counter() - start) * 1e3}
        actions = self._act(self.context(image_tokens, proprio, timings), obs, timings)
        timings["total"] = (time.perf_counter() - start) * 1e3
        return StepResult(actions=actions, timings=timings, kv=self.cache.stats())
