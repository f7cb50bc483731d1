"""The wire format: bit-exact round trips, refusal of anything it does not know, and socket framing."""

import dataclasses
import math
import socket
import struct
import threading

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxflow.data.records import FinishedGroup, GroupTask, Sample
from jaxflow.transport import wire

# Bit patterns are generated as unsigned ints of the same width and viewed as the dtype, so every float
# (NaNs with payloads, infinities, subnormals, -0.0) is covered and compared bit for bit.
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@wire.register_wire_type
@dataclasses.dataclass
class _Point:
    """A test-only registered dataclass with an array field and a non-init field."""

    x: float
    label: str = ""
    values: np.ndarray | None = None
    cache: int = dataclasses.field(default=0, init=False)


@dataclasses.dataclass
class _Unregistered:
    x: int = 0


def _arrays(dtype_name: str, shape=None) -> st.SearchStrategy:
    dtype = wire._DTYPES[dtype_name]
    shapes = shape or hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
    if dtype == np.bool_:
        return hnp.arrays(np.bool_, shapes)
    return hnp.arrays(_BITS[dtype.itemsize], shapes).map(lambda a: a.view(dtype))


def _large_array(dtype_name: str, seed: int) -> np.ndarray:
    """An array big enough to travel in the tensor region rather than inline."""
    dtype = wire._DTYPES[dtype_name]
    bits = np.random.default_rng(seed).integers(0, 256, wire.INLINE_ARRAY_BYTES + 64, dtype=np.uint8)
    if dtype == np.bool_:
        bits &= 1
    return bits.view(dtype)


_dtype_names = st.sampled_from(wire.SUPPORTED_DTYPES)
_numpy_values = st.one_of(
    _dtype_names.flatmap(_arrays),
    _dtype_names.flatmap(lambda name: _arrays(name, (1,))).map(lambda a: a[0]),  # numpy scalars
    st.builds(_large_array, _dtype_names, st.integers(0, 2 ** 32)),
)
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=20), _numpy_values,
)
_samples = st.builds(
    Sample, tokens=st.lists(st.integers(0, 2 ** 31), max_size=8),
    logprobs=st.lists(st.floats(allow_nan=False), max_size=8),
    versions=st.lists(st.integers(0, 9), max_size=8),
    finish_reason=st.sampled_from([None, "stop", "length", "abort", "error"]))


def _values(leaves):
    return st.recursive(leaves, lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), children, max_size=4),
        st.builds(_Point, x=st.floats(allow_nan=False), label=st.text(max_size=5)),
        st.lists(_samples, max_size=3),
    ), max_leaves=20)


