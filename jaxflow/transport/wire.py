"""The wire format between jaxflow processes: msgpack messages with raw tensor bytes, and socket framing.

Nothing here ever unpickles. A message decodes only to msgpack's plain types (None, bool, int, float, str,
bytes, list, dict), numpy arrays and scalars of a fixed set of dtypes, and instances of dataclasses that
were registered with `register_wire_type`; anything else in a message is refused with `WireError`.

A message (what `encode` returns and `decode` takes) is

    b"JFW\\x01" | header length H: u64 BE | tensor region length R: u64 BE | msgpack header (H bytes)
    | zero padding to a multiple of 64 | tensor region (R bytes; absent when R == 0)

Small arrays and numpy scalars travel inside the msgpack header. Arrays of `INLINE_ARRAY_BYTES` or more
travel as raw C-order little-endian bytes in the tensor region, each at a 64-byte aligned offset, and the
header refers to them by (dtype name, shape, offset, byte count). This keeps large tensors out of
msgpack: `encode_parts` hands them to the socket as views without copying, and `decode` returns them as
views into the received buffer.

Decoded arrays are read-only views of the message buffer (copy one to modify it). A view keeps the whole
buffer alive, so copy a small array out of a large message if it must outlive the rest.

Tuples decode as lists (msgpack has one sequence type). Dict keys may be str, int or bytes.

Socket framing is independent of the message format: `write_frame` sends an 8-byte big-endian length
and then the payload; `read_frame` reads one such frame into a fresh buffer that grows as the bytes
arrive, never ahead of them by more than 1 MiB, with optional idle and per-frame timeouts.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ml_dtypes
import msgpack
import numpy as np

from jaxflow.data import records

DEFAULT_MAX_FRAME_BYTES = 1 << 30

# Arrays at least this big go to the tensor region rather than inline in the msgpack header: below it, the
# 64-byte alignment padding and the extra bookkeeping cost more than the copy into msgpack saves.
INLINE_ARRAY_BYTES = 4096

_ALIGN = 64
_MAGIC = b"JFW\x01"
_PREFIX = struct.Struct("!4sQQ")
_FRAME_LENGTH = struct.Struct("!Q")
_MAX_NDIM = 64

# ExtType codes. The numbers are part of the wire format: never reuse one for something else.
_EXT_ARRAY_INLINE = 1  # [dtype name, shape (None for a numpy scalar), raw bytes]
_EXT_ARRAY_REF = 2  # [dtype name, shape, offset in the tensor region, byte count]
_EXT_DATACLASS = 3  # [registered name, {field name: value}]

_DTYPES: dict[str, np.dtype] = {
    np.dtype(t).name: np.dtype(t)
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float16, np.float32, np.float64,
              ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(_DTYPES)
"""The dtype names an array or numpy scalar may have on the wire."""

# The tensor region is little-endian; decoding views it with native dtypes, which needs a little-endian
# host (every platform jaxflow targets is one).
assert sys.byteorder == "little", "jaxflow.transport.wire assumes a little-endian host"


class WireError(ValueError):
    """A value that cannot be encoded, or bytes that are not a valid jaxflow message."""


class FrameTooLarge(WireError):
    """A frame declared more bytes than the reader allows. The body was not read, so the stream is
    out of step and the connection must be closed.

    size: the declared length in bytes. limit: the reader's maximum.
    """

    def __init__(self, size: int, limit: int):
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class ConnectionClosed(ConnectionError):
    """The peer closed the connection cleanly, between two frames."""


# --- registered dataclasses ------------------------------------------------------------------------

_TYPES_BY_NAME: dict[str, type] = {}
_NAMES_BY_TYPE: dict[type, str] = {}

_T = TypeVar("_T", bound=type)


def register_wire_type(cls: _T | None = None, *, name: str | None = None):
    """Allows instances of the dataclass `cls` to cross the wire. Usable as `@register_wire_type`.

    The class travels by `name` (default "module.QualName"), so both ends must register it under the same
    name, usually by importing the module that defines it. An instance is encoded as its fields
    (`dataclasses.fields`, recursively encoded) and decoded by calling the class with its init fields, then
    setting the others; so `__post_init__` validation also runs on the receiving side.
    """

    def register(klass: _T) -> _T:
        if not (isinstance(klass, type) and dataclasses.is_dataclass(klass)):
            raise TypeError(f"register_wire_type: {klass!r} is not a dataclass")
        wire_name = name or f"{klass.__module__}.{klass.__qualname__}"
        known = _TYPES_BY_NAME.get(wire_name)
        if known is not None and known is not klass:
            raise ValueError(f"register_wire_type: the name {wire_name!r} is already taken by {known!r}")
        _TYPES_BY_NAME[wire_name] = klass
        _NAMES_BY_TYPE[klass] = wire_name
        return klass

    return register if cls is None else register(cls)


# A Sample's routes (a mixture-of-experts policy's experts per token, `records.RouteSpec`) are an integer array:
# they travel as raw bytes like any other, one byte per expert id for up to 128 experts.
for _cls in (records.Sample, records.GroupTask, records.FinishedGroup, records.ConsumedBatch, records.RouteSpec):
    register_wire_type(_cls)


# --- encoding ----------------------------------------------------------------------------------------

def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pack(obj: Any, default) -> bytes:
    # strict_types sends subclasses of the msgpack types (numpy float64 is a float, IntEnum an int) through
    # `default`, so numpy scalars keep their dtype and the rest are reduced to plain values explicitly.
    return msgpack.packb(obj, default=default, use_bin_type=True, strict_types=True)


class _Encoder:
    """Packs one message, collecting the large arrays of the tensor region on the side."""

    def __init__(self):
        self.region: list[memoryview | bytes] = []
        self.region_bytes = 0

    def default(self, obj: Any) -> Any:
        if isinstance(obj, (np.ndarray, np.generic)):
            return self._array(obj)
        if isinstance(obj, tuple):
            return list(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return self._dataclass(obj)
        # Subclasses of plain types (IntEnum, StrEnum, OrderedDict, ...) travel as the plain type.
        for base in (bool, int, float, str, bytes, list, dict):
            if isinstance(obj, base):
                return base(obj)
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(obj, jax.Array):
            return self._array(np.asarray(obj))
        raise WireError(f"cannot encode an object of type {type(obj).__module__}.{type(obj).__qualname__}")

    def _array(self, value: np.ndarray | np.generic) -> msgpack.ExtType:
        if isinstance(value, np.ma.MaskedArray):
            raise WireError("cannot encode a masked array: the mask would be lost")
        scalar = isinstance(value, np.generic)
        arr = np.asarray(value)
        expected = _DTYPES.get(arr.dtype.name)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if expected is None or arr.dtype != expected:
            raise WireError(f"cannot encode dtype {arr.dtype} on the wire; supported: {', '.join(_DTYPES)}")
        if not arr.flags.c_contiguous:
            # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
            arr = arr.copy(order="C")
        # A uint8 view exports a buffer for every dtype (numpy refuses one for bfloat16 and the float8s).
        raw = arr.reshape(-1).view(np.uint8)
        if scalar or arr.nbytes < INLINE_ARRAY_BYTES:
            shape = None if scalar else list(arr.shape)
            return msgpack.ExtType(_EXT_ARRAY_INLINE, _pack([expected.name, shape, raw.tobytes()], None))
        offset = _align(self.region_bytes)
        if offset > self.region_bytes:
            self.region.append(bytes(offset - self.region_bytes))
        self.region.append(memoryview(raw))
        self.region_bytes = offset + arr.nbytes
        reference = [expected.name, list(arr.shape), offset, arr.nbytes]
        return msgpack.ExtType(_EXT_ARRAY_REF, _pack(reference, None))

    def _dataclass(self, obj: Any) -> msgpack.ExtType:
        name = _NAMES_BY_TYPE.get(type(obj))
        if name is None:
            raise WireError(f"cannot encode an instance of {type(obj).__module__}.{type(obj).__qualname__}: "
                            f"its dataclass is not registered with jaxflow.transport.wire.register_wire_type")
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_EXT_DATACLASS, _pack([name, fields], self.default))


def encode_parts(obj: Any) -> list[bytes | memoryview]:
    """Encodes `obj` as a message, returned as a list of buffers to send in order.

    The tensor region's buffers are views of the arrays in `obj` (no copy), so send them before mutating
    those arrays. Raises WireError for anything that is not wire-encodable.
    """
    encoder = _Encoder()
    try:
        header = _pack(obj, encoder.default)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise WireError(f"cannot encode message: {exc}") from exc
    prefix = _PREFIX.pack(_MAGIC, len(header), encoder.region_bytes)
    parts: list[bytes | memoryview] = [prefix, header]
    if encoder.region_bytes:
        header_end = _PREFIX.size + len(header)
        padding = _align(header_end) - header_end
        if padding:
            parts.append(bytes(padding))
        parts.extend(encoder.region)
    return parts


def encode(obj: Any) -> bytes:
    """Encodes `obj` as one message. Raises WireError for anything that is not wire-encodable."""
    return b"".join(encode_parts(obj))


# --- decoding ----------------------------------------------------------------------------------------

# Decoding limits. One msgpack byte can become a Python object of 56 to 72 bytes (an empty array or map),
# and each level of nested records (msgpack extensions) is a copy of all it holds, so a few MB of hostile
# header could cost hundreds of MB or more. What decoding builds is therefore charged against a budget
# proportional to the header: the containers (arrays, maps) at their Python size, the extension payloads
# while they are decoded, the inline arrays' bytes. Ordinary messages (lists of token ids, log-probs,
# records) cost 1 to 4 bytes per header byte by this count.
DECODE_BASE_BYTES = 1 << 20
DECODE_BYTES_PER_HEADER_BYTE = 8


def _check_complete(data) -> None:
    """Walks `data` without building anything and raises WireError unless it is exactly one complete
    msgpack object.

    msgpack allocates an array's item slots when it reads the array's length, before the items: a header
    of nested arrays each declaring millions of items it does not hold would cost memory in proportion to
    the declared lengths times the depth. In a complete object every declared item takes at least a byte
    that follows, so once this check passes those allocations are bounded by the data's size."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        unpacker.skip()
    except msgpack.OutOfData:
        raise WireError(f"incomplete msgpack data: its {len(data)} bytes end inside an object that "
                        f"declares more") from None
    except (ValueError, TypeError) as exc:
        raise WireError(f"cannot decode message: {type(exc).__name__}: {exc}") from exc
    if unpacker.tell() != len(data):
        raise WireError(f"{len(data) - unpacker.tell()} bytes of extra data after the msgpack object")


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code} inside an inline array")


