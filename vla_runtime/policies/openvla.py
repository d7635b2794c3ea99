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
from ..config import ActionDecoding, HistoryMode, SessionConfig
from ..device import synchronize
from ..kv import KVConfig, has_gate
from ..kv.chunked_gated import ChunkedGatedCache
from ..models.generation import TokenHead, decode
from ..models.quantize import QuantMode
from ..models.openvla.processing_openvla import ActionTokenizer, history_frame, single_layout
from ..models.prismatic.configuration_prismatic import OpenVLAConfig, read_json
from ..models.prismatic.processing_prismatic import ActionStats, Forward, resolve_unnorm_key
from ..models.prismatic.statistics import action_stats_entry, dataset_stats
from ..models.speed import speed_up
from .base import Observation, Policy, StepResult, finite_state
from .loading import plan_load
from .prismatic_session import PrismaticPolicy, PrismaticSession, parameter_count

log = logging.getLogger(__name__)


class OpenVLASession(PrismaticSession):
    """One episode: the cache, the previous action token (history mode), the last tokens decoded. With
    ``SessionConfig.compile`` on, the step runs the policy's compiled modules and the session warms them up
    when it is created (``WARMUP_STEPS`` steps on a blank frame, then ``reset``)."""

    def __init__(self, policy: OpenVLAPolicy, instruction: str, config: SessionConfig) -> None:
        self.unnorm_key = resolve_unnorm_key(policy.norm_stats, config.unnorm_key) if policy.norm_stats else None
        stats = policy.action_stats(self.unnorm_key)
        if stats is None:
            log.warning("checkpoint has no action statistics: actions are returned normalised to [-1, 1]")
        cfg = policy.config
        self.action_dim = stats.dim if stats is not None else cfg.action_dim
        self.actions = ActionTokenizer(cfg.n_bins, cfg.vocab_size_text, stats)
        proprio = dataset_stats(policy.norm_stats, self.unnorm_key, "proprio") if self.unnorm_key else None
        self.proprio_stats = ActionStats.from_dict(proprio, what=f"{self.unnorm_key} proprio") if proprio and cfg.proprio_dim else None
        self._prev_token: int | None = None  # history mode: the last action token, fed at the next step's start
        self._keeps_actions = config.history is not HistoryMode.OBSERVATIONS  # observations: decodes rolled back
        self.last_tokens: np.ndarray | None = None  # [1, action_dim] ids of the last step
        self._loop_ran = False  # a decode took the compiled token loop (after ``warm_up``: only if one did there)
        super().__init__(policy, instruction, config)
        self._start_compiled()

    def _warm_up_pending(self) -> bool:
        """A chunked cache takes the action tokens' compiled loop under the decode's mark only after its first
        compression, which a wide raw window reaches late: warm up until a decode took it, so its graph compiles at
        creation too (a session whose warm-up never took it decodes token by token)."""
        may_take_loop = self.modules.token_loop is not None and not self._keeps_actions
        return may_take_loop and isinstance(self.cache, ChunkedGatedCache) and not self._loop_ran

    def blank_observation(self) -> Observation:
        """A black image and, with a proprio projector, a zero state."""
        dim = self.policy.config.proprio_dim
        return replace(super().blank_observation(), state=None if dim is None else np.zeros(dim))

    # ---- episode state ---------------------------------------------------------------------------

    def _layout(self) -> Forward:
        """Single mode: the whole step; history mode: the frame of an episode's first step (no previous token)."""
        has_proprio = self.policy.config.proprio_dim is not None
        if self.history:
            return history_frame(self.prompt, step=0, prev_token=None, has_proprio=has_proprio)
        return single_layout(self.prompt, has_proprio=has_proprio)

    @property
    def head_tokens(self) -> int:
        """The decoded action tokens fed back (all but the last; history mode feeds that one next step)."""
        return self.action_dim - 1 + int(self.history and self._keeps_actions)

    def _step_frame(self) -> Forward:
        """History mode after the first step: the frame starts with the previous step's last action token."""
        if self._prev_token is None:
            return self.frame
        has_proprio = self.policy.config.proprio_dim is not None
        return history_frame(self.prompt, step=0, prev_token=self._prev_token, has_proprio=has_proprio)

    def _reset_head(self) -> None:
        self._prev_token = None
        self.last_tokens = None

    # ---- one control step ------------------------------------------------------------------------

    @torch.inference_mode()
    def _step(self, obs: Observation) -> StepResult:
        start = time.perf_counter()
        timings = {"vision": 0.0, "prefill": 0.0, "decode": 0.0}
        pixels, state = self.inputs(obs)
        image_tokens, proprio = self._embed_observation(pixels, state)
        synchronize(self.policy.device)
        timings["vision"] = (time.perf_counter() - start) * 1e3
        embeds = self.context(image_tokens, proprio, timings)
        return self.finish(self._decode(embeds, timings), timings, start)

    # ---- the phases of a step (``openvla_batching`` runs them for several sessions at once) ------------

    def check_observation(self, obs: Observation) -> None:
        """See ``PrismaticSession.check_observation``: the image and, with a proprio projector, the state."""
        self.inputs(obs)

    def inputs(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validate and preprocess: pixel values [1, 3 * towers, S, S] and the proprio input [1, P] (``None``
        without a proprio projector). Raises ``ValueError`` on bad input; the episode is untouched."""
        state = self.state_input(obs.state) if self.policy.config.proprio_dim is not None else None
        return self.pixels(obs), state

    def _embed_observation(self, pixels: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixels [B, C, S, S], state [B, P] or None -> image tokens [B, N, dim] and proprio tokens ([B, 1, dim] or [])."""
        vlm = self.policy.vlm
        return self.modules.embed_image(pixels), ([] if state is None else [vlm.embed_proprio(state)])

    def state_input(self, state: np.ndarray | None) -> torch.Tensor:
        """Proprioception [P] in robot units -> the proprio projector's input [1, P] (q01/q99-normalised
        with the session's dataset statistics when they have ``proprio`` entries)."""
        dim = self.policy.config.proprio_dim
        if state is None:
            raise ValueError(f"this policy has a proprio projector: the observation needs `state` [{dim}]")
        raw = state
        state = finite_state(state)
        if state.shape != (dim,):
            raise ValueError(f"observation `state` has shape {np.shape(raw)}; this policy expects [{dim}]")
        if self.proprio_stats is not None:
            state = self.proprio_stats.normalize(state)
        return torch.as_tensor(state, dtype=self.policy.dtype, device=self.policy.device)[None]  # [1, P]

    def token_head(self) -> TokenHead:
        """How action tokens are picked (``policy.decoding``): greedy over the whole vocabulary, or over the
        action ids only, computing just those rows of ``lm_head`` (the same numbers as the full head's rows,
        125x less work)."""
        lm_head = self.policy.vlm.language_model.lm_head
        if self.policy.decoding is ActionDecoding.FULL:
            return TokenHead(lm_head)
        return TokenHead(lm_head, id_range=(self.actions.first_id, self.actions.last_id))

    def _decode(self, embeds: torch.Tensor, timings: dict) -> torch.Tensor:
        """Forward ``embeds`` [1, T, dim], then decode the action tokens -> ids [1, action_dim]."""
        policy, head = self.policy, self.token_head()
        decoder = self.modules.decoder
        start = time.perf_counter()
        logits = head.logits(decoder(inputs_embeds=embeds, cache=self.cache)[:, -1])
        synchronize(policy.device)
        timings["prefill"] += (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        mark = self.open_decode()
        loop = self.modules.token_loop  # the action's tokens in one compiled call, where it applies
        if loop is not None and (self.warming or self._loop_ran) and loop.applies(head, self.cache, self.action_dim):
            ids = loop(logits, head, self.cache, self.action_dim)
            self._loop_ran = True
        else:
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
        if self.history and self._keeps_actions:
            self._prev_token = int(self.last_tokens[0, -1])
        actions = self.actions.decode(self.last_tokens)  # [1, action_dim]
        timings["total"] = (time.perf_counter() - start) * 1e3
        return StepResult(actions=actions, timings=timings, kv=self.cache.stats())


class OpenVLAPolicy(PrismaticPolicy, Policy):
    """A loaded OpenVLA checkpoint: weights (the VLM itself), tokenizer, image processor, statistics.

    Args (besides ``PrismaticPolicy``'s ``device``, ``dtype``, ``kv``, ``unnorm_key``, ``session``, ``kv_gate``):
        checkpoint: what ``vla_runtime.checkpoints.openvla.load_openvla`` returned.
        decoding: greedy over the action ids only (``ActionDecoding.ACTIONS``, default) or over the whole
            vocabulary (``FULL``, upstream's choice; ids outside the action range clip to the end bins).
    """

    name = "openvla"
    config_class = OpenVLAConfig
    session_class = OpenVLASession
    config: OpenVLAConfig
    batched_steps = True

    def __init__(self, checkpoint: OpenVLACheckpoint, *, decoding: ActionDecoding = ActionDecoding.ACTIONS, **kw) -> None:
        if not isinstance(decoding, ActionDecoding):
            raise TypeError(f"`decoding` must be an ActionDecoding ({', '.join(d.name for d in ActionDecoding)}), got {decoding!r}")
        super().__init__(checkpoint, checkpoint.config, checkpoint.model, vlm=checkpoint.model, **kw)
        self.decoding = decoding

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
        return ActionStats.from_dict(action_stats_entry(self.norm_stats, key), what=f"{key} action")

    def step_batch(self, sessions: list[OpenVLASession], observations: list[Observation]) -> list[StepResult]:
        """One step of each session as one batch (see ``openvla_batching``)."""
        from .openvla_batching import step_batch

        return step_batch(self, sessions, observations)

    def info(self) -> dict:
        cfg = self.config
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
                "total": parameter_count(self.model),
                "vision": parameter_count(self.model.vision_backbone),
                "projector": parameter_count(self.model.projector) + parameter_count(self.model.proprio_projector),
                "llm": parameter_count(self.model.language_model),
            },
            "datasets": sorted(self.norm_stats),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


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
    quantize: QuantMode = QuantMode.NONE,
    fuse: bool = False,
    prepack: bool = False,
) -> OpenVLAPolicy:
    """Load an OpenVLA checkpoint directory as a policy (``load_policy``'s OpenVLA branch).

    device: ``None`` = CUDA if available else CPU; ``"meta"`` = structure only, no weights read.
    dtype: ``None`` = bfloat16 on CUDA, float32 on CPU. kv: the sessions' default cache.
    adapter: a fine-tuning output directory (``vla_finetune``): its LoRA adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``) is merged into the weights, and its
    ``dataset_statistics.json`` replaces the action statistics. The chunk gate
    (``gates.safetensors`` + ``kv_config.json``, contract 3) and ``session_config.json`` (the session the
    model was trained for; ``kv`` overrides its cache) are read from the adapter directory, else from the
    checkpoint directory itself (models trained from scratch carry them there; ``loading.plan_load``).
    decoding: see ``OpenVLAPolicy``.
    quantize: weight-only int8/int4 of the LLM's decoder layers (``models.quantize``; after the adapter merge;
        the LM head, activations and the KV cache stay in ``dtype``).
    fuse: q/k/v and gate/up of the LLM's decoder layers as one GEMM each (``models.fuse``; after the adapter
        merge, before ``quantize``): fewer, larger GEMMs per decode token, the same outputs up to float rounding.
    prepack: every float32 linear layer of the model (vision towers, projector, LLM) with at least
        ``MIN_PACKED_WEIGHTS`` weights multiplies by a copy of its weight prepacked for oneDNN at load
        (``models.prepack``; last, after ``quantize``, whose layers it leaves alone):
        faster eager steps on a CPU, the same outputs up to float rounding, twice the linear layers' weight memory.
        CPU and float32 only.
    """
    plan = plan_load(path, device=device, dtype=dtype, kv=kv, unnorm_key=unnorm_key, adapter=adapter)
    checkpoint = load_openvla(path, device=plan.device, dtype=plan.dtype)
    if adapter is not None:
        _apply_adapter(checkpoint, Path(adapter), load_weights=plan.device.type != "meta")
    speed_up(checkpoint.model, checkpoint.model.language_model.model.layers, quantize=quantize, fuse=fuse, prepack=prepack)
    return OpenVLAPolicy(checkpoint, device=plan.device, dtype=plan.dtype, kv=plan.kv, unnorm_key=plan.unnorm_key,
                         decoding=decoding, session=plan.session, kv_gate=plan.gate)  # fmt: skip


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
