"""Policies and episodes over the shared Prismatic VLM for the diffusion families (CogACT, HybridVLA).

OpenVLA decodes action tokens; these families end the prompt with a family ``suffix`` and hand the
LLM's output to their own action head. The token layout in both history modes (one view):

- ``single``: ``[BOS] + image + ids(prompt) + ids("\\nOut:") + suffix (+ proprio)`` in one forward on a
  fresh cache (upstream's sequence).
- ``history``: ``[BOS] + ids(prompt)`` once per episode, pinned; then per control step
  ``image + ids("\\nOut:") + suffix (+ proprio)``.

CogACT's suffix is ``[29871, 2]`` (EOS is the cognition token); HybridVLA's is ``[29871, <BOD>]`` then
its proprio token. Whatever a head appends after the prefix (HybridVLA's diffusion and AR tokens) it
rolls back, so the history holds observations and prompts only; the cache decides how much of it stays.
"""

from __future__ import annotations

import abc
import time
from dataclasses import replace
from typing import ClassVar

import numpy as np
import torch

from ..config import SessionConfig
from ..device import synchronize
from ..kv import ChunkGate, KVConfig, make_cache
from ..kv.geometry import CacheGeometry
from ..models.openvla.processing_openvla import (
    ActionStats,
    Forward,
    Segment,
    SegmentKind,
    center_crop,
    history_prompt,
    resolve_unnorm_key,
)
from ..models.openvla.prompt_openvla import PromptIds
from .base import PRIMARY_CAMERA, EpisodeSession, Observation, StepResult, validate_instruction
from .gates import GateOwner


def frame_layout(prompt: PromptIds, *, history: bool, suffix: tuple[int, ...], proprio: bool) -> Forward:
    """A control step's forward: the whole single-mode sequence, or the history-mode frame (see module doc)."""
    tail = (Segment(SegmentKind.PROPRIO),) if proprio else ()
    out = Segment(SegmentKind.TEXT, (*prompt.out, *suffix))
    if history:
        return Forward((Segment(SegmentKind.IMAGE), out, *tail))
    head = (Segment(SegmentKind.TEXT, (prompt.bos,)), Segment(SegmentKind.IMAGE))
    return Forward((*head, Segment(SegmentKind.TEXT, (*prompt.instruction, *prompt.out, *suffix)), *tail))


class PrismaticPolicy(GateOwner):
    """What the CogACT and HybridVLA policies share (a mixin before ``Policy``: ``class X(PrismaticPolicy,
    Policy)``): the loaded run, the default session settings and the ``ChunkGate`` (contract 3: owned by
    the policy, handed to chunked caches, trained by ``finetune/``).

    Args:
        checkpoint: the run with its VLM loaded (``checkpoints.prismatic_vlm.load_prismatic``).
        config: the family's config (``norm_stats`` property). model: the weights (``vlm`` + the head).
        device, dtype: where the VLM lives. kv: default cache for sessions. unnorm_key: default dataset key.
    """

    name: ClassVar[str]
    session_class: ClassVar[type["PrismaticSession"]]

    def __init__(self, checkpoint, config, model: torch.nn.Module, *, device: torch.device, dtype: torch.dtype,
                 kv: KVConfig | None = None, unnorm_key: str | None = None) -> None:  # fmt: skip
        self.checkpoint = checkpoint
        self.config = config
        self.model = model
        self.vlm = model.vlm
        self.tokenizer = checkpoint.tokenizer
        self.image_processor = checkpoint.image_processor
        self.device, self.dtype = device, dtype
        self.kv = kv or KVConfig()
        self.kv_gate: ChunkGate | None = None  # a trained gate (see `with_trained_gate`), else built on first use
        if unnorm_key is not None:
            resolve_unnorm_key(self.norm_stats, unnorm_key)  # fail at load, not at the first step
        self.unnorm_key = unnorm_key

    @property
    def norm_stats(self) -> dict:
        return self.config.norm_stats

    @property
    def gate_geometry(self) -> CacheGeometry:
        return self.vlm.cfg.llm.geometry

    def new_session(self, instruction: str, config: SessionConfig | None = None) -> "PrismaticSession":
        validate_instruction(instruction)
        config = config or SessionConfig(kv=self.kv, unnorm_key=self.unnorm_key)
        if config.unnorm_key is None and self.unnorm_key is not None:
            config = replace(config, unnorm_key=self.unnorm_key)
        return self.session_class(self, instruction, config)

    def _info(self, head_name: str, head: torch.nn.Module, details: dict) -> dict:
        """``info()`` of a Prismatic family: the run and VLM, the family's ``details``, parameter counts (the whole
        model, the VLM and the action ``head`` as ``head_name``), datasets, device and dtype."""
        def count(module: torch.nn.Module) -> int:
            return sum(p.numel() for p in module.parameters())

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
            "parameters": {"total": count(self.model), "vlm": count(self.vlm), head_name: count(head)},
            "datasets": sorted(self.norm_stats),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


