"""CogACT configuration: the DiT action model's geometry, sampling and the adaptive ensemble.

Upstream does not write the DiT size into ``config.json`` reliably (``action_model_type`` is a
training flag), so ``DiTConfig.from_state_dict`` reads every size the tensors tell and takes the
head count from the S/B/L table (or from an explicit value for other sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..diffusion import DiffusionConfig
from ..prismatic.configuration_prismatic import OpenVLAConfig

# name -> (depth, hidden, heads), as upstream's DiT_S / DiT_B / DiT_L
DIT_SIZES: dict[str, tuple[int, int, int]] = {"DiT-S": (6, 384, 4), "DiT-B": (12, 768, 12), "DiT-L": (24, 1024, 16)}


@dataclass(frozen=True)
class DiTConfig:
    """Geometry of the DiT action model.

    Args:
        hidden: transformer width H. depth: number of blocks. heads: attention heads (H must divide).
        action_dim: action vector size (7 = xyz, rpy, gripper).
        future_window: future actions predicted besides the current one (chunk = future_window + 1 = 16).
        token_size: width of the cognition feature (the LLM's hidden size; 4096 for LLaMA-2-7B).
        mlp_ratio: MLP hidden = ``int(hidden * mlp_ratio)``.
    """

    hidden: int = 768
    depth: int = 12
    heads: int = 12
    action_dim: int = 7
    future_window: int = 15
    token_size: int = 4096
    mlp_ratio: float = 4.0

    def __post_init__(self) -> None:
        for name in ("hidden", "depth", "heads", "action_dim", "token_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.future_window < 0:
            raise ValueError(f"`future_window` must be >= 0, got {self.future_window}")
        if self.hidden % self.heads:
            raise ValueError(f"`hidden` ({self.hidden}) must be a multiple of `heads` ({self.heads})")

    @property
    def chunk(self) -> int:
        """Actions per prediction (current + future)."""
        return self.future_window + 1

    @classmethod
    def from_name(cls, name: str, **overrides) -> "DiTConfig":
        """``DiT-S``/``DiT-B``/``DiT-L``/``tiny`` with overrides (``token_size``, ``future_window``, ...)."""
        if name not in DIT_CONFIGS:
            raise KeyError(f"unknown DiT size {name!r}; known: {', '.join(sorted(DIT_CONFIGS))}")
        return replace(DIT_CONFIGS[name], **overrides)

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], *, heads: int | None = None) -> "DiTConfig":
        """Sizes from an ``action_model`` state dict (keys ``net.*``).

        ``heads``: explicit head count; ``None`` = the S/B/L table entry whose width and depth match.
        Raises ``KeyError`` naming a missing key, ``ValueError`` when the heads cannot be known.
        """
        for key in ("net.x_embedder.linear.weight", "net.z_embedder.linear.weight", "net.positional_embedding"):
            if key not in state:
                raise KeyError(f"action_model state dict has no {key!r}; is this a CogACT checkpoint?")
        hidden, action_dim = state["net.x_embedder.linear.weight"].shape
        token_size = state["net.z_embedder.linear.weight"].shape[1]
        depth = 1 + max((int(k.split(".")[2]) for k in state if k.startswith("net.blocks.")), default=-1)
        future_window = state["net.positional_embedding"].shape[0] - 2
        mlp_ratio = state["net.blocks.0.mlp.fc1.weight"].shape[0] / hidden if depth else 4.0
        if heads is None:
            matches = [h for d, w, h in DIT_SIZES.values() if (d, w) == (depth, hidden)]
            if not matches:
                raise ValueError(
                    f"DiT with width {hidden} and depth {depth} is not one of {sorted(DIT_SIZES)}; "
                    "its head count cannot be read from the weights: set `action_model_num_heads` in config.json"
                )
            heads = matches[0]
        return cls(
            hidden=int(hidden), depth=depth, heads=int(heads), action_dim=int(action_dim),
            future_window=int(future_window), token_size=int(token_size), mlp_ratio=float(mlp_ratio),
        )  # fmt: skip


DIT_CONFIGS: dict[str, DiTConfig] = {
    **{name: DiTConfig(hidden=w, depth=d, heads=h) for name, (d, w, h) in DIT_SIZES.items()},
    "tiny": DiTConfig(hidden=32, depth=2, heads=2, token_size=64),
}


@dataclass(frozen=True)
class AdaptiveEnsembleConfig:
    """CogACT's adaptive action ensemble (deploy.py ``--action_ensemble``).

    Args:
        horizon: K, how many past chunks vote on the current action (2 for Google robot, 7 for WidowX);
            ``None`` = off: each step returns the whole chunk (execute k of n through the action queue).
        alpha: weight sharpness; a past prediction weighs ``exp(alpha * cos(a_past, a_now))``.
    """

    horizon: int | None = None
    alpha: float = 0.1

    def __post_init__(self) -> None:
        if self.horizon is not None and self.horizon < 1:
            raise ValueError(f"`horizon` must be >= 1 or None, got {self.horizon}")


@dataclass(frozen=True)
class CogACTSamplingConfig:
    """How actions are sampled from the DiT.

    Args:
        diffusion: the process and DDIM step count (10 -> t in {90, 80, ..., 0}).
        cfg_scale: classifier-free guidance scale; 1.0 = no guidance (one DiT pass per step), > 1 doubles the batch.
        ensemble: the adaptive ensemble over consecutive chunks.
    """

    diffusion: DiffusionConfig = field(default_factory=lambda: DiffusionConfig(sample_steps=10))
    cfg_scale: float = 1.5
    ensemble: AdaptiveEnsembleConfig = field(default_factory=AdaptiveEnsembleConfig)

    def __post_init__(self) -> None:
        if self.cfg_scale < 1.0:
            raise ValueError(f"`cfg_scale` must be >= 1.0 (1.0 = no guidance), got {self.cfg_scale}")


@dataclass(frozen=True)
class CogACTConfig:
    """A CogACT run: the Prismatic VLM, the DiT action model and how actions are sampled.

    Args:
        vlm: the Prismatic VLM (vision towers, projector, LLaMA-2) with the run's dataset statistics.
        action_model: the DiT's geometry (``token_size`` must equal the LLM width).
        sampling: DDIM steps, CFG scale, adaptive ensemble.
    """

    vlm: OpenVLAConfig
    action_model: DiTConfig
    sampling: CogACTSamplingConfig = field(default_factory=CogACTSamplingConfig)

    def __post_init__(self) -> None:
        if self.action_model.token_size != self.vlm.llm.dim:
            raise ValueError(
                f"the DiT's condition width {self.action_model.token_size} differs from the LLM width {self.vlm.llm.dim}"
            )
        horizon = self.sampling.ensemble.horizon
        if horizon is not None and horizon > self.action_model.chunk:
            raise ValueError(f"ensemble horizon {horizon} exceeds the action chunk ({self.action_model.chunk})")

    @property
    def norm_stats(self) -> dict:
        return self.vlm.norm_stats


def dit_config_from_run(config: dict, action_state: dict[str, torch.Tensor]) -> DiTConfig:
    """The DiT of a run: sizes from the ``action_model`` tensors, checked against ``config.json``.

    ``action_model_type`` (DiT-S/B/L) gives the head count and must agree with the shapes (upstream fails
    late with a state-dict error when the caller passes the wrong size); other sizes need our extra key
    ``action_model_num_heads``.
    """
    model_type = config.get("action_model_type")
    heads = config.get("action_model_num_heads") or (DIT_SIZES[model_type][2] if model_type in DIT_SIZES else None)
    cfg = DiTConfig.from_state_dict(action_state, heads=heads)
    if model_type in DIT_SIZES and (cfg.depth, cfg.hidden) != DIT_SIZES[model_type][:2]:
        raise ValueError(
            f"config.json says action_model_type {model_type!r} (depth, width {DIT_SIZES[model_type][:2]}), "
            f"but the checkpoint's DiT has depth {cfg.depth}, width {cfg.hidden}"
        )
    past = config.get("past_action_window_size", 0)
    if past:
        raise ValueError(f"past_action_window_size is {past}; CogACT only supports 0 (upstream asserts the same)")
    future = config.get("future_action_window_size")
    if future is not None and future != cfg.future_window:
        raise ValueError(
            f"config.json future_action_window_size is {future}, but the DiT's positional table holds {cfg.future_window}"
        )
    return cfg
