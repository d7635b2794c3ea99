"""Load an OpenVLA-OFT checkpoint: the OpenVLA directory plus the component ``.pt`` files beside it.

The backbone loads with ``checkpoints.openvla.load_openvla``. Each component is a ``torch.save``d state
dict of tensors, read with ``torch.load(weights_only=True)``; a ``module.`` prefix (the component was
trained under DDP) is stripped, as upstream's ``load_component_state_dict`` does. Sizes come from the
tensors: ``action_head``'s ``model.fc2.weight`` [action_dim, hidden] and ``model.layer_norm1.weight``
[llm_dim * action_dim]; ``proprio_projector``'s ``fc1.weight`` [llm_dim, proprio_dim]. The chunk length
and normalisation come from the platform (``configuration_oft.PLATFORMS``), given or matched by sizes.
A ``vision_backbone--*checkpoint.pt`` makes the checkpoint FiLM-conditioned (OFT+, ``openvla_oft_film``).
A ``noisy_action_projector--*checkpoint.pt`` (``fc1.weight`` [llm_dim, 1]) makes it the diffusion variant;
its action head is then ``noise_predictor.mlp_resnet.*`` (same sizes under that prefix).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..models.openvla_oft.configuration_oft import (
    ACTION_HEAD,
    DIFFUSION_STEPS,
    NOISY_ACTION_PROJECTOR,
    PLATFORMS,
    PROPRIO_PROJECTOR,
    VISION_BACKBONE,
    OFTConfig,
    OFTPlatform,
    component_files,
    platform_for,
)
from ..models.openvla_oft.modeling_oft import OpenVLAOFT
from ..models.prismatic.configuration_prismatic import read_json
from .adapter import has_lora, merge_lora
from .openvla import OpenVLACheckpoint, load_openvla
from .openvla_oft_film import check_film_state, split_film_state

log = logging.getLogger(__name__)

DDP_PREFIX = "module."
L1_HEAD_PREFIX = "model."  # L1RegressionActionHead.model (MLPResNet)
DIFFUSION_HEAD_PREFIX = "noise_predictor.mlp_resnet."  # DiffusionActionHead.noise_predictor.mlp_resnet


@dataclass
class OFTCheckpoint:
    """What an OFT directory holds, loaded. ``components``: component name -> its file."""

    path: Path
    base: OpenVLACheckpoint
    config: OFTConfig
    platform: OFTPlatform
    model: OpenVLAOFT
    components: dict[str, Path]


def find_component(path: Path, pattern: str, *, required: bool) -> Path | None:
    """The one ``*{pattern}*checkpoint*`` file in ``path``; ``None`` if absent and not required."""
    files = component_files(path, pattern)
    if len(files) > 1:
        raise ValueError(f"{path} has {len(files)} {pattern} checkpoints ({', '.join(f.name for f in files)}); expected exactly one")
    if not files:
        if required:
            raise FileNotFoundError(f"{path} has no {pattern}--*checkpoint.pt (an OpenVLA-OFT checkpoint needs one)")
        return None
    return files[0]


def load_component(file: Path) -> dict[str, torch.Tensor]:
    """A component state dict (CPU, memory-mapped), ``module.`` prefixes stripped; its tensors floating point."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise ValueError(f"cannot read {file.name} as a torch state dict: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file.name} is not a state dict of tensors (got {type(state).__name__})")
    if not_float := [k for k, v in state.items() if not v.is_floating_point()]:  # heads, projectors, FiLM: float weights only
        raise ValueError(f"{file.name}: `{not_float[0]}` is {state[not_float[0]].dtype}; expected a floating-point weight")
    stripped = {}
    for key, value in state.items():
        name = key.removeprefix(DDP_PREFIX)
        if name in stripped:  # `module.x` and `x` both: which one was trained is unknowable
            raise ValueError(f"{file.name} holds `{name}` twice (with and without the DDP prefix `{DDP_PREFIX}`); "
                             "expected each weight once")
        stripped[name] = value
    return stripped


def _shape(state: dict, key: str, file: Path, ndim: int) -> tuple[int, ...]:
    if key not in state:
        raise ValueError(f"{file.name} has no `{key}`; found {', '.join(sorted(state)[:6])}")
    shape = tuple(state[key].shape)
    if len(shape) != ndim:
        raise ValueError(f"{file.name}: `{key}` has shape {list(shape)}; expected {ndim} dimensions")
    return shape


