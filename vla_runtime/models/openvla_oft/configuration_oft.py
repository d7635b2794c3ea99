"""OpenVLA-OFT's configuration: robot platforms, the head's sizes, and telling an OFT checkpoint apart.

An OFT checkpoint is an OpenVLA HF directory (``config.json``, safetensors, tokenizer,
``dataset_statistics.json``) with the fine-tuned components beside it, as upstream's
``experiments/robot/openvla_utils.py`` finds them: the one file whose name contains ``action_head`` and
``checkpoint`` (``action_head--150000_checkpoint.pt``), and optionally ``proprio_projector``. Sizes the
files cannot tell (actions per chunk, the normalisation) come from the platform, as upstream's
``prismatic/vla/constants.py`` sets them: LIBERO 8 x 7 (proprio 8, BOUNDS_Q99), Bridge 5 x 7 (proprio 7,
BOUNDS_Q99), ALOHA 25 x 14 (proprio 14, BOUNDS).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..prismatic.configuration_prismatic import detect_openvla


class NormalizationType(str, Enum):
    """How actions and proprio were scaled to [-1, 1]: ``BOUNDS`` min/max, ``BOUNDS_Q99`` q01/q99."""

    BOUNDS = "bounds"
    BOUNDS_Q99 = "bounds_q99"


class OFTPlatform(str, Enum):
    LIBERO = "libero"
    BRIDGE = "bridge"
    ALOHA = "aloha"


@dataclass(frozen=True)
class PlatformConstants:
    """Upstream's per-platform constants (``prismatic/vla/constants.py``)."""

    chunk_size: int  # NUM_ACTIONS_CHUNK
    action_dim: int  # ACTION_DIM
    proprio_dim: int  # PROPRIO_DIM
    normalization: NormalizationType  # ACTION_PROPRIO_NORMALIZATION_TYPE


PLATFORMS: dict[OFTPlatform, PlatformConstants] = {
    OFTPlatform.LIBERO: PlatformConstants(8, 7, 8, NormalizationType.BOUNDS_Q99),
    OFTPlatform.BRIDGE: PlatformConstants(5, 7, 7, NormalizationType.BOUNDS_Q99),
    OFTPlatform.ALOHA: PlatformConstants(25, 14, 14, NormalizationType.BOUNDS),
}

ACTION_HEAD = "action_head"  # upstream's find_checkpoint_file patterns
PROPRIO_PROJECTOR = "proprio_projector"
NOISY_ACTION_PROJECTOR = "noisy_action_projector"  # the diffusion variant's noisy-action projector
VISION_BACKBONE = "vision_backbone"  # FiLM (OFT+): the whole vision backbone with FiLM layers
STOP_TOKEN_ID = 2  # upstream's STOP_INDEX ('</s>'), appended after the action positions
HEAD_BLOCKS = 2  # L1RegressionActionHead / NoisePredictionModel: MLPResNet(num_blocks=2, ...)
DIFFUSION_TRAIN_STEPS = 50  # upstream's num_diffusion_steps_train (finetune.py, run_libero_eval.py defaults)
DIFFUSION_STEPS = 50  # upstream's num_diffusion_steps_inference


def component_files(path: Path, pattern: str) -> list[Path]:
    """Files in ``path`` whose name contains ``pattern`` and ``checkpoint`` (upstream's rule), sorted."""
    return sorted(p for p in Path(path).iterdir() if p.is_file() and pattern in p.name and "checkpoint" in p.name)


def detect_openvla_oft(path: Path) -> bool:
    """An OpenVLA HF directory with an ``action_head--*checkpoint.pt`` beside its weights."""
    return detect_openvla(path) and bool(component_files(path, ACTION_HEAD))


@dataclass(frozen=True)
class OFTConfig:
    """The parallel-decoding head's geometry.

    Args:
        llm_dim: the LLM's hidden size (the head's per-token input and its hidden width).
        action_dim: action dimensions (the head's output; ``ACTION_DIM``).
        chunk_size: actions decoded per forward (``NUM_ACTIONS_CHUNK``).
        proprio_dim: the proprio projector's input size (``None`` = no proprio token).
        num_images: images per step (1 third-person + up to 2 wrist cameras), ``num_images_in_input``.
        normalization: how actions/proprio are (un)normalised with the dataset statistics.
        head_hidden: the MLPResNet's hidden width (upstream: ``llm_dim``).
        film: the vision towers are FiLM-conditioned on the task's language (OFT+, ``use_film``).
        diffusion: the diffusion variant (noise-predicting head + noisy-action projector, DDIM) instead of L1.
        diffusion_train_steps: the DDIM schedule's training steps (not stored in the files; upstream 50).
        diffusion_steps: DDIM steps per chunk (``num_diffusion_steps_inference``, upstream 50).
    """

    llm_dim: int
    action_dim: int
    chunk_size: int
    proprio_dim: int | None = None
    num_images: int = 1
    normalization: NormalizationType = NormalizationType.BOUNDS_Q99
    head_hidden: int | None = None
    film: bool = False
    diffusion: bool = False
    diffusion_train_steps: int = DIFFUSION_TRAIN_STEPS
    diffusion_steps: int = DIFFUSION_STEPS

    def __post_init__(self) -> None:
        for name in ("llm_dim", "action_dim", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"OFTConfig `{name}` must be >= 1, got {getattr(self, name)}")
        if self.proprio_dim is not None and self.proprio_dim < 1:
            raise ValueError(f"OFTConfig `proprio_dim` must be >= 1 or None, got {self.proprio_dim}")
        if not 1 <= self.num_images <= 3:
            raise ValueError(f"OFTConfig `num_images` must be 1, 2 or 3 (third-person + wrist cameras), got {self.num_images}")
        if not isinstance(self.normalization, NormalizationType):
            object.__setattr__(self, "normalization", NormalizationType(self.normalization))
        if not 1 <= self.diffusion_steps <= self.diffusion_train_steps:
            raise ValueError(
                f"OFTConfig `diffusion_steps` must be in [1, diffusion_train_steps = {self.diffusion_train_steps}], got {self.diffusion_steps}"
            )
        if self.head_hidden is None:
            object.__setattr__(self, "head_hidden", self.llm_dim)

    @property
    def action_tokens(self) -> int:
        """Empty action positions appended after the prompt: ``chunk_size * action_dim``."""
        return self.chunk_size * self.action_dim


def platform_for(action_dim: int, proprio_dim: int | None) -> list[OFTPlatform]:
    """The platforms whose constants match the components' sizes (proprio only when there is a projector)."""
    return [
        name for name, c in PLATFORMS.items()
        if c.action_dim == action_dim and (proprio_dim is None or c.proprio_dim == proprio_dim)
    ]  # fmt: skip
