"""Dataclass configs as ROS parameters: the specs to declare, and the values a node received read back.

A config's fields are its ROS parameters (nested dataclasses become dotted names, ``kv.mode``, unless the field's
metadata says ``inline``: then their fields are top-level names; ``KVConfig`` contributes its flat YAML keys,
``KVConfig.edge_fields``). ``param_specs`` lists them for ``declare_parameter`` and for the static tests that check
launch files and parameter YAMLs; ``config_from_params`` turns values back into the validated dataclass. ROS
parameters have no ``None``: an optional integer is ``0`` for "unset", an optional string is ``""``; an enum field
is a string parameter that the dataclass turns into its enum.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from rcl_interfaces.msg import ParameterDescriptor, ParameterType
from vla_runtime.kv.config import KVConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ParamSpec:
    """One ROS parameter derived from a dataclass field."""

    name: str  # dotted for nested configs: "kv.mode"
    kind: type  # bool, int, float, str, or list element type wrapped as list[...]
    default: Any  # a ROS-representable default (no None)
    description: str
    optional: bool  # the dataclass allows None; 0 / "" stands for it


def _unwrap(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


def param_specs(cls: type, prefix: str = "") -> list[ParamSpec]:
    """Every ROS parameter of dataclass ``cls`` (nested dataclasses flattened with dots)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        hint, optional = _unwrap(hints[f.name])
        name = prefix + f.name
        if hint is KVConfig:
            specs.extend(_kv_specs(name + "."))
            continue
        if dataclasses.is_dataclass(hint):
            specs.extend(param_specs(hint, prefix=prefix if f.metadata.get("inline") else name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, Enum):  # a string parameter; the dataclass turns it into its enum
            hint, default = str, default.value
        if default is None:
            default = {int: 0, str: "", float: 0.0}[hint]
        description = f.metadata.get("help", f"{cls.__name__}.{f.name}")
        if optional:
            description += " (0 or empty = unset)"
        specs.append(ParamSpec(name, hint, default, description, optional))
    return specs


def _kv_specs(prefix: str) -> list[ParamSpec]:
    """The cache's parameters: ``kv.mode`` and every registered cache's params, flat (``KVConfig.edge_fields``)."""
    specs = []
    for f in KVConfig.edge_fields():
        hint, optional = _unwrap(f.type)
        default = {int: 0, str: "", float: 0.0}[hint] if f.default is None else f.default
        description = f"KVConfig.{f.name}" + (" (0 or empty = unset)" if optional else "")
        specs.append(ParamSpec(prefix + f.name, hint, default, description, optional))
    return specs


def config_from_params(cls: type[T], values: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from flat ``{dotted name: value}``; types are checked and coerced.

    Raises ``ValueError`` naming the parameter, the value and the expected type.
    """
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        hint, optional = _unwrap(hints[f.name])
        name = prefix + f.name
        if hint is KVConfig:
            kwargs[f.name] = _kv_from_params(values, prefix=name + ".")
            continue
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = config_from_params(hint, values, prefix=prefix if f.metadata.get("inline") else name + ".")
            continue
        if name not in values:
            continue
        kwargs[f.name] = _coerce(name, values[name], str if isinstance(hint, type) and issubclass(hint, Enum) else hint, optional)
    return cls(**kwargs)


def _kv_from_params(values: dict[str, Any], prefix: str) -> KVConfig:
    """``KVConfig`` from its flat ``kv.*`` parameters (``KVConfig.from_dict`` says which belong to the mode)."""
    flat = {}
    for spec in _kv_specs(prefix):
        if spec.name in values:
            flat[spec.name[len(prefix) :]] = _coerce(spec.name, values[spec.name], spec.kind, spec.optional)
    return KVConfig.from_dict(flat)


def _coerce(name: str, value: Any, hint: Any, optional: bool) -> Any:
    if optional and value in (0, "", None):
        return None
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"parameter `{name}` is {value!r}; expected a list of {item.__name__}")
        return [_coerce(f"{name}[{i}]", v, item, False) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ValueError(f"parameter `{name}` is {value!r} ({type(value).__name__}); expected {hint.__name__}")
    return value


_PARAMETER_TYPES = {
    bool: ParameterType.PARAMETER_BOOL,
    int: ParameterType.PARAMETER_INTEGER,
    float: ParameterType.PARAMETER_DOUBLE,
    str: ParameterType.PARAMETER_STRING,
    list[bool]: ParameterType.PARAMETER_BOOL_ARRAY,
    list[int]: ParameterType.PARAMETER_INTEGER_ARRAY,
    list[float]: ParameterType.PARAMETER_DOUBLE_ARRAY,
    list[str]: ParameterType.PARAMETER_STRING_ARRAY,
}


def declare_config(node: Any, cls: type) -> None:
    """Declare every parameter of dataclass ``cls`` on ``node`` with its default and description.

    Floats accept integers too (``control_rate_hz: 10`` in a YAML file); ``config_from_params``
    converts them and rejects anything else with a message naming the parameter. Lists with an
    empty default are declared by type (rclpy cannot infer one from ``[]``) and read back as unset.
    """
    from rclpy.exceptions import InvalidParameterTypeException
    from rclpy.parameter import Parameter

    for spec in param_specs(cls):
        descriptor = ParameterDescriptor(description=spec.description)
        try:
            if spec.kind is float:
                descriptor.dynamic_typing = True
                node.declare_parameter(spec.name, spec.default, descriptor)
            elif spec.default == []:
                node.declare_parameter(spec.name, Parameter.Type(_PARAMETER_TYPES[spec.kind]), descriptor)
            else:
                node.declare_parameter(spec.name, spec.default, descriptor)
        except InvalidParameterTypeException as e:  # a value of another type from the command line or a params file
            raise ValueError(f"parameter `{spec.name}` has the wrong type ({e}); expected {_expected(spec)}") from e


def read_config(node: Any, cls: type[T]) -> T:
    """The node's current parameter values as a validated ``cls`` (``ValueError`` when invalid)."""
    from rclpy.exceptions import ParameterUninitializedException

    values = {}
    for spec in param_specs(cls):
        try:
            values[spec.name] = node.get_parameter(spec.name).value
        except ParameterUninitializedException:  # an empty list nobody set: keep the default
            continue
    return config_from_params(cls, values)


def _expected(spec: ParamSpec) -> str:
    """How a parameter of ``spec.kind`` is written, for errors."""
    kind = getattr(spec.kind, "__name__", str(spec.kind))
    return {"int": "an integer", "bool": "true or false", "str": "a string", "float": "a number"}.get(kind, f"a {kind}")