class _Decoder:
    """Unpacks one message whose tensor region lies in `buffer` from `region_start` on, within a budget
    proportional to its `header_bytes` (see DECODE_BYTES_PER_HEADER_BYTE)."""

    def __init__(self, buffer, region_start: int, region_bytes: int, header_bytes: int):
        self.buffer = buffer
        self.region_start = region_start
        self.region_bytes = region_bytes
        self.header_bytes = header_bytes
        self.budget = DECODE_BASE_BYTES + DECODE_BYTES_PER_HEADER_BYTE * header_bytes
        self.spent = 0

    def _charge(self, nbytes: int) -> None:
        self.spent += nbytes
        if self.spent > self.budget:
            raise WireError(
                f"message too costly to decode: its {self.header_bytes}-byte header would build more than "
                f"{self.budget} bytes of objects (the limit is {DECODE_BASE_BYTES} + "
                f"{DECODE_BYTES_PER_HEADER_BYTE} x the header bytes)")

    def _container(self, value: Any) -> Any:
        self._charge(sys.getsizeof(value))
        return value

    def unpack(self, data, ext_hook=None) -> Any:
        _check_complete(data)
        return msgpack.unpackb(data, ext_hook=ext_hook or _no_ext, list_hook=self._container,
                               object_hook=self._container, raw=False, strict_map_key=False,
                               use_list=True)

    def ext_hook(self, code: int, data: bytes) -> Any:
        # The payload is a copy that lives while it is decoded, nested ones inside it included.
        self._charge(len(data))
        try:
            if code == _EXT_ARRAY_INLINE:
                return self._inline_array(data)
            if code == _EXT_ARRAY_REF:
                return self._region_array(data)
            if code == _EXT_DATACLASS:
                return self._dataclass(data)
            raise WireError(f"unknown msgpack extension type {code}")
        finally:
            self.spent -= len(data)

    @staticmethod
    def _dtype_and_shape(name: Any, shape: Any) -> tuple[np.dtype, tuple[int, ...], int]:
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise WireError(f"unknown dtype {name!r} on the wire; supported: {', '.join(_DTYPES)}")
        if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise WireError(f"invalid array shape {shape!r}")
        return dtype, tuple(shape), math.prod(shape) * dtype.itemsize

    def _inline_array(self, data: bytes) -> np.ndarray | np.generic:
        fields = self.unpack(data)
        if not (isinstance(fields, list) and len(fields) == 3 and isinstance(fields[2], bytes)):
            raise WireError("malformed inline array")
        self._charge(len(fields[2]))
        name, shape, raw = fields
        scalar = shape is None
        dtype, shape, nbytes = self._dtype_and_shape(name, [] if scalar else shape)
        if nbytes != len(raw):
            raise WireError(f"array of shape {shape} and dtype {dtype.name} needs {nbytes} bytes, "
                            f"got {len(raw)}")
        arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
        return arr[()] if scalar else arr

    def _region_array(self, data: bytes) -> np.ndarray:
        fields = self.unpack(data)
        if not (isinstance(fields, list) and len(fields) == 4):
            raise WireError("malformed array reference")
        name, shape, offset, count = fields
        dtype, shape, nbytes = self._dtype_and_shape(name, shape)
        if (type(offset) is not int or count != nbytes or offset < 0
                or offset + nbytes > self.region_bytes):
            raise WireError(f"array reference ({offset}, {count}) does not fit shape {shape} of "
                            f"{dtype.name} in a tensor region of {self.region_bytes} bytes")
        arr = np.frombuffer(self.buffer, dtype=dtype, count=math.prod(shape),
                            offset=self.region_start + offset).reshape(shape)
        # Read-only like the inline arrays (views of immutable bytes), whatever buffer this came in.
        arr.flags.writeable = False
        return arr

    def _dataclass(self, data: bytes) -> Any:
        fields = self.unpack(data, self.ext_hook)
        if not (isinstance(fields, list) and len(fields) == 2 and isinstance(fields[1], dict)):
            raise WireError("malformed dataclass record")
        name, values = fields
        cls = _TYPES_BY_NAME.get(name) if isinstance(name, str) else None
        if cls is None:
            raise WireError(f"unknown wire type {name!r}: only classes registered with "
                            f"jaxflow.transport.wire.register_wire_type are decoded")
        declared = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in values if k not in declared)
        if unknown:
            raise WireError(f"wire type {name!r} has no fields {unknown}")
        init = {k: v for k, v in values.items() if declared[k].init}
        try:
            obj = cls(**init)
            for key, value in values.items():
                if not declared[key].init:
                    object.__setattr__(obj, key, value)
        except (TypeError, ValueError) as exc:
            raise WireError(f"cannot build wire type {name!r}: {exc}") from exc
        return obj


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Decodes one message made by `encode` / `encode_parts`.

    Arrays come back as read-only views into `data` (see the module docstring). Raises WireError for
    anything that is not a valid message: a bad prefix, truncation, an unknown dtype or an unregistered
    type name, or a header that would build more than DECODE_BASE_BYTES + DECODE_BYTES_PER_HEADER_BYTE x
    its size in objects; no bytes are ever interpreted as code.
    """
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if len(view) < _PREFIX.size:
        raise WireError(f"message of {len(view)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    magic, header_bytes, region_bytes = _PREFIX.unpack_from(view, 0)
    if magic != _MAGIC:
        raise WireError(f"not a jaxflow wire message (prefix {bytes(magic)!r}, expected {_MAGIC!r})")
    header_end = _PREFIX.size + header_bytes
    region_start = _align(header_end) if region_bytes else header_end
    if len(view) != region_start + region_bytes:
        raise WireError(f"message is {len(view)} bytes but its prefix declares "
                        f"{region_start + region_bytes} (header {header_bytes}, tensors {region_bytes})")
    decoder = _Decoder(view, region_start, region_bytes, header_bytes)
    try:
        return decoder.unpack(view[_PREFIX.size:header_end], decoder.ext_hook)
    except WireError:
        raise
    except (TypeError, ValueError, RecursionError) as exc:
        # msgpack's own errors (ExtraData, FormatError, StackError, unhashable keys) are ValueErrors and
        # TypeErrors: report them all as a bad message.
        raise WireError(f"cannot decode message: {type(exc).__name__}: {exc}") from exc


# --- framing -----------------------------------------------------------------------------------------

# Below this many bytes a frame is joined into one buffer and sent with one call: cheaper than a
# gathered write, and it avoids a small length prefix waiting alone in a packet.
_JOIN_BELOW = 1 << 16
# Buffers per sendmsg call, under every platform's IOV_MAX.
_MAX_IOV = 512


def _byte_view(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _send_gathered(sock: socket.socket, views: list[memoryview]) -> None:
    sendmsg = getattr(sock, "sendmsg", None)
    if sendmsg is None:
        for view in views:
            sock.sendall(view)
        return
    first = 0
    while first < len(views):
        sent = sendmsg(views[first:first + _MAX_IOV])
        while sent:
            size = len(views[first])
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0


def write_frame(sock: socket.socket, payload: bytes | bytearray | memoryview | Sequence[Any]) -> None:
    """Sends one frame: an 8-byte big-endian length, then `payload`.

    `payload` is one bytes-like object or a sequence of them (as from `encode_parts`), sent in order as one
    frame without joining large buffers.
    """
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    views = [v for v in map(_byte_view, parts) if len(v)]
    total = sum(len(v) for v in views)
    length = _FRAME_LENGTH.pack(total)
    if total < _JOIN_BELOW:
        sock.sendall(b"".join([length, *views]))
    else:
        _send_gathered(sock, [memoryview(length), *views])


class FrameTimeout(TimeoutError):
    """A frame did not arrive in time: no frame began within the idle timeout (`received` is None), or
    a begun frame was not complete within the frame timeout (`received` of `size` bytes had come; `size`
    is None when even the 8-byte length was incomplete). Either way the stream is out of step and the
    connection must be closed.
    """

    def __init__(self, message: str, seconds: float, received: int | None = None, size: int | None = None):
        super().__init__(message)
        self.seconds = seconds
        self.received = received
        self.size = size


# A frame's buffer grows by at most this many bytes ahead of the bytes received, so a length prefix alone
# (up to the reader's limit) costs no memory until its body actually arrives.
_GROW_BYTES = 1 << 20
_ZEROS = memoryview(bytes(_GROW_BYTES))


class _Deadline:
    """Socket timeouts for one frame: `idle` seconds for its first byte, then `frame` seconds in all for
    the rest (a deadline, so a peer dripping a byte at a time cannot hold the reader). Both None: the
    socket's own timeout applies, unchanged."""

    def __init__(self, sock: socket.socket, idle: float | None, frame: float | None):
        self.sock = sock
        self.idle = idle
        self.frame = frame
        self.active = idle is not None or frame is not None
        self.deadline: float | None = None
        if self.active:
            sock.settimeout(idle)

    def started(self) -> None:
        if self.active and self.frame is not None:
            self.deadline = time.monotonic() + self.frame

    def recv_into(self, view: memoryview, got: int, size: int | None) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self.stalled(got, size)
            self.sock.settimeout(left)
        try:
            return self.sock.recv_into(view)
        except TimeoutError:
            if not self.active:
                raise
            if self.deadline is None:
                raise FrameTimeout(f"no frame began within the idle timeout of {self.idle} s",
                                   self.idle) from None
            raise self.stalled(got, size) from None

    def stalled(self, got: int, size: int | None) -> FrameTimeout:
        of = f"{size} bytes" if size is not None else f"its {_FRAME_LENGTH.size}-byte length"
        return FrameTimeout(f"a frame stalled: {got} of {of} arrived within the frame timeout of "
                            f"{self.frame} s", self.frame, got, size)


