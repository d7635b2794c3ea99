"""``OpenVLAPolicy`` (family ``openvla``) and its ``EpisodeSession``.

Three history modes (``SessionConfig.history``), all laid out by ``processing_openvla``:

- ``single``: stock OpenVLA. Each step prefills ``[BOS] + image (+ proprio) + prompt + [29871]`` into a
  fresh cache and decodes ``action_dim`` greedy tokens.
- ``history``: one cache for the episode. The prompt is prefilled once and pinned; each step appends
  ``[previous step's last action token] + image (+ proprio) + "\\nOut:" + [29871]`` and decodes.
  How much of the history is kept is the cache's business (``KVConfig.mode``).
- ``observations``: as ``history``, but the action tokens are decoded inside a cache mark and rolled back:
  each step appends ``image (+ proprio) + "\\nOut:" + [29871]`` only, so the policy reads its past frames,
  never its past actions.

Greedy decoding is restricted to the ``n_bins`` action token ids by default
(``decoding=ActionDecoding.FULL`` decodes over the full vocabulary, as upstream does).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..checkpoints.adapter import has_lora, merge_lora
from ..checkpoints.openvla import OpenVLACheckpoint, load_openvla
from ..config import ActionDecoding, HistoryMode, SessionConfig, from_dict
from ..device import resolve_device, resolve_dtype, synchronize
from ..kv import KVConfig, has_gate, load_gate, make_cache
from ..kv.geometry import CacheGeometry
from ..models.generation import TokenHead, decode
from ..models.openvla.configuration_openvla import OpenVLAConfig, read_json
from ..models.openvla.processing_openvla import (
    ActionStats,
    ActionTokenizer,
    center_crop,
    history_frame,
    history_prompt,
    resolve_unnorm_key,
    single_layout,
)
from .base import PRIMARY_CAMERA, EpisodeSession, Observation, Policy, StepResult, validate_instruction
from .gates import GateOwner

log = logging.getLogger(__name__)

SESSION_CONFIG = "session_config.json"  # the SessionConfig a fine-tuned model was trained for


class OpenVLAPolicy(GateOwner, Policy):
    """A loaded OpenVLA checkpoint: weights, tokenizer, image processor, statistics.

    Args:
        checkpoint: what ``vla_runtime.checkpoints.openvla.load_openvla`` returned.
        device, dtype: where the weights live (fixed at construction).
        kv: default cache for sessions (a session's ``SessionConfig.kv`` overrides it).
        unnorm_key: default dataset key of the action statistics.
        decoding: greedy over the action ids only (``ActionDecoding.ACTIONS``, default) or over the whole
            vocabulary (``FULL``, upstream's choice; ids outside the action range clip to the end bins).
        session: default ``SessionConfig`` of ``new_session(instruction)`` (its ``kv``/``unnorm_key`` are
            replaced by the two arguments above); a fine-tuned model brings the one it was trained for.
        kv_gate: the trained ``ChunkGate`` for a chunked ``KVConfig`` (``None`` = untrained default).
    """

    name = "openvla"
    config_class = OpenVLAConfig
    batched_steps = True

    def __init__(
        self,
        checkpoint: OpenVLACheckpoint,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kv: KVConfig | None = None,
        unnorm_key: str | None = None,
        decoding: ActionDecoding = ActionDecoding.ACTIONS,
        session: SessionConfig | None = None,
        kv_gate: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(decoding, ActionDecoding):
            raise TypeError(f"`decoding` must be an ActionDecoding ({', '.join(d.name for d in ActionDecoding)}), got {decoding!r}")
        self.checkpoint = checkpoint
        self.config: OpenVLAConfig = checkpoint.config
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        self.image_processor = checkpoint.image_processor
        self.device, self.dtype = device, dtype
        self.kv = kv or KVConfig()
        self.decoding = decoding
        # The learnable chunk aggregator/gate (vla_runtime.kv.gate.ChunkGate) for a chunked KVConfig;
        # owned here (contract 3), handed to the cache, trained by finetune/. Loaded from gates.safetensors
        # (beside the checkpoint or in an adapter directory); None = the untrained default, built by
        # `chunk_gate` on first use.
        self.kv_gate = kv_gate
        self.session = session or SessionConfig()
        if unnorm_key is not None:
            resolve_unnorm_key(self.config.norm_stats, unnorm_key)  # fail at load, not at the first step
        self.unnorm_key = unnorm_key

    @property
    def norm_stats(self) -> dict:
        return self.config.norm_stats

    @property
    def action_dim(self) -> int:
        """Actions per step: the statistics' size for the default key, else the config's."""
        if not self.norm_stats or (self.unnorm_key is None and len(self.norm_stats) != 1):
            return self.config.action_dim
        return self.action_stats(self.unnorm_key).dim

    def action_stats(self, unnorm_key: str | None) -> ActionStats | None:
        """The action statistics for ``unnorm_key`` (``None`` when the checkpoint has none: actions stay normalised)."""
        if not self.norm_stats:
            return None
        key = resolve_unnorm_key(self.norm_stats, unnorm_key)
        return ActionStats.from_dict(self.norm_stats[key]["action"], what=f"{key} action")

    @property
    def gate_geometry(self) -> CacheGeometry:
        return self.config.llm.geometry

    def new_session(self, instruction: str, config: SessionConfig | None = None) -> "OpenVLASession":
        validate_instruction(instruction)
        config = config or replace(self.session, kv=self.kv, unnorm_key=self.unnorm_key)
        if config.unnorm_key is None and self.unnorm_key is not None:
            config = replace(config, unnorm_key=self.unnorm_key)
        return OpenVLASession(self, instruction, config)

    def step_batch(self, sessions: list["OpenVLASession"], observations: list[Observation]) -> list[StepResult]:
        """One step of each session as one batch (see ``openvla_batching``)."""
        from .openvla_batching import step_batch

        return step_batch(self, sessions, observations)

    def info(self) -> dict:
        cfg = self.config

        def count(module: torch.nn.Module | None) -> int:
            return sum(p.numel() for p in module.parameters()) if module is not None else 0

        llm = cfg.llm
        return {
            "family": self.name,
            "path": str(self.checkpoint.path),
            "vision_backbone_id": cfg.vision.backbone_id,
            "vision_towers": [
                {"timm_id": t.timm_id, "image_size": t.image_size, "patch_size": t.patch_size, "embed_dim": t.embed_dim,
                 "depth": t.depth, "num_heads": t.num_heads, "mlp_hidden": t.mlp_hidden, "patches": t.num_patches}
                for t in cfg.vision.towers
            ],  # fmt: skip
            "image_tokens": cfg.vision.num_patches,
            "projector": list(cfg.projector.dims),
            "llm": {"backbone_id": cfg.llm_backbone_id, "dim": llm.dim, "layers": llm.n_layers, "heads": llm.n_heads,
                    "kv_heads": llm.n_kv_heads, "ffn_dim": llm.ffn_dim, "vocab_size": llm.vocab_size,
                    "max_position": llm.max_position},  # fmt: skip
            "proprio_dim": cfg.proprio_dim,
            "action_dim": self.action_dim,
            "n_bins": cfg.n_bins,
            "parameters": {
                "total": count(self.model),
                "vision": count(self.model.vision_backbone),
                "projector": count(self.model.projector) + count(self.model.proprio_projector),
                "llm": count(self.model.language_model),
            },
            "datasets": sorted(self.norm_stats),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


class OpenVLASession(EpisodeSession):
    """One episode: the cache, the previous action token (history mode), the last tokens decoded."""

    def __init__(self, policy: OpenVLAPolicy, instruction: str, config: SessionConfig) -> None:
        super().__init__(instruction, config)
        self.policy = policy
        self.unnorm_key = resolve_unnorm_key(policy.norm_stats, config.unnorm_key) if policy.norm_stats else None
        stats = policy.action_stats(self.unnorm_key)
        if stats is None:
            log.warning("checkpoint has no action statistics: actions are returned normalised to [-1, 1]")
        cfg = policy.config
        self.action_dim = stats.dim if stats is not None else cfg.action_dim
        self.actions = ActionTokenizer(cfg.n_bins, cfg.vocab_size_text, stats)
        proprio = policy.norm_stats.get(self.unnorm_key, {}).get("proprio") if self.unnorm_key else None
        self.proprio_stats = ActionStats.from_dict(proprio, what="proprio") if proprio and cfg.proprio_dim else None
        self._history = config.history.episodic  # no bound methods kept on self: a dropped session is freed at once
        self._keeps_actions = config.history is not HistoryMode.OBSERVATIONS  # observations: decodes rolled back
        self.last_tokens: np.ndarray | None = None  # [1, action_dim] ids of the last step
        self._build(instruction)

    # ---- episode state ---------------------------------------------------------------------------

    def _build(self, instruction: str) -> None:
        """Tokenise the prompt and size the cache for it."""
        policy, cfg = self.policy, self.policy.config
        self.instruction = instruction
        self.prompt = policy.tokenizer.prompt(instruction)
        kv = self._plan_history(self.config.kv) if self._history else self._plan_single(self.config.kv)
        self.kv_config = kv
        gate = policy.chunk_gate(kv)
        extra = {} if gate is None else {"gate": gate}
        self.cache = make_cache(kv, cfg.llm.geometry, batch=1, device=policy.device, dtype=policy.dtype, **extra)
        self._prev_token: int | None = None
        self._pinned = False

    def _plan_single(self, kv: KVConfig) -> KVConfig:
        """Single mode: lay out the step; its tokens are the whole context (capacity, default window)."""
        cfg = self.policy.config
        self.layout = single_layout(self.prompt, has_proprio=cfg.proprio_dim is not None)
        tokens = self.layout.length(cfg.vision.num_patches) + self.action_dim - 1
        return kv.for_step(tokens, whole_context=True)

    def _plan_history(self, kv: KVConfig) -> KVConfig:
        """History mode: the default raw window is one control step's tokens."""
        cfg = self.policy.config
        frame = history_frame(self.prompt, step=0, prev_token=0, has_proprio=cfg.proprio_dim is not None)
        return kv.for_step(frame.length(cfg.vision.num_patches) + self.action_dim - 1, whole_context=False)

    @torch.inference_mode()  # the cache holds inference tensors from the steps; clear them in the same mode
    def reset(self, instruction: str | None = None) -> None:
        if instruction is not None and instruction != self.instruction:
            self._build(instruction)
        else:
            self.cache.reset()
            self._prev_token, self._pinned = None, False
        self.last_tokens = None

    # ---- one control step ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, obs: Observation) -> StepResult:
        start = time.perf_counter()
        timings = {"vision": 0.0, "prefill": 0.0, "decode": 0.0}
        pixels, state = self.inputs(obs)
        image_tokens, proprio = self._embed_observation(pixels, state)
        synchronize(self.policy.device)
        timings["vision"] = (time.perf_counter() - start) * 1e3
        embeds = self.context(image_tokens, proprio, timings)
        return self.finish(self._decode(embeds, timings), timings, start)

    # ---- the phases of a step (``openvla_batching`` runs them for several sessions at once) ------------

    def inputs(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validate and preprocess: pixel values [1, 3 * towers, S, S] and the proprio input [1, P] (``None``
        without a proprio projector). Raises ``ValueError`` on bad input; the episode is untouched."""
        policy = self.policy
        if PRIMARY_CAMERA not in obs.images:
            raise ValueError(f"observation has no {PRIMARY_CAMERA!r} image; cameras given: {sorted(obs.images)}")
        image = obs.images[PRIMARY_CAMERA]
        if self.config.center_crop:
            image = center_crop(image, size=policy.image_processor.size)
        pixels = policy.image_processor(image)[None].to(policy.device, policy.dtype)  # [1, C, S, S]
        state = self.state_input(obs.state) if policy.config.proprio_dim is not None else None
        return pixels, state

    def _embed_observation(self, pixels: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixels [B, C, S, S], state [B, P] or None -> image tokens [B, N, dim] and proprio tokens ([B, 1, dim] or [])."""
        model = self.policy.model
        return model.embed_image(pixels), ([] if state is None else [model.embed_proprio(state)])

    def state_input(self, state: np.ndarray | None) -> torch.Tensor:
        """Proprioception [P] in robot units -> the proprio projector's input [1, P] (q01/q99-normalised
        with the session's dataset statistics when they have ``proprio`` entries)."""
        dim = self.policy.config.proprio_dim
        if state is None:
            raise ValueError(f"this policy has a proprio projector: the observation needs `state` [{dim}]")
        raw = state
        state = np.asarray(state, dtype=np.float64).reshape(-1)
        if state.shape != (dim,):
            raise ValueError(f"observation `state` has shape {np.shape(raw)}; this policy expects [{dim}]")
        if self.proprio_stats is not None:
            state = self.proprio_stats.normalize(state)
        return torch.as_tensor(state, dtype=self.policy.dtype, device=self.policy.device)[None]  # [1, P]

    def token_head(self) -> TokenHead:
        """How action tokens are picked (``policy.decoding``): greedy over the whole vocabulary, or over the
        action ids only, computing just those rows of ``lm_head`` (the same numbers as the full head's rows,
        125x less work)."""
        lm_head = self.policy.model.language_model.lm_head
        if self.policy.decoding is ActionDecoding.FULL:
            return TokenHead(lm_head)
        return TokenHead(lm_head, id_range=(self.actions.first_id, self.actions.last_id))

    def _decode(self, embeds: torch.Tensor, timings: dict) -> torch.Tensor:
        """Forward ``embeds`` [1, T, dim], then decode the action tokens -> ids [1, action_dim]."""
        policy, head = self.policy, self.token_head()
        decoder = policy.model.language_model.model
        start = time.perf_counter()
        logits = head.logits(decoder(inputs_embeds=embeds, cache=self.cache)[:, -1])
        synchronize(policy.device)
        timings["prefill"] += (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        mark = self.open_decode()
        ids = decode(lambda tok: head.logits(decoder(tok, cache=self.cache)[:, -1]), logits, head.pick,
                     max_new_tokens=self.action_dim)  # [1, action_dim]
        self.close_decode(mark)
        synchronize(policy.device)
        timings["decode"] = (time.perf_counter() - start) * 1e3
        return ids

    def open_decode(self) -> int | None:
        """Before the step's decode forwards: ``HistoryMode.OBSERVATIONS`` marks the cache (``close_decode``
        rolls them back, so the history holds frames only); ``None`` otherwise."""
        return None if self._keeps_actions else self.cache.mark()

    def close_decode(self, mark: int | None) -> None:
        """After the decode forwards: roll them back to ``open_decode``'s mark (if any)."""
        if mark is not None:
            self.cache.rollback(mark)

    def finish(self, ids: torch.Tensor, timings: dict, start: float) -> StepResult:
        """The step's action ids [1, action_dim] -> ``StepResult``; history mode remembers the last token."""
        self.last_tokens = ids.cpu().numpy()
        self._prev_token = int(self.last_tokens[0, -1])
        actions = self.actions.decode(self.last_tokens)  # [1, action_dim]
        timings["total"] = (time.perf_counter() - start) * 1e3
        return StepResult(actions=actions, timings=timings, kv=self.cache.stats())

    def context(self, image_tokens: torch.Tensor, proprio: list[torch.Tensor], timings: dict) -> torch.Tensor:
        """The step's new tokens [1, T, dim] from its image tokens [1, N, dim] and proprio tokens (per history mode)."""
        if self._history:
            return self._context_history(image_tokens, proprio, timings)
        return self._context_single(image_tokens, proprio, timings)

    def _context_single(self, image_tokens: torch.Tensor, proprio: list[torch.Tensor], timings: dict) -> torch.Tensor:
        """Single mode: a fresh cache; the step's whole sequence [1, T, dim] (image tokens [1, N, dim])."""
        self.cache.reset()
        return self.policy.model.embed_forward(self.layout, images=[image_tokens], proprio=proprio)

    def _context_history(self, image_tokens: torch.Tensor, proprio: list[torch.Tensor], timings: dict) -> torch.Tensor:
        """History mode: pin the prompt on the episode's first step, then this step's frame [1, T, dim]."""
        model = self.policy.model
        if not self._pinned:
            t0 = time.perf_counter()
            prompt = model.embed_forward(history_prompt(self.prompt), images=[])
            model.language_model.model(inputs_embeds=prompt, cache=self.cache, pin=True)
            self._pinned = True
            timings["prefill"] += (time.perf_counter() - t0) * 1e3
        prev = self._prev_token if self._keeps_actions else None
        frame = history_frame(self.prompt, step=0, prev_token=prev, has_proprio=bool(proprio))
        return model.embed_forward(frame, images=[image_tokens], proprio=proprio)


# ---- family loader (vla_runtime.models registers it with the runtime API) ------------------------


def load_openvla_policy(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    kv: KVConfig | None = None,
    adapter: str | Path | None = None,
    unnorm_key: str | None = None,
    decoding: ActionDecoding = ActionDecoding.ACTIONS,
) -> OpenVLAPolicy:
    """Load an OpenVLA checkpoint directory as a policy (``load_policy``'s OpenVLA branch).

    device: ``None`` = CUDA if available else CPU; ``"meta"`` = structure only, no weights read.
    dtype: ``None`` = bfloat16 on CUDA, float32 on CPU. kv: the sessions' default cache.
    adapter: a fine-tuning output directory (``vla_finetune``): its LoRA adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``) is merged into the weights, and its
    ``dataset_statistics.json`` replaces the action statistics. The chunk gate
    (``gates.safetensors`` + ``kv_config.json``, contract 3) and ``session_config.json`` (the session the
    model was trained for; ``kv`` overrides its cache) are read from the adapter directory, else from the
    checkpoint directory itself (models trained from scratch carry them there). decoding: see ``OpenVLAPolicy``.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    checkpoint = load_openvla(path, device=dev, dtype=dt)
    places = [Path(path)]  # where the gate and session config are looked for, the adapter first
    if adapter is not None:
        _apply_adapter(checkpoint, Path(adapter), load_weights=dev.type != "meta")
        places.insert(0, Path(adapter))
    session = None
    session_file = next((d / SESSION_CONFIG for d in places if (d / SESSION_CONFIG).is_file()), None)
    if session_file is not None:
        session = from_dict(SessionConfig, read_json(session_file))
    gate = None
    gate_dir = next((d for d in places if has_gate(d)), None)
    if gate_dir is not None and dev.type != "meta":
        gate, gate_kv = load_gate(gate_dir, device=dev)
        log.info("%s has a trained ChunkGate (%s)", gate_dir, gate_kv)
        session = session or SessionConfig(kv=gate_kv)
    if session is not None:
        kv = kv or session.kv
        unnorm_key = unnorm_key or session.unnorm_key
    return OpenVLAPolicy(
        checkpoint,
        device=dev,
        dtype=dt,
        kv=kv,
        unnorm_key=unnorm_key,
        decoding=decoding,
        session=session,
        kv_gate=gate,
    )


def _apply_adapter(checkpoint: OpenVLACheckpoint, adapter: Path, *, load_weights: bool) -> None:
    """Merge the directory's LoRA adapter and take its statistics (in place)."""
    if not adapter.is_dir():
        raise FileNotFoundError(f"adapter directory {adapter} does not exist")
    statistics = adapter / "dataset_statistics.json"
    if not (has_lora(adapter) or has_gate(adapter) or statistics.is_file()):
        raise ValueError(
            f"{adapter} is not a fine-tuning output: it has none of adapter_config.json, gates.safetensors, "
            "dataset_statistics.json"
        )
    if has_lora(adapter) and load_weights:
        checkpoint.model = merge_lora(checkpoint.model, adapter).eval()
    if statistics.is_file():
        checkpoint.config = replace(checkpoint.config, norm_stats=read_json(statistics))
