"""``OpenVLAOFTPolicy`` (family ``openvla-oft``) and its ``EpisodeSession``: one forward per step returns a
whole action chunk (``modeling_oft``), un-normalised with the checkpoint's dataset statistics.

Single-frame only: each step is a stand-alone forward, so the session holds no cache. History mode (and
the chunked cache) is not supported yet and is refused when the session is made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..checkpoints.openvla_oft import OFTCheckpoint, load_openvla_oft
from ..config import HistoryMode, SessionConfig
from ..device import resolve_device, resolve_dtype, synchronize
from ..kv import KVConfig
from ..kv.base import KVStats
from ..models.openvla.processing_openvla import center_crop, resolve_unnorm_key
from ..models.openvla_oft.configuration_oft import OFTConfig, OFTPlatform
from ..models.openvla_oft.normalization_oft import BoundsStats
from .base import PRIMARY_CAMERA, EpisodeSession, Observation, Policy, StepResult, validate_image, validate_instruction

log = logging.getLogger(__name__)


class OpenVLAOFTPolicy(Policy):
    """A loaded OFT checkpoint.

    Args:
        checkpoint: what ``load_openvla_oft`` returned.
        device, dtype: where the weights live. unnorm_key: default dataset key of the statistics.
        cameras: ``Observation.images`` keys of the model's images in its input order (third-person first,
            then wrist cameras); as many as the model was trained with (``num_images_in_input``).
    """

    name = "openvla-oft"
    config_class = OFTConfig

    def __init__(
        self,
        checkpoint: OFTCheckpoint,
        *,
        device: torch.device,
        dtype: torch.dtype,
        unnorm_key: str | None = None,
        cameras: tuple[str, ...] = (PRIMARY_CAMERA,),
    ) -> None:
        if len(set(cameras)) != len(cameras):
            raise ValueError(f"cameras {cameras} name a camera twice; each image the model takes needs its own camera")
        if len(cameras) != checkpoint.config.num_images:
            raise ValueError(f"cameras {cameras} are {len(cameras)} names; the model takes {checkpoint.config.num_images} image(s)")
        self.checkpoint = checkpoint
        self.config: OFTConfig = checkpoint.config
        self.model = checkpoint.model
        self.tokenizer = checkpoint.base.tokenizer
        self.image_processor = checkpoint.base.image_processor
        self.device, self.dtype = device, dtype
        self.cameras = cameras
        if unnorm_key is not None and self.norm_stats:
            resolve_unnorm_key(self.norm_stats, unnorm_key)  # fail at load, not at the first step
        self.unnorm_key = unnorm_key

    @property
    def norm_stats(self) -> dict:
        return self.checkpoint.base.config.norm_stats

    @property
    def action_dim(self) -> int:
        return self.config.action_dim

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def new_session(self, instruction: str, config: SessionConfig | None = None) -> "OpenVLAOFTSession":
        validate_instruction(instruction)
        config = config or SessionConfig(unnorm_key=self.unnorm_key)
        if config.unnorm_key is None and self.unnorm_key is not None:
            config = replace(config, unnorm_key=self.unnorm_key)
        return OpenVLAOFTSession(self, instruction, config)

    def info(self) -> dict:
        cfg, base = self.config, self.checkpoint.base.config

        def count(module: torch.nn.Module | None) -> int:
            return sum(p.numel() for p in module.parameters()) if module is not None else 0

        vla = self.model.vla
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
            "components": {k: v.name for k, v in self.checkpoint.components.items()},
            "parameters": {
                "total": count(self.model),
                "vision": count(vla.vision_backbone),
                "projector": count(vla.projector) + count(self.model.proprio_projector),
                "llm": count(vla.language_model),
                "action_head": count(self.model.action_head),
            },
            "datasets": sorted(self.norm_stats),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


class OpenVLAOFTSession(EpisodeSession):
    """One episode: the prompt and the statistics; each step is independent (no cache)."""

    def __init__(self, policy: OpenVLAOFTPolicy, instruction: str, config: SessionConfig) -> None:
        if config.history is not HistoryMode.SINGLE:
            raise ValueError(
                f"openvla-oft supports history={HistoryMode.SINGLE.value!r} only; history={config.history.value!r} "
                "(a cache across steps) is not supported yet"
            )
        super().__init__(instruction, config)
        self.policy = policy
        cfg = policy.config
        if not policy.norm_stats:
            raise ValueError(f"{policy.checkpoint.path} has no dataset statistics (dataset_statistics.json): OFT actions cannot be un-normalised")
        self.unnorm_key = resolve_unnorm_key(policy.norm_stats, config.unnorm_key)
        entry = policy.norm_stats[self.unnorm_key]
        self.action_stats = BoundsStats.from_dict(entry["action"], cfg.normalization, what=f"{self.unnorm_key} action")
        if self.action_stats.dim != cfg.action_dim:
            raise ValueError(f"statistics {self.unnorm_key!r} have {self.action_stats.dim} action dims; the head predicts {cfg.action_dim}")
        self.proprio_stats = None
        if cfg.proprio_dim is not None:
            if "proprio" not in entry:
                raise ValueError(f"statistics {self.unnorm_key!r} have no `proprio` entry; the proprio projector needs one")
            self.proprio_stats = BoundsStats.from_dict(entry["proprio"], cfg.normalization, what=f"{self.unnorm_key} proprio")
        self.reset(instruction)

    def reset(self, instruction: str | None = None) -> None:
        if instruction is not None:
            self.instruction = validate_instruction(instruction)
            self.prompt = self.policy.tokenizer.prompt(self.instruction)

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
        state = self.proprio_stats.normalize(np.asarray(obs.state, dtype=np.float64))
        return pixels, torch.as_tensor(state, dtype=policy.dtype, device=policy.device)[None]  # [1, P]

    @torch.inference_mode()
    def step(self, obs: Observation) -> StepResult:
        """One forward -> ``StepResult.actions`` [chunk_size, action_dim] in robot units."""
        start = time.perf_counter()
        pixels, state = self.inputs(obs)
        model, device = self.policy.model, self.policy.device
        image_tokens = model.embed_images(pixels)
        proprio = None if state is None else model.embed_proprio(state)
        synchronize(device)
        t1 = time.perf_counter()
        embeds, first = model.sequence(self.prompt, image_tokens, proprio)
        hidden = model.action_hidden(embeds, first)
        synchronize(device)
        t2 = time.perf_counter()
        normalized = model.action_head(hidden).float()[0].cpu().numpy()  # [chunk, A]
        actions = self.action_stats.unnormalize(normalized)
        t3 = time.perf_counter()
        timings = {"vision": (t1 - start) * 1e3, "prefill": (t2 - t1) * 1e3, "decode": (t3 - t2) * 1e3, "total": (t3 - start) * 1e3}
        tokens = embeds.shape[1]
        return StepResult(actions=actions, timings=timings, kv=KVStats(positions_used=tokens, tokens_seen=tokens))


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
) -> OpenVLAOFTPolicy:
    """Load an OpenVLA-OFT directory (``load_policy``'s OFT branch).

    platform: ``libero``/``bridge``/``aloha`` (chunk 8/5/25; default: matched by the components' sizes).
    cameras: the ``Observation.images`` keys fed as the model's images, third-person first (1 to 3).
    ``kv`` is ignored (each step is one stand-alone forward); ``adapter`` is not supported.
    """
    if adapter is not None:
        raise ValueError(f"adapter {adapter}: OpenVLA-OFT checkpoints load with their components only (adapter=None)")
    if kv is not None:
        log.info("openvla-oft holds no KV cache across steps; kv=%s is ignored", kv)
    if isinstance(platform, str):
        try:
            platform = OFTPlatform(platform)
        except ValueError:
            raise ValueError(f"platform {platform!r} is not one of {', '.join(p.value for p in OFTPlatform)}") from None
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cameras = tuple(cameras)
    checkpoint = load_openvla_oft(path, device=dev, dtype=dt, platform=platform, num_images=len(cameras))
    return OpenVLAOFTPolicy(checkpoint, device=dev, dtype=dt, unnorm_key=unnorm_key, cameras=cameras)
