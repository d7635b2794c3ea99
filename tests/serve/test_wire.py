"""msgpack-numpy framing: byte-compatible with openpi's client both ways; malformed frames are refused."""

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi_wire

from vla_runtime.serve import wire
from vla_runtime.serve.wire import DecodeLimits, WireError

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.float16, np.float32, np.float64, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES)
def test_openpi_packed_arrays_decode_exactly(dtype):
    rng = np.random.default_rng(0)
    array = (rng.random((3, 4, 2)) * 100).astype(dtype)
    message = {"observation/image": array, "nested": {"x": array[0], "list": [array[1], 3, "s"]}, "scalar": dtype(7)}
    out = wire.unpack(openpi_wire.packb(message))
    np.testing.assert_array_equal(out["observation/image"], array)
    assert out["observation/image"].dtype == np.dtype(dtype) and out["observation/image"].shape == (3, 4, 2)
    np.testing.assert_array_equal(out["nested"]["list"][0], array[1])
    assert out["nested"]["list"][1:] == [3, "s"]
    # np.float64 subclasses float, so msgpack packs it as a plain float without asking the hook
    assert out["scalar"] == dtype(7) and type(out["scalar"]) is (float if dtype is np.float64 else np.dtype(dtype).type)


def test_our_replies_decode_in_openpi():
    actions = np.random.default_rng(1).normal(size=(1, 7))
    reply = {"actions": actions, "server_timing": {"infer_ms": 1.5}, "n": np.int64(3), "empty": np.zeros((0, 7), np.float32)}
    out = openpi_wire.unpackb(wire.pack(reply))
    np.testing.assert_array_equal(out["actions"], actions)
    assert out["server_timing"] == {"infer_ms": 1.5} and out["n"] == 3 and out["empty"].shape == (0, 7)


def test_non_contiguous_arrays_are_sent_in_logical_order():
    a = np.arange(12, dtype=np.int32).reshape(3, 4).T  # Fortran-ordered view
    np.testing.assert_array_equal(openpi_wire.unpackb(wire.pack({"a": a}))["a"], a)


def test_object_arrays_are_never_sent():
    with pytest.raises(TypeError, match="dtype object"):
        wire.pack({"a": np.array([object()], dtype=object)})


def tagged(data: bytes, dtype, shape) -> bytes:
    return msgpack.packb({b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}, use_bin_type=True)


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        # pickle would be what an object array unpacks through: refused before anything is read
        (tagged(b"\x80\x04\x95" + b"\x00" * 13, "|O", [2]), "not allowed"),
        (tagged(b"\x00" * 16, "|V16", [1]), "not allowed"),
        (tagged(b"\x00" * 16, "<c16", [1]), "not allowed"),
        (tagged(b"\x00" * 8, "[('a', '<f4'), ('b', '<f4')]", [1]), "short numpy dtype"),
        (tagged(b"\x00" * 8, "<f4", [3]), "needs 12 bytes, got 8"),  # would read past the buffer
        (tagged(b"\x00" * 8, "<f4", [-2, -1]), "non-negative"),
        (tagged(b"\x00" * 8, "<f4", "2"), "list of non-negative"),
        (tagged(b"\x00" * 4, "<z4", [1]), "unknown array dtype"),
        (tagged(b"\x00" * 4, "not-a-dtype", [1]), "short numpy dtype"),
        (tagged("text", "<f4", [1]), "must be bytes"),
        (tagged(b"\x00", "|u1", [1] * 9), "9 dimensions"),
        (msgpack.packb({b"__ndarray__": True, b"dtype": "<f4"}), "no 'data' field"),
        (msgpack.packb({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}), "must be a number"),
        (msgpack.packb({b"__npgeneric__": True, b"data": 300, b"dtype": "|i1"}), "does not fit"),
        (b"\xc1", "not a valid msgpack frame"),  # reserved byte
        (b"\x93\x01", "not a valid msgpack frame"),  # truncated array
        (msgpack.packb(1) + msgpack.packb(2), "not a valid msgpack frame"),  # extra data
        (b"\x91" * 100_000 + b"\xc0", "not a valid msgpack frame"),  # nesting deeper than the unpacker's stack
        (msgpack.packb({1: 2}), "not a valid msgpack frame"),  # non-string map key
        (msgpack.packb(msgpack.ExtType(5, b"xyz")), "not a valid msgpack frame"),
        (msgpack.packb(list(range(5000))), "not a valid msgpack frame"),  # over max_container_len
        (tagged(b"", "(,)f4", [0]), "unknown array dtype"),  # numpy's parser raises SyntaxError for this one
        # nested containers under max_bytes and max_container_len that would decode into millions of objects
        (msgpack.packb({"x": [[{}] * 4096] * 4000}), "more than 65536 arrays, maps and entries"),
        (msgpack.packb({"x": [[1] * 4096] * 4000}), "more than 65536 arrays, maps and entries"),
    ],
)
def test_malformed_frames_are_refused(frame, match):
    with pytest.raises(WireError, match=match):
        wire.unpack(frame)


def test_frame_size_limit():
    frame = openpi_wire.packb({"a": np.zeros(100, np.uint8)})
    with pytest.raises(WireError, match=f"frame of {len(frame)} bytes exceeds the limit of 64"):
        wire.unpack(frame, DecodeLimits(max_bytes=64))
    with pytest.raises(WireError, match="expected a binary msgpack frame, got str"):
        wire.unpack("text")


def test_decoded_arrays_are_read_only_views():
    out = wire.unpack(openpi_wire.packb({"a": np.ones(4, np.float32)}))["a"]
    with pytest.raises(ValueError, match="read-only"):
        out[0] = 2


def test_the_item_limit_counts_nested_containers_and_entries():
    nested = msgpack.packb([[1, 2], {"a": [3]}])  # 4 containers, 6 entries: 10 items
    assert wire.unpack(nested, DecodeLimits(max_items=10)) == [[1, 2], {"a": [3]}]
    with pytest.raises(WireError, match="more than 9 arrays, maps and entries"):
        wire.unpack(nested, DecodeLimits(max_items=9))