def _check_state(module: torch.nn.Module, state: dict, file: Path) -> None:
    """Names and shapes of ``state`` equal the module's; the error names what differs."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{file.name} does not match the component: missing {missing[:5] or 'none'}, unexpected {unexpected[:5] or 'none'}"
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{file.name}: `{key}` has shape {list(state[key].shape)}; expected {list(shape)}")


def resolve_platform(platform: OFTPlatform | None, action_dim: int, proprio_dim: int | None) -> OFTPlatform:
    """The given platform (checked against the sizes) or the one the sizes match; LIBERO when ambiguous,
    as upstream's ``constants.py`` defaults."""
    matches = platform_for(action_dim, proprio_dim)
    if platform is not None:
        if not isinstance(platform, OFTPlatform):
            raise TypeError(f"`platform` must be an OFTPlatform ({', '.join(p.name for p in OFTPlatform)}), got {platform!r}")
        c = PLATFORMS[platform]
        if c.action_dim != action_dim:
            raise ValueError(f"platform {platform.value} has {c.action_dim}-D actions; the action head predicts {action_dim}")
        return platform
    if not matches:
        raise ValueError(
            f"no OFT platform has {action_dim}-D actions and proprio {proprio_dim}: known "
            + ", ".join(f"{p.value} ({c.action_dim}-D, proprio {c.proprio_dim})" for p, c in PLATFORMS.items())
        )
    if len(matches) > 1:
        log.warning("the components fit %s; using %s as upstream does (pass platform= to choose)",
                    ", ".join(m.value for m in matches), matches[0].value)
    return matches[0]


def load_openvla_oft(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    platform: OFTPlatform | None = None,
    num_images: int = 1,
    diffusion_steps: int = DIFFUSION_STEPS,
) -> OFTCheckpoint:
    """Load an OFT directory onto ``device`` in ``dtype`` (``"meta"``: structure only, as ``load_openvla``).

    diffusion_steps: DDIM steps per chunk for the diffusion variant (upstream's default 50; ignored for L1).
    """
    path = Path(path)
    base = load_openvla(path, device=device, dtype=dtype)
    llm_dim = base.config.llm.dim
    files = {ACTION_HEAD: find_component(path, ACTION_HEAD, required=True)}
    head = load_component(files[ACTION_HEAD])
    noisy_file = find_component(path, NOISY_ACTION_PROJECTOR, required=False)
    diffusion = noisy_file is not None
    head_prefix = DIFFUSION_HEAD_PREFIX if diffusion else L1_HEAD_PREFIX
    if diffusion and f"{L1_HEAD_PREFIX}fc2.weight" in head:
        raise ValueError(f"{path} has {noisy_file.name} (the diffusion variant) but {files[ACTION_HEAD].name} is an L1-regression head (`model.*` keys)")
    if not diffusion and f"{DIFFUSION_HEAD_PREFIX}fc2.weight" in head:
        raise ValueError(
            f"{files[ACTION_HEAD].name} is a diffusion head (`noise_predictor.*` keys) but {path} has no "
            f"{NOISY_ACTION_PROJECTOR}--*checkpoint.pt beside it (the diffusion variant needs both)"
        )
    action_dim, hidden = _shape(head, f"{head_prefix}fc2.weight", files[ACTION_HEAD], 2)
    (head_in,) = _shape(head, f"{head_prefix}layer_norm1.weight", files[ACTION_HEAD], 1)
    if head_in != llm_dim * action_dim:
        raise ValueError(
            f"{files[ACTION_HEAD].name}: the head takes {head_in} features per action; expected llm_dim {llm_dim} x "
            f"action_dim {action_dim} = {llm_dim * action_dim} (is it from another backbone?)"
        )
    proprio_file = find_component(path, PROPRIO_PROJECTOR, required=False)
    proprio = None
    proprio_dim = None
    if proprio_file is not None:
        files[PROPRIO_PROJECTOR] = proprio_file
        proprio = load_component(proprio_file)
        proprio_dim = _shape(proprio, "fc1.weight", proprio_file, 2)[1]
    else:  # legitimate (trained without proprio), or a file left behind: the weights cannot tell
        log.warning("%s has no %s--*checkpoint.pt: the policy runs without proprioception and ignores observations' "
                    "`state`; a checkpoint fine-tuned with proprio needs that file beside it", path, PROPRIO_PROJECTOR)
    chosen = resolve_platform(platform, action_dim, proprio_dim)
    constants = PLATFORMS[chosen]
    film_file = find_component(path, VISION_BACKBONE, required=False)
    config = OFTConfig(
        llm_dim, action_dim, constants.chunk_size, proprio_dim, num_images, constants.normalization, hidden,
        film=film_file is not None, diffusion=diffusion, diffusion_steps=diffusion_steps,
    )
    with torch.device("meta"):
        model = OpenVLAOFT(base.model, config)  # the head (+ projector, FiLM) on meta, the loaded backbone kept
    _check_state(model.action_head, head, files[ACTION_HEAD])
    if proprio is not None:
        _check_state(model.proprio_projector, proprio, proprio_file)
    noisy = None
    if diffusion:
        files[NOISY_ACTION_PROJECTOR] = noisy_file
        noisy = load_component(noisy_file)
        _check_state(model.noisy_action_projector, noisy, noisy_file)
    vision = film = None
    if film_file is not None:
        files[VISION_BACKBONE] = film_file
        vision, film = split_film_state(load_component(film_file), film_file)
        check_film_state(model.vla.vision_backbone, model.film, vision, film, film_file)
    if torch.device(device).type != "meta":
        model.action_head.load_state_dict({k: v.to(device, dtype) for k, v in head.items()}, strict=True, assign=True)
        if proprio is not None:
            model.proprio_projector.load_state_dict({k: v.to(device, dtype) for k, v in proprio.items()}, strict=True, assign=True)
        if noisy is not None:
            model.noisy_action_projector.load_state_dict({k: v.to(device, dtype) for k, v in noisy.items()}, strict=True, assign=True)
        if film is not None:  # upstream loads the whole FiLM'd backbone over the merged checkpoint's vision weights
            model.vla.vision_backbone.load_state_dict({k: v.to(device, dtype) for k, v in vision.items()}, strict=True)
            model.film.load_state_dict({k: v.to(device, dtype) for k, v in film.items()}, strict=True, assign=True)
    return OFTCheckpoint(path, base, config, chosen, model.eval(), files)



