"""Typed reads of a JSON config dict (``config.json``): a field of the wrong type is a one-line ``ValueError``
naming the file, the key, what it holds and what was expected, instead of a traceback from ``int()`` deep in a
parser. A missing key or a JSON ``null`` gives the default."""

from __future__ import annotations

import math
from typing import Any, Callable

_REQUIRED = object()


def _is_int(v: Any) -> bool:  # 3 or 3.0; not true, "3", 2.5 or Infinity
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))


def _is_number(v: Any) -> bool:  # finite (Python's json reads NaN and Infinity)
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


class ConfigFields:
    """Reads of ``data`` whose errors name ``where`` (e.g. ``"runs/x/config.json text_config"``)."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where} is {_shown(data)}; expected a JSON object")
        self.data, self.where = data, where

    def int(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read(key, default, _is_int, "an integer", int)

    def float(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read(key, default, _is_number, "a finite number", float)

    def bool(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read(key, default, lambda v: isinstance(v, bool), "true or false", bool)

    def str(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read(key, default, lambda v: isinstance(v, str), "a string", str)

    def list(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read(key, default, lambda v: isinstance(v, list), "a list", list)

    def dict(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read(key, default, lambda v: isinstance(v, dict), "a JSON object", dict)

    def ints(self, key: str, default: Any) -> Any:
        """A list of integers or nulls (``None``); missing, null or empty gives ``default``."""
        return self._elements(key, default, _is_int, "a list of integers", int)

    def strs(self, key: str, default: Any) -> Any:
        """A list of strings or nulls (``None``); missing, null or empty gives ``default``."""
        return self._elements(key, default, lambda v: isinstance(v, str), "a list of strings", str)

    def _elements(self, key: str, default: Any, valid: Callable[[Any], bool], expected: str, convert: Callable) -> Any:
        values = self.list(key, [])
        if not values:
            return default
        if not all(v is None or valid(v) for v in values):
            raise ValueError(f"{self.where} `{key}` is {_shown(values)}; expected {expected}")
        return [None if v is None else convert(v) for v in values]

    def sub(self, key: str) -> "ConfigFields":
        """The object under ``key`` (``{}`` when missing), read with errors naming ``where key``."""
        return ConfigFields(self.dict(key, {}), f"{self.where} {key}")

    def _read(self, key: str, default: Any, valid: Callable[[Any], bool], expected: str, convert: Callable) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.where} has no `{key}`; expected {expected}")
            return default
        if not valid(value):
            raise ValueError(f"{self.where} `{key}` is {_shown(value)}; expected {expected}")
        return convert(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