def read_frame(sock: socket.socket, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, *,
               idle_timeout: float | None = None, frame_timeout: float | None = None,
               reserve: Callable[[int], None] | None = None) -> bytearray:
    """Reads one frame written by `write_frame` and returns its payload (a bytearray, so that its
    memory can be viewed without a copy).

    The payload's buffer grows as its bytes arrive (at most 1 MiB ahead of them), so a peer that declares
    a large frame and sends nothing costs nothing. idle_timeout: seconds to wait for a frame's first byte;
    frame_timeout: seconds for the whole rest of the frame once begun; either raises FrameTimeout (both
    None: the socket's own timeout, as it was set, applies to each receive and raises TimeoutError).
    reserve: called with the number of bytes before each growth of the buffer; what it raises propagates
    (a server's budget for all the requests it is reading).
    Raises FrameTooLarge, before reading the body, when the declared length exceeds `max_bytes`;
    ConnectionClosed when the peer closed between frames; ConnectionError when it closed mid-frame. After
    any of these errors the stream is out of step.
    """
    reader = _Deadline(sock, idle_timeout, frame_timeout)
    head = bytearray(_FRAME_LENGTH.size)
    got = 0
    with memoryview(head) as view:
        while got < len(head):
            n = reader.recv_into(view[got:], got, None)
            if n == 0:
                if got == 0:
                    raise ConnectionClosed("the peer closed the connection")
                raise ConnectionError(f"connection closed after {got} of the {len(head)} bytes of a frame "
                                      f"length")
            if got == 0:
                reader.started()
            got += n
    (size,) = _FRAME_LENGTH.unpack(head)
    if size > max_bytes:
        raise FrameTooLarge(size, max_bytes)
    body = bytearray()
    got = 0
    while got < size:
        if got == len(body):
            grow = min(_GROW_BYTES, size - got)
            if reserve is not None:
                reserve(grow)
            body += _ZEROS[:grow]
        with memoryview(body) as view:
            n = reader.recv_into(view[got:], got, size)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of the {size} bytes of a frame")
        got += n
    return body


def send_message(sock: socket.socket, obj: Any) -> None:
    """Encodes `obj` and sends it as one frame, without copying large arrays."""
    write_frame(sock, encode_parts(obj))


def recv_message(sock: socket.socket, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """Reads one frame and decodes it; arrays are views into the received frame."""
    return decode(read_frame(sock, max_bytes))