def apply_oft_adapter(checkpoint: OFTCheckpoint, adapter: Path, *, device: torch.device | str, dtype: torch.dtype) -> None:
    """A ``vla_finetune`` OFT output directory onto ``checkpoint`` (in place): its LoRA adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``, on the OpenVLA backbone) merged into the weights,
    its ``action_head--*checkpoint.pt`` / ``proprio_projector--*checkpoint.pt`` replacing the checkpoint's
    (same shapes), its ``dataset_statistics.json`` replacing the statistics."""
    adapter = Path(adapter)
    if not adapter.is_dir():
        raise FileNotFoundError(f"adapter directory {adapter} does not exist")
    statistics = adapter / "dataset_statistics.json"
    head_file = find_component(adapter, ACTION_HEAD, required=False)
    proprio_file = find_component(adapter, PROPRIO_PROJECTOR, required=False)
    if not (has_lora(adapter) or head_file or proprio_file or statistics.is_file()):
        raise ValueError(
            f"{adapter} is not an OFT fine-tuning output: it has none of adapter_config.json, action_head--*checkpoint.pt, "
            "proprio_projector--*checkpoint.pt, dataset_statistics.json"
        )
    if proprio_file is not None and checkpoint.model.proprio_projector is None:
        raise ValueError(f"{proprio_file} is a proprio projector, but {checkpoint.path} was trained without one")
    load = torch.device(device).type != "meta"
    if has_lora(adapter) and load:
        checkpoint.model.vla = merge_lora(checkpoint.model.vla, adapter).eval()
        checkpoint.base.model = checkpoint.model.vla
    for file, module, name in ((head_file, checkpoint.model.action_head, ACTION_HEAD),
                               (proprio_file, checkpoint.model.proprio_projector, PROPRIO_PROJECTOR)):  # fmt: skip
        if file is None:
            continue
        state = load_component(file)
        _check_state(module, state, file)
        if load:
            module.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=True)
        checkpoint.components[name] = file
    if statistics.is_file():
        checkpoint.base.config = replace(checkpoint.base.config, norm_stats=read_json(statistics))
