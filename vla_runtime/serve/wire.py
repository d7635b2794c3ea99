"""msgpack with numpy arrays: the framing openpi's websocket client speaks, decoded without pickle.

An array travels as a msgpack map ``{b"__ndarray__": True, b"data": <raw bytes>, b"dtype": "<f4",
b"shape": [..]}`` and a numpy scalar as ``{b"__npgeneric__": True, b"data": <value>, b"dtype": "<f8"}``
(the layout of ``openpi_client.msgpack_numpy``). Decoding accepts plain numeric dtypes only (bool,
signed/unsigned integers, floats): object, void, structured and complex dtypes are refused, and the byte
count must match the shape, so a message can neither run code nor make numpy read past its buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

ARRAY_TAG = b"__ndarray__"
SCALAR_TAG = b"__npgeneric__"
NUMERIC_KINDS = frozenset("biuf")  # bool, signed int, unsigned int, float


class WireError(ValueError):
    """A frame that is not valid msgpack-numpy, or breaks a decoding limit."""


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds applied while decoding one frame.

    Args:
        max_bytes: largest frame accepted (also what the websocket layer enforces).
        max_container_len: most entries of one msgpack array or map.
        max_items: most arrays, maps and their entries in the whole frame, nested ones included (a frame of
            nested empty containers small enough to pass ``max_bytes`` would otherwise decode into millions of
            Python objects: seconds of CPU and a gigabyte of memory).
        max_ndim: most dimensions of one array.
    """

    max_bytes: int = 16 * 2**20
    max_container_len: int = 4096
    max_items: int = 2**16
    max_ndim: int = 8

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_container_len", "max_items", "max_ndim"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")


def _encode(obj: Any) -> Any:
    """msgpack's ``default`` hook: numpy arrays and scalars to tagged maps."""
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind not in NUMERIC_KINDS:
        raise TypeError(f"cannot send numpy dtype {obj.dtype} (only bool, integer and float arrays)")
    if isinstance(obj, np.ndarray):
        return {ARRAY_TAG: True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {SCALAR_TAG: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    """``obj`` (dicts, lists, str, numbers, numpy arrays/scalars) -> one msgpack frame."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def _numeric_dtype(value: Any) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", errors="replace")
    if not isinstance(value, str) or len(value) > 8:
        raise WireError(f"array dtype must be a short numpy dtype string such as '<f4', got {value!r}")
    try:
        dtype = np.dtype(value)
    except Exception as e:  # noqa: BLE001 - numpy's dtype parser raises TypeError, ValueError, even SyntaxError
        raise WireError(f"unknown array dtype {value!r}") from e
    if dtype.kind not in NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError(f"array dtype {value!r} is not allowed (only bool, integer and float)")
    return dtype


def _field(obj: dict, name: bytes) -> Any:
    if name in obj:
        return obj[name]
    text = name.decode()
    if text in obj:
        return obj[text]
    raise WireError(f"numpy array entry has no {text!r} field")


class _Decoder:
    def __init__(self, limits: DecodeLimits) -> None:
        self.limits = limits
        self.items = 0  # arrays, maps and their entries decoded so far

    def count(self, container: list | dict) -> None:
        """Inner containers are finished (and counted) before the ones holding them."""
        self.items += 1 + len(container)
        if self.items > self.limits.max_items:
            raise WireError(f"frame holds more than {self.limits.max_items} arrays, maps and entries")

    def list_hook(self, obj: list) -> list:  # msgpack's list_hook: called for every array
        self.count(obj)
        return obj

    def __call__(self, obj: dict) -> Any:  # msgpack's object_hook: called for every map
        self.count(obj)
        if obj.get(ARRAY_TAG, obj.get(ARRAY_TAG.decode())) is True:
            return self._array(obj)
        if obj.get(SCALAR_TAG, obj.get(SCALAR_TAG.decode())) is True:
            dtype = _numeric_dtype(_field(obj, b"dtype"))
            value = _field(obj, b"data")
            if not isinstance(value, (bool, int, float)):
                raise WireError(f"numpy scalar data must be a number, got {type(value).__name__}")
            try:
                return dtype.type(value)
            except (OverflowError, ValueError) as e:
                raise WireError(f"numpy scalar {value!r} does not fit dtype {dtype}") from e
        return obj

    def _array(self, obj: dict) -> np.ndarray:
        dtype = _numeric_dtype(_field(obj, b"dtype"))
        data = _field(obj, b"data")
        shape = _field(obj, b"shape")
        if not isinstance(data, bytes):
            raise WireError(f"numpy array data must be bytes, got {type(data).__name__}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise WireError(f"numpy array shape must be a list of non-negative integers, got {shape!r}")
        if len(shape) > self.limits.max_ndim:
            raise WireError(f"numpy array has {len(shape)} dimensions; at most {self.limits.max_ndim} are accepted")
        expected = math.prod(shape) * dtype.itemsize
        if expected != len(data):
            raise WireError(f"numpy array of shape {list(shape)} and dtype {dtype.str} needs {expected} bytes, got {len(data)}")
        return np.frombuffer(data, dtype=dtype).reshape(shape)  # read-only view of the frame


def unpack(frame: bytes, limits: DecodeLimits | None = None) -> Any:
    """One msgpack frame -> Python objects with numpy arrays (read-only). ``WireError`` on anything malformed."""
    limits = limits or DecodeLimits()
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError(f"expected a binary msgpack frame, got {type(frame).__name__}")
    if len(frame) > limits.max_bytes:
        raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {limits.max_bytes}")
    n = limits.max_container_len
    decoder = _Decoder(limits)
    try:
        return msgpack.unpackb(
            frame, raw=False, strict_map_key=True, object_hook=decoder, list_hook=decoder.list_hook,
            max_array_len=n, max_map_len=n, max_ext_len=0,
        )  # fmt: skip
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, msgpack.UnpackException) as e:
        raise WireError(f"not a valid msgpack frame: {type(e).__name__}: {e}") from e
