"""Session-level configuration and YAML loading for every dataclass config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import yaml

from .kv.config import KVConfig


class HistoryMode(str, Enum):
    """What a session's context holds: ``SINGLE`` a fresh context each step (stock OpenVLA); ``HISTORY`` one
    cache for the whole episode (the prompt pinned once, then each step's frame and action tokens);
    ``OBSERVATIONS`` one cache for the episode that keeps each step's frame but not its action tokens
    (OpenVLA decodes them inside a mark and rolls them back), so a policy cannot copy its own past actions
    instead of reading the frames (the copycat failure of behaviour cloning from histories). The diffusion
    heads (CogACT, HybridVLA) and OpenVLA-OFT never keep their action tokens: for them both episodic modes
    are the same."""

    SINGLE = "single"
    HISTORY = "history"
    OBSERVATIONS = "observations"

    @property
    def episodic(self) -> bool:
        """One cache for the whole episode (``HISTORY`` or ``OBSERVATIONS``)."""
        return self is not HistoryMode.SINGLE


HISTORY_MODES = tuple(m.value for m in HistoryMode)  # the spellings the CLI and YAML accept


class ActionDecoding(str, Enum):
    """Which ids greedy decoding of discrete action tokens chooses from (OpenVLA).

    ``ACTIONS``: the ``n_bins`` action token ids only (the default; only those rows of ``lm_head`` are
    computed). ``FULL``: the whole vocabulary, as upstream OpenVLA's ``generate``; an id outside the action
    range then maps to the nearest end bin, as upstream's ``clip(vocab - id - 1, 0, n_bins - 2)`` does.
    """

    ACTIONS = "actions"
    FULL = "full"


class CompileMode(str, Enum):
    """How a session's step runs (``SessionConfig.compile``; every family).

    ``OFF``: eager PyTorch (the default). ``DEFAULT``: the vision towers + projector, the decoder's layer pass and
    the family's head where it has one (CogACT's DiT, OFT's L1 head) are ``torch.compile``-d (inductor; fused
    kernels, far less per-op overhead), warmed up when the session is created. ``REDUCE_OVERHEAD``: the same with
    CUDA graphs (``torch.compile(mode="reduce-overhead")``); CUDA only: on another device the session raises
    ``ValueError`` (CUDA graphs do not exist there; use ``DEFAULT``).
    """

    OFF = "off"
    DEFAULT = "default"
    REDUCE_OVERHEAD = "reduce-overhead"


COMPILE_MODES = tuple(m.value for m in CompileMode)  # the spellings the CLI and YAML accept

T = TypeVar("T")


@dataclass
class SessionConfig:
    """How an episode runs.

    Args:
        kv: the cache (``KVConfig``).
        history: ``single`` = fresh context each step (stock OpenVLA); ``history`` = one cache for the
            whole episode (the prompt pinned once, then each step's frame and action tokens); ``observations``
            = the same without the action tokens (``HistoryMode``).
        unnorm_key: dataset key of the action statistics (needed when the checkpoint has several).
        center_crop: 0.9-area centre crop before the image transform (models trained with image_aug).
        execution_horizon: actions executed from each predicted chunk before re-planning
            (``None`` = the whole chunk); only matters for chunk-predicting families.
        seed: seed for sampling-based heads (diffusion noise).
        compile: eager or ``torch.compile``-d step (``CompileMode``; every family).
        compile_guards: after the warm-up, evaluate all of ``torch.compile``'s guards on every compiled call
            (``True``) or only those that pick between the graphs compiled so far (``False``, the default; the
            warm-up itself always runs them all). What serving stacks do after their warm-up (vLLM calls its
            compiled graphs without dynamo's guards): about 0.15 ms per compiled call on a CPU, 8 calls a step.
            The warm-up must then have compiled every graph the episode needs, which ``tests/openvla/
            test_compiled_session.py`` checks for the stock step and a chunked history episode (a step that would
            still compile raises instead); set it to ``True`` to keep every guard.
    """

    kv: KVConfig = field(default_factory=KVConfig, metadata={"help": "the KV cache"})
    history: HistoryMode = field(  # a string from YAML/CLI is turned into the enum
        default=HistoryMode.SINGLE,
        metadata={"help": "single (fresh context per step), history (one cache per episode) or observations (one "
                          "cache per episode without the decoded action tokens)"},
    )
    unnorm_key: str | None = field(
        default=None, metadata={"help": "dataset key of the action statistics; unset = the checkpoint's only one"}
    )
    center_crop: bool = field(default=False, metadata={"help": "0.9-area centre crop (models trained with image augmentation)"})
    execution_horizon: int | None = field(
        default=None, metadata={"help": "actions executed from each predicted chunk; unset = the whole chunk"}
    )
    seed: int = field(default=0, metadata={"help": "seed for sampling heads (diffusion noise)"})
    compile: CompileMode = field(  # a string from YAML/CLI is turned into the enum
        default=CompileMode.OFF,
        metadata={"help": "off (eager), default (torch.compile, warmed up when the session is created) or "
                          "reduce-overhead (the same with CUDA graphs; CUDA only)"},
    )
    compile_guards: bool = field(
        default=False, metadata={"help": "compiled steps: evaluate every torch.compile guard on each call after the "
                                         "warm-up (slower; default: only the guards that pick between graphs)"},
    )

    def __post_init__(self) -> None:
        if isinstance(self.kv, dict):
            self.kv = KVConfig.from_dict(self.kv)
        self.history = history_mode(self.history)
        self.compile = compile_mode(self.compile)
        if self.execution_horizon is not None and self.execution_horizon < 1:
            raise ValueError(f"`execution_horizon` must be >= 1 or None, got {self.execution_horizon}")


def history_mode(value: str | HistoryMode) -> HistoryMode:
    """``value`` as a ``HistoryMode``; ``ValueError`` naming the accepted spellings otherwise."""
    try:
        return HistoryMode(value)
    except ValueError:
        raise ValueError(f"`history` is {value!r}; expected one of {', '.join(HISTORY_MODES)}") from None


def compile_mode(value: str | CompileMode) -> CompileMode:
    """``value`` as a ``CompileMode``; ``ValueError`` naming the accepted spellings otherwise."""
    try:
        return CompileMode(value)
    except ValueError:
        raise ValueError(f"`compile` is {value!r}; expected one of {', '.join(COMPILE_MODES)}") from None


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build dataclass ``cls`` from a dict, recursing into nested dataclass fields.

    A nested mapping overrides the field's default instance (so a config whose default is, e.g., a chunked
    ``KVConfig`` keeps that mode when the mapping sets only ``chunk``). A dataclass with its own edge form
    (a ``from_dict(data, base=default)`` classmethod, e.g. ``KVConfig``'s flat mapping) reads itself.
    Unknown keys raise ``ValueError`` naming them and listing the valid ones.
    """
    if _reads_itself(cls):
        return cls.from_dict(data)
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} expects a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid: {sorted(fields)}")
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints.get(key)
        if _reads_itself(hint) and isinstance(value, dict):
            value = hint.from_dict(value, base=_default(fields[key]))
        elif dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = from_dict(hint, {**_default_values(fields[key]), **value})
        kwargs[key] = value
    return cls(**kwargs)


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (``None`` without one)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _reads_itself(cls: object) -> bool:
    """A dataclass with its own ``from_dict`` classmethod (its edge form differs from its fields)."""
    return dataclasses.is_dataclass(cls) and isinstance(cls, type) and callable(getattr(cls, "from_dict", None))


def _default_values(f: dataclasses.Field) -> dict[str, Any]:
    """The init fields of a dataclass-valued field's default instance ({} without a default)."""
    default = _default(f)
    if not dataclasses.is_dataclass(default):
        return {}
    return {g.name: getattr(default, g.name) for g in dataclasses.fields(default) if g.init}


def read_yaml_mapping(path: str | Path) -> dict:
    """A YAML file's top-level mapping (empty file: ``{}``); a missing file, a YAML syntax error (with its line and
    column) or a non-mapping top level is a one-line ``FileNotFoundError``/``ValueError`` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"config file {path} is not valid YAML{where}: {problem}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of field names to values, got {type(data).__name__}")
    return data


def load_yaml(cls: type[T], path: str | Path) -> T:
    """Load a dataclass config from a YAML file (top-level mapping = the dataclass fields)."""
    return from_dict(cls, read_yaml_mapping(path))
