"""HybridVLA configuration: the diffusion-in-LLM modules, the token ids, sampling and the ensemble."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..diffusion import DiffusionConfig
from ..prismatic.configuration_prismatic import OpenVLAConfig

BOD_TOKEN_ID = 32001  # <BOD>: diffusion tokens follow
EOD_TOKEN_ID = 32002  # <EOD>: the autoregressive action tokens follow
TEXT_VOCAB_SIZE = 32000  # LLaMA-2's vocabulary before <PAD>/<BOD>/<EOD>

# rule name -> default threshold. "code" (scripts/sim.py): sum of the max-softmax of the first 6 AR tokens
# (the gripper token left out) > 5.8; "paper": mean over all AR tokens > 0.96.
ENSEMBLE_RULES: dict[str, float] = {"code": 5.8, "paper": 0.96}

# mode -> (run the diffusion branch, run the autoregressive branch)
PREDICT_MODES: dict[str, tuple[bool, bool]] = {"diff+ar": (True, True), "diff": (True, False), "ar": (False, True)}


@dataclass(frozen=True)
class DiffusionHeadConfig:
    """Geometry of the modules that put diffusion inside the LLM.

    Args:
        dim: the LLM's hidden size (all four modules work at this width).
        action_dim: action (and proprio) vector size.
        future_window: future actions denoised besides the current one (upstream runs 0: one action per call).
        norm_eps: epsilon of the noise head's RMSNorm.
    """

    dim: int = 4096
    action_dim: int = 7
    future_window: int = 0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("dim", "action_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.future_window < 0:
            raise ValueError(f"`future_window` must be >= 0, got {self.future_window}")

    @property
    def chunk(self) -> int:
        """Noisy-action tokens per diffusion step (current + future)."""
        return self.future_window + 1


@dataclass(frozen=True)
class CollaborativeEnsembleConfig:
    """When the AR action joins the diffusion action (HybridVLA §3.5).

    Args:
        rule: ``code`` (default; what ``scripts/sim.py`` runs) or ``paper``; see ``ENSEMBLE_RULES``.
        threshold: confidence threshold; ``None`` = the rule's default (5.8 summed / 0.96 mean).
    """

    rule: str = "code"
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.rule not in ENSEMBLE_RULES:
            raise KeyError(f"unknown ensemble rule {self.rule!r}; known: {', '.join(sorted(ENSEMBLE_RULES))}")

    @property
    def resolved_threshold(self) -> float:
        return ENSEMBLE_RULES[self.rule] if self.threshold is None else self.threshold


@dataclass(frozen=True)
class HybridVLASamplingConfig:
    """How an action is produced.

    Args:
        mode: ``diff+ar`` (both branches + collaborative ensemble), ``diff`` or ``ar``; see ``PREDICT_MODES``.
        diffusion: the process and DDIM step count (4 -> t in {75, 50, 25, 0}).
        ensemble: the collaborative ensemble rule.
        need_to_sub: action token ids are ``TEXT_VOCAB_SIZE - need_to_sub - bin``; must match training.
    """

    mode: str = "diff+ar"
    diffusion: DiffusionConfig = field(default_factory=lambda: DiffusionConfig(sample_steps=4))
    ensemble: CollaborativeEnsembleConfig = field(default_factory=CollaborativeEnsembleConfig)
    need_to_sub: int = 0

    def __post_init__(self) -> None:
        if self.mode not in PREDICT_MODES:
            raise KeyError(f"unknown HybridVLA mode {self.mode!r}; known: {', '.join(PREDICT_MODES)}")
        if not 0 <= self.need_to_sub < TEXT_VOCAB_SIZE:
            raise ValueError(f"`need_to_sub` must be in [0, {TEXT_VOCAB_SIZE}), got {self.need_to_sub}")

    @property
    def branches(self) -> tuple[bool, bool]:
        """(run diffusion, run autoregressive)."""
        return PREDICT_MODES[self.mode]


@dataclass(frozen=True)
class HybridVLAConfig:
    """A HybridVLA run: the Prismatic VLM, the diffusion modules' geometry and how actions are produced.

    Args:
        vlm: the Prismatic VLM with the run's dataset statistics (``rlbench`` upstream).
        head: the diffusion modules (``dim`` must equal the LLM width).
        sampling: mode, DDIM steps, ensemble rule, prefix reuse, ``need_to_sub``.
    """

    vlm: OpenVLAConfig
    head: DiffusionHeadConfig
    sampling: HybridVLASamplingConfig = field(default_factory=HybridVLASamplingConfig)

    def __post_init__(self) -> None:
        if self.head.dim != self.vlm.llm.dim:
            raise ValueError(f"the diffusion modules' width {self.head.dim} differs from the LLM width {self.vlm.llm.dim}")
        for name, token in (("<BOD>", BOD_TOKEN_ID), ("<EOD>", EOD_TOKEN_ID)):
            if token >= self.vlm.llm.vocab_size:
                raise ValueError(f"{name} id {token} is outside the LLM's {self.vlm.llm.vocab_size} embedding rows")

    @property
    def norm_stats(self) -> dict:
        return self.vlm.norm_stats