class PrismaticSession(EpisodeSession):
    """One episode of a diffusion-family policy: prompt, cache, noise generator, head state.

    Subclasses give the prompt ``_suffix`` and ``uses_proprio``, say how many tokens their head appends after
    the prefix (``head_tokens``, for cache sizing), and implement ``_act`` (the step's prefix -> actions).
    """

    uses_proprio: bool = False

    def __init__(self, policy: PrismaticPolicy, instruction: str, config: SessionConfig) -> None:
        super().__init__(instruction, config)
        self.policy = policy
        self.unnorm_key = resolve_unnorm_key(policy.norm_stats, config.unnorm_key)
        stats = policy.norm_stats[self.unnorm_key]
        if "action" not in stats:
            raise KeyError(f"dataset statistics {self.unnorm_key!r} have no 'action' entry (keys: {sorted(stats)})")
        self.action_stats = ActionStats.from_dict(stats["action"], what=f"{self.unnorm_key} action")
        self.history = config.history.episodic
        self.generator = torch.Generator().manual_seed(config.seed)
        self._build(instruction)

    @abc.abstractmethod
    def _suffix(self, prompt: PromptIds) -> tuple[int, ...]:
        """Ids appended after ``\nOut:``."""

    @property
    @abc.abstractmethod
    def head_tokens(self) -> int:
        """Most tokens the head appends after a step's prefix (rolled back before the next step)."""

    @abc.abstractmethod
    def _act(self, embeds: torch.Tensor, obs: Observation, timings: dict) -> np.ndarray:
        """embeds: [1, T, dim] the step's prefix, not yet in the cache -> actions [horizon, action_dim].
        ``_prefill`` runs it as one forward; a head may instead fuse it with its first forward."""

    def _prefill(self, embeds: torch.Tensor, timings: dict) -> torch.Tensor:
        """One forward of the step's prefix into the cache -> final (post-norm) hidden states [1, T, dim]."""
        start = time.perf_counter()
        hidden = self.policy.vlm.language_model.model(inputs_embeds=embeds, cache=self.cache)
        synchronize(self.policy.device)
        timings["prefill"] = timings.get("prefill", 0.0) + (time.perf_counter() - start) * 1e3
        return hidden

    def _reset_head(self) -> None:
        """Forget per-episode head state (ensembles)."""

    # ---- episode state ---------------------------------------------------------------------------

    def _build(self, instruction: str) -> None:
        policy = self.policy
        self.instruction = instruction
        self.prompt = policy.tokenizer.prompt(instruction)
        self.frame = frame_layout(self.prompt, history=self.history, suffix=self._suffix(self.prompt), proprio=self.uses_proprio)
        step_tokens = self.frame.length(policy.vlm.cfg.vision.num_patches) + self.head_tokens
        kv: KVConfig = self.config.kv
        kv = kv.for_step(step_tokens, whole_context=not self.history)
        self.kv_config = kv
        gate = policy.chunk_gate(kv)
        extra = {} if gate is None else {"gate": gate}
        self.cache = make_cache(kv, policy.vlm.cfg.llm.geometry, batch=1, device=policy.device, dtype=policy.dtype, **extra)
        self._pinned = False

    @torch.inference_mode()  # caches may hold inference tensors from the steps; clear them in the same mode
    def reset(self, instruction: str | None = None) -> None:
        if instruction is not None and instruction != self.instruction:
            self._build(instruction)
        else:
            self.cache.reset()
            self._pinned = False
        self.generator.manual_seed(self.config.seed)
        self._reset_head()

    # ---- one control step ------------------------------------------------------------------------

    def pixels(self, obs: Observation) -> torch.Tensor:
        """The primary camera's pixel values [1, C, S, S] (``ValueError`` for a missing or bad image; nothing of
        the episode changes)."""
        policy = self.policy
        if PRIMARY_CAMERA not in obs.images:
            raise ValueError(f"observation has no {PRIMARY_CAMERA!r} image; cameras given: {sorted(obs.images)}")
        image = obs.images[PRIMARY_CAMERA]
        if self.config.center_crop:
            image = center_crop(image, size=policy.image_processor.size)
        return policy.image_processor(image)[None].to(policy.device, policy.dtype)

    def _proprio_tokens(self, obs: Observation) -> list[torch.Tensor]:
        """[1, 1, dim] per proprio segment (none by default)."""
        return []

    def context(self, image_tokens: torch.Tensor, proprio: list[torch.Tensor], timings: dict) -> torch.Tensor:
        """The step's prefix embeddings [1, T, dim], not yet in the cache: history mode pins the prompt at the
        episode's first step (one forward of its own), single mode starts from an empty cache."""
        policy = self.policy
        if self.history and not self._pinned:
            t0 = time.perf_counter()
            prompt = policy.vlm.embed_forward(history_prompt(self.prompt), images=[])
            policy.vlm.language_model.model(inputs_embeds=prompt, cache=self.cache, pin=True)
            self._pinned = True
            timings["prefill"] = (time.perf_counter() - t0) * 1e3
        elif not self.history:
            self.cache.reset()
        return policy.vlm.embed_forward(self.frame, images=[image_tokens], proprio=proprio)

    @torch.inference_mode()
    def step(self, obs: Observation) -> StepResult:
        policy = self.policy
        start = time.perf_counter()
        image_tokens = policy.vlm.embed_image(self.pixels(obs))  # [1, N, dim]
        proprio = self._proprio_tokens(obs)
        synchronize(policy.device)
        timings = {"vision": (time.perf_counter() - start) * 1e3}
        actions = self._act(self.context(image_tokens, proprio, timings), obs, timings)
        timings["total"] = (time.perf_counter() - start) * 1e3
        return StepResult(actions=actions, timings=timings, kv=self.cache.stats())