def assert_same(got, want):
    """Equality that is exact for numpy values (dtype, shape and bits) and reads tuples as lists."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got.tobytes() == want.tobytes()
    elif isinstance(want, float):
        assert type(got) is float and struct.pack("<d", got) == struct.pack("<d", want)
    elif isinstance(want, (list, tuple)):
        assert type(got) is list and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want)
        for field in dataclasses.fields(want):
            assert_same(getattr(got, field.name), getattr(want, field.name))
    else:
        assert type(got) is type(want) and got == want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values(_leaves))
def test_round_trip_is_exact(value):
    assert_same(wire.decode(wire.encode(value)), value)


@pytest.mark.parametrize("dtype_name", wire.SUPPORTED_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3), (1500,)])
def test_every_dtype_round_trips_bit_identically(dtype_name, shape):
    dtype = wire._DTYPES[dtype_name]
    bits = np.random.default_rng(0).integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        bits = bits & 1
    arr = bits.view(dtype).reshape(shape)
    out = wire.decode(wire.encode({"a": arr, "s": arr.reshape(-1)[:1].copy()}))
    assert_same(out["a"], arr)
    assert not out["a"].flags.writeable, "decoded arrays are read-only views"


def test_bfloat16_and_float8_keep_their_dtype():
    for dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        arr = np.array([1.5, -2.0, np.nan], dtype=dtype)
        out = wire.decode(wire.encode(arr))
        assert out.dtype == np.dtype(dtype) and out.tobytes() == arr.tobytes()
        scalar = wire.decode(wire.encode(arr[0]))
        assert isinstance(scalar, np.generic) and scalar.dtype == np.dtype(dtype)


def test_non_contiguous_and_big_endian_arrays():
    base = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    for arr in (base.T, base[::3, 1::2], np.arange(6, dtype=">i4"), np.asfortranarray(base)):
        out = wire.decode(wire.encode(arr))
        np.testing.assert_array_equal(out, arr)
        assert out.dtype == np.dtype(arr.dtype.name)


def test_large_arrays_are_views_of_the_message_without_copy():
    arr = np.arange(1 << 16, dtype=np.float32)
    parts = wire.encode_parts({"w": arr})
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), arr) for p in parts)
    data = bytearray(b"".join(parts))
    out = wire.decode(data)["w"]
    assert np.shares_memory(out, np.frombuffer(data, np.uint8))
    assert (out.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data) % 64 == 0, "64-byte aligned offset"


def test_rollout_types_round_trip():
    samples = [Sample([1, 2, 3], [-0.5, -1.0, -0.25], [4, 4, 5], "stop"), Sample([7], [-0.1], [5], None)]
    task = GroupTask(group_id=3, prompt=[10, 11], n=2, v_start=4, meta={"answer": 42}, partial=samples,
                     attempt=1)
    group = FinishedGroup(group_id=3, prompt=[10, 11], v_start=4, samples=samples, rewards=[1.0, 0.0],
                          meta={"answer": "42", "ids": (1, 2)}, step=6)
    out = wire.decode(wire.encode({"task": task, "groups": [group, group]}))
    assert out["task"] == task
    assert out["groups"][1].samples == samples
    assert out["groups"][0].meta["ids"] == [1, 2], "tuples arrive as lists"


def test_dataclass_with_array_and_non_init_field():
    point = _Point(1.5, "p", np.ones((2, 2048), np.float32))
    point.cache = 7
    out = wire.decode(wire.encode(point))
    assert out.cache == 7 and out.label == "p"
    np.testing.assert_array_equal(out.values, point.values)


def test_refuses_unregistered_and_unknown_types():
    for value in (_Unregistered(), object(), {1, 2}, lambda: 0, np.array(["a"]), np.zeros(2, np.complex64),
                  np.array([object()]), 2 ** 64, np.ma.masked_array([1, 2], mask=[0, 1])):
        with pytest.raises(wire.WireError):
            wire.encode(value)
    with pytest.raises(wire.WireError, match="not registered"):
        wire.encode([_Unregistered()])


def _message(header_obj, region: bytes = b"") -> bytes:
    """Builds a message by hand, the way a hostile peer could."""
    header = msgpack.packb(header_obj, use_bin_type=True)
    prefix = wire._PREFIX.pack(wire._MAGIC, len(header), len(region))
    pad = (-(len(prefix) + len(header)) % 64) if region else 0
    return prefix + header + bytes(pad) + region


def test_decoding_never_unpickles():
    import pickle

    # A class name that, if it were ever resolved and called, would run code.
    for name in ("os.system", "builtins.eval", "subprocess.Popen", "jaxflow.data.records.Sample2"):
        record = msgpack.ExtType(wire._EXT_DATACLASS, msgpack.packb([name, {"command": "touch /tmp/pwned"}]))
        with pytest.raises(wire.WireError, match="unknown wire type"):
            wire.decode(_message({"x": record}))
    # A pickle is not a message; neither is a pickle inside a bin field decoded as anything but bytes.
    with pytest.raises(wire.WireError):
        wire.decode(pickle.dumps({"a": 1}))
    assert wire.decode(_message({"p": pickle.dumps(Sample())}))["p"] == pickle.dumps(Sample())


def test_rejects_malformed_messages():
    good = wire.encode({"w": np.arange(2048, dtype=np.float64)})
    def inline(*fields):
        return _message(msgpack.ExtType(wire._EXT_ARRAY_INLINE, msgpack.packb(list(fields))))

    def reference(*fields, region=b""):
        return _message(msgpack.ExtType(wire._EXT_ARRAY_REF, msgpack.packb(list(fields))), region)

    cases = {
        "short": good[:10],
        "magic": b"XXXX" + good[4:],
        "truncated": good[:-1],
        "trailing": good + b"\0",
        "garbage header": wire._PREFIX.pack(wire._MAGIC, 3, 0) + b"\xc1\xc1\xc1",
        "unknown dtype": inline("complex64", [1], b"\0" * 8),
        "object dtype": inline("object", [1], b"\0" * 8),
        "byte count": inline("int32", [3], b"\0" * 8),
        "negative dim": inline("int8", [-1], b""),
        "huge shape": reference("int8", [2 ** 40, 2 ** 40], 0, 2 ** 63),
        "out of region": reference("int8", [64], 32, 64, region=bytes(64)),
        "unknown ext": _message(msgpack.ExtType(42, b"")),
        "unknown field": _message(msgpack.ExtType(wire._EXT_DATACLASS, msgpack.packb(
            ["jaxflow.data.records.Sample", {"tokenz": []}]))),
        "unhashable key": _message({(1, 2): 3}),
    }
    for what, data in cases.items():
        with pytest.raises(wire.WireError):
            wire.decode(data)
            pytest.fail(what)


def test_register_wire_type_checks_its_argument():
    with pytest.raises(TypeError):
        wire.register_wire_type(int)
    with pytest.raises(ValueError, match="already taken"):
        wire.register_wire_type(_Unregistered, name="jaxflow.data.records.Sample")


# --- framing ---------------------------------------------------------------------------------------

def test_frames_over_a_socketpair():
    a, b = socket.socketpair()
    with a, b:
        for payload in (b"", b"x", bytes(range(256)) * 300):
            wire.write_frame(a, payload)
            assert wire.read_frame(b) == payload
        wire.send_message(a, {"k": [1, 2]})
        assert wire.recv_message(b) == {"k": [1, 2]}


def test_a_64_mib_frame():
    arr = np.random.default_rng(0).integers(0, 2 ** 63, (64 << 20) // 8, dtype=np.int64)
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=wire.send_message, args=(a, {"w": arr, "v": 3}))
        sender.start()
        out = wire.recv_message(b)
        sender.join()
    assert out["v"] == 3
    np.testing.assert_array_equal(out["w"], arr)


def test_frame_too_large_is_raised_without_reading_the_body():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!Q", 1 << 40) + b"body")
        with pytest.raises(wire.FrameTooLarge) as info:
            wire.read_frame(b, max_bytes=1 << 20)
        assert info.value.size == 1 << 40 and isinstance(info.value, wire.WireError)
        assert b.recv(4) == b"body", "the body must still be unread"


def test_truncated_stream_raises_connection_error():
    a, b = socket.socketpair()
    with b:
        a.sendall(struct.pack("!Q", 100) + b"only a few bytes")
        a.close()
        with pytest.raises(ConnectionError, match="16 of the 100 bytes"):
            wire.read_frame(b)
    a, b = socket.socketpair()
    with b:
        a.sendall(b"\0\0\0")
        a.close()
        with pytest.raises(ConnectionError) as info:
            wire.read_frame(b)
        assert not isinstance(info.value, wire.ConnectionClosed)
    a, b = socket.socketpair()
    with b:
        a.close()
        with pytest.raises(wire.ConnectionClosed):
            wire.read_frame(b)
