"""User-facing cache selection: the mode and that cache's own hyper-parameters.

Past the YAML/CLI edge a ``KVConfig`` is ``mode: KVMode`` + ``params``, an instance of the mode's
``params_class`` (``FullParams``, ``SinkWindowParams``, ``ChunkedGatedParams``). At the edge it is one flat
mapping, spelled as it always was::

    kv: {mode: chunked, window: 48, chunk: 16, max_chunks: 64}

``KVConfig.from_dict`` / ``to_dict`` convert. Configs written before the registry held every cache's field
(``n_sink`` beside ``chunk``); such keys still load when they hold that cache's default.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .base import CacheParams
from .chunked_params import ChunkedGatedParams
from .geometry import CacheGeometry
from .registry import CACHES, KVMode
from .sink_window import SinkWindowParams

if typing.TYPE_CHECKING:
    from .gate import ChunkGateConfig


@dataclass(frozen=True)
class EdgeField:
    """One key of the flat YAML/CLI/ROS form of ``KVConfig`` (``KVConfig.edge_fields``)."""

    name: str
    type: Any  # resolved annotation, e.g. ``int | None``
    default: Any


@dataclass
class KVConfig:
    """Which cache a session uses and its hyper-parameters.

    Args:
        mode: the cache, a ``KVMode`` (a registry name such as ``"chunked"`` is parsed once, here).
        params: the mode's ``params_class`` instance; ``None`` = its defaults.
    """

    mode: KVMode = KVMode.FULL
    params: CacheParams | None = None

    def __post_init__(self) -> None:
        self.mode = KVMode.parse(self.mode)
        cls = self.mode.params_class
        if self.params is None:
            self.params = cls()
        if type(self.params) is not cls:
            raise ValueError(f"mode {self.mode.value!r} takes {cls.__name__} params, got {type(self.params).__name__}")

    @classmethod
    def of(cls, mode: KVMode | str, **params: Any) -> "KVConfig":
        """``KVConfig.of(KVMode.CHUNKED, window=48)``: the mode with its params built from keywords."""
        mode = KVMode.parse(mode)
        return cls(mode, mode.params_class(**params))

    # ---- the YAML/CLI edge -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: "KVConfig | None" = None) -> "KVConfig":
        """From the flat form ``{mode, <params of that mode>}``.

        Keys left out come from ``base`` when it has the same mode (a default overridden key by key), else
        from the mode's defaults. A key of another registered cache loads only at that cache's default (what
        older configs wrote); otherwise ``ValueError`` names it. Unknown keys raise ``ValueError`` too.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"KVConfig expects a mapping, got {type(data).__name__}")
        values = dict(data)
        mode = KVMode.parse(values.pop("mode", base.mode if base is not None else KVMode.FULL))
        own = {f.name for f in dataclasses.fields(mode.params_class)}
        known = {f.name for f in cls.edge_fields()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown KVConfig field(s) {unknown}; valid: {sorted(known)}")
        for key in sorted(set(values) - own):
            owners = [c for c in _params_classes() if key in _defaults(c)]
            if all(values[key] != _defaults(c)[key] for c in owners):
                names = ", ".join(m.value for m in KVMode if m.params_class in owners)
                raise ValueError(
                    f"`{key}` ({values[key]!r}) is a parameter of {names}, not of mode {mode.value!r} (its fields: {sorted(own)})"
                )
            del values[key]
        start = dataclasses.asdict(base.params) if base is not None and base.mode is mode else {}
        return cls(mode, mode.params_class(**{**start, **values}))

    def __repr__(self) -> str:
        """A Python expression that builds this config: ``KVConfig.of(KVMode.CHUNKED, window=48, ...)``."""
        params = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.params).items())
        return f"KVConfig.of(KVMode.{self.mode.name}{', ' if params else ''}{params})"

    def to_dict(self) -> dict[str, Any]:
        """The flat form: ``{"mode": name, **params}``."""
        return {"mode": self.mode.value, **dataclasses.asdict(self.params)}

    @staticmethod
    def edge_fields() -> tuple[EdgeField, ...]:
        """Every key the flat form may hold: ``mode``, then each registered cache's params (first seen wins)."""
        out = {"mode": EdgeField("mode", str, KVMode.FULL.value)}
        for c in _params_classes():
            hints = typing.get_type_hints(c)
            for f in dataclasses.fields(c):
                out.setdefault(f.name, EdgeField(f.name, hints[f.name], f.default))
        return tuple(out.values())

    # ---- what sessions ask -------------------------------------------------------------------------
    def for_step(self, tokens: int, *, whole_context: bool) -> "KVConfig":
        """Unset sizes filled from a policy step of ``tokens`` tokens (``CacheParams.for_step``)."""
        return replace(self, params=self.params.for_step(tokens, whole_context=whole_context))

    def gate_config(self, geometry: CacheGeometry) -> "ChunkGateConfig | None":
        """The ``ChunkGate`` the cache needs (its owner builds or loads it), ``None`` when it needs none."""
        return self.params.gate_config(geometry)


def _params_classes() -> list[type[CacheParams]]:
    return [c.params_class for c in CACHES.values()]


def _defaults(cls: type[CacheParams]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def matching_sink_window(chunked: KVConfig, *, n_sink: int = SinkWindowParams.n_sink) -> KVConfig:
    """The ``sink_window`` config that holds as many KV bytes as ``chunked`` at its full chunk budget.

    After every forward a chunked cache holds, per layer, the pinned prompt P, at most ``max_chunks`` chunk
    representatives M, the raw window W and fewer than C raw tokens waiting to form the next chunk: at most
    P + M + W + C - 1 tokens. A sink-window cache holds P + ``n_sink`` + W'. Equal bytes: W' = M + W + C - 1 - n_sink
    (same model, dtype and prompt; both caches hold one forward's new tokens on top while it runs).

    ``chunked`` needs ``KVMode.CHUNKED`` and explicit ``window`` and ``max_chunks``.
    """
    p = chunked.params
    if not isinstance(p, ChunkedGatedParams):
        raise ValueError(f"matching_sink_window takes a chunked KVConfig, got mode {chunked.mode.value!r}")
    if p.window is None or p.max_chunks is None:
        raise ValueError(
            f"matching_sink_window needs the chunked cache's `window` and `max_chunks` (got {p.window}, "
            f"{p.max_chunks}): the bytes it holds depend on both"
        )
    window = p.max_chunks + p.window + p.chunk - 1 - n_sink
    if window < 1:
        raise ValueError(f"a chunked cache this small ({chunked}) holds fewer tokens than the sink-window cache's sinks")
    return KVConfig.of(KVMode.SINK_WINDOW, capacity=p.capacity, window=window, n_sink=n_sink, backend=p.backend)
