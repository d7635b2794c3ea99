"""Load an OpenVLA checkpoint directory (the HF format upstream publishes).

Reads ``config.json`` (+ ``dataset_statistics.json``, which overrides ``norm_stats``), the weights
(``model.safetensors`` or shards + index), ``tokenizer.json`` and ``preprocessor_config.json``. Tensor
names may be HF (``vision_backbone.featurizer.*``, ``projector.fc1.*``, ``language_model.*``) or
Prismatic-native (``dino_featurizer.*``, ``siglip_featurizer.*``, ``projector.0.*``, ``llm.*``,
``*.gamma``); both map onto one module tree. The ViTs' final norms and SigLIP's ``attn_pool`` are never
used by the forward pass: they load when present and are tolerated when absent.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.prismatic.configuration_prismatic import OpenVLAConfig
from ..models.prismatic.modeling_prismatic import PrismaticVLM
from ..models.prismatic.processing_prismatic import ImageProcessor
from ..models.prismatic.prompt_prismatic import PromptTokenizer
from .safetensors_io import iter_tensors, read_shapes, weight_files

log = logging.getLogger(__name__)

# Prismatic-native prefix -> HF prefix (first match wins; checked in this order)
PRISMATIC_PREFIXES: tuple[tuple[str, str], ...] = (
    ("llm_backbone.llm.", "language_model."),
    ("llm.", "language_model."),
    ("vision_backbone.dino_featurizer.", "vision_backbone.featurizer."),
    ("vision_backbone.siglip_featurizer.", "vision_backbone.fused_featurizer."),
    ("dino_featurizer.", "vision_backbone.featurizer."),
    ("siglip_featurizer.", "vision_backbone.fused_featurizer."),
    ("featurizer.", "vision_backbone.featurizer."),
    ("projector.projector.", "projector."),
)
_PROJECTOR_SEQUENTIAL = re.compile(r"^projector\.([024])\.")
_PROJECTOR_NAMES = {"0": "fc1", "2": "fc2", "4": "fc3"}
_LAYER_SCALE_GAMMA = re.compile(r"\.(ls[12])\.gamma$")
# parameters the forward pass never reads: loaded when present, zero-filled when absent
UNUSED = re.compile(r"^vision_backbone\.(fused_)?featurizer\.(norm|fc_norm|attn_pool|head)\.")
PROGRESS_MIN_BYTES = 1 << 30


def hf_name(name: str) -> str:
    """A tensor name in either layout -> the HF OpenVLA name."""
    for old, new in PRISMATIC_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    name = _PROJECTOR_SEQUENTIAL.sub(lambda m: f"projector.{_PROJECTOR_NAMES[m.group(1)]}.", name)
    return _LAYER_SCALE_GAMMA.sub(r".\1.scale_factor", name)


@dataclass
class OpenVLACheckpoint:
    """What a checkpoint directory holds, loaded."""

    path: Path
    config: OpenVLAConfig
    model: PrismaticVLM
    tokenizer: PromptTokenizer
    image_processor: ImageProcessor


def load_openvla(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> OpenVLACheckpoint:
    """Load an OpenVLA directory onto ``device`` in ``dtype``. ``device="meta"`` builds and checks the
    model from config and headers without reading any tensor data (what ``vla-runtime info`` uses)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} does not exist (an OpenVLA checkpoint directory needs config.json)")
    found = {hf_name(name): (shape, file, name) for name, (shape, file) in read_shapes(weight_files(path)).items()}
    config = OpenVLAConfig.from_pretrained_dir(path, weight_shapes={k: v[0] for k, v in found.items()})
    with torch.device("meta"):
        model = PrismaticVLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _check_names_and_shapes(path, expected, found)
    tokenizer = PromptTokenizer.from_pretrained_dir(path, bos_id=config.bos_token_id)
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=False)
    if vocab != config.vocab_size_text:
        raise ValueError(
            f"{path / 'tokenizer.json'} has {vocab} tokens, but config.json implies {config.vocab_size_text} "
            f"(text_config.vocab_size {config.llm.vocab_size} - pad_to_multiple_of {config.pad_to_multiple_of}); "
            "the action token ids would be wrong"
        )
    image_processor = ImageProcessor.from_pretrained_dir(path, config.vision)
    if torch.device(device).type != "meta":
        _load_weights(model, found, expected, device=device, dtype=dtype)
    return OpenVLACheckpoint(path, config, model.eval(), tokenizer, image_processor)


def _check_names_and_shapes(path: Path, expected: dict, found: dict) -> None:
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ValueError(
            f"{len(unexpected)} tensor(s) in {path} do not belong to the OpenVLA model config.json describes, "
            f"e.g. {', '.join(unexpected[:5])}"
        )
    missing = sorted(k for k in set(expected) - set(found) if not UNUSED.match(k))
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) missing from {path}, e.g. {', '.join(missing[:5])}")
    for name, (shape, file, _) in found.items():
        if shape != expected[name]:
            raise ValueError(
                f"weight shape mismatch: `{name}` expected {list(expected[name])} (from config.json), "
                f"found {list(shape)} in {file.name}"
            )


def _load_weights(model: PrismaticVLM, found: dict, expected: dict, *, device, dtype: torch.dtype) -> None:
    total = sum(torch.Size(shape).numel() for shape, _, _ in found.values()) * torch.empty((), dtype=dtype).element_size()
    by_source = {src: file for _, file, src in found.values()}
    to_hf = {src: name for name, (_, _, src) in found.items()}
    state = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < PROGRESS_MIN_BYTES) as bar:
        for src, tensor in iter_tensors(by_source, device=device, dtype=dtype):
            state[to_hf[src]] = tensor
            bar.update(tensor.numel() * tensor.element_size())
    for name in set(expected) - set(state):  # unused parameters absent from the file
        log.debug("%s is not in the checkpoint (unused by the forward pass); zero-filled", name)
        state[name] = torch.zeros(expected[name], device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
