"""Tests for jaxflow.models.safetensors_io: round trips, parity with the `safetensors` package, corrupt files."""
import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy
import safetensors.torch as safetensors_torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxflow.models.safetensors_io import (
    INDEX_FILE_NAME,
    SINGLE_FILE_NAME,
    CheckpointError,
    CheckpointReader,
    SafetensorsFile,
    write_checkpoint,
    write_safetensors,
)

DTYPES = [
    np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
    np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8, np.bool_,
]


def _raw(array) -> bytes:
    """The array's bytes in C order; for comparing bit patterns (NaN payloads included) across dtypes."""
    return np.asarray(array, order="C").reshape(-1).view(np.uint8).tobytes()


def _random_array(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    """Random bit patterns (NaNs, infs and subnormals included) of `dtype`, except bool, which must be 0 or 1."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    return np.frombuffer(rng.bytes(size * dtype.itemsize), dtype=dtype).reshape(shape).copy()


def _corrupt(path, header: dict | bytes, data: bytes = b"", header_len: int | None = None):
    """Writes a safetensors-like file with a hand-made header, to test the validator."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def _sparse_file(path, header_len: int):
    """A file just big enough for a `header_len`-byte header, holes instead of data so it costs no disk or time."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len))
        f.truncate(8 + header_len)
    return path


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(specs=st.dictionaries(st.text("abcdefgh._", min_size=1, max_size=6),
                             st.tuples(st.sampled_from(DTYPES), shapes), max_size=6),
       seed=st.integers(0, 2**31))
def test_round_trip_is_bit_identical(tmp_path_factory, specs, seed):
    rng = np.random.default_rng(seed)
    tensors = {name: _random_array(rng, dtype, shape) for name, (dtype, shape) in specs.items()}
    path = tmp_path_factory.mktemp("rt") / "x.safetensors"
    write_safetensors(path, tensors, metadata={"k": "v"})
    with SafetensorsFile(path) as f:
        assert f.names() == sorted(tensors)
        assert f.metadata == {"k": "v"}
        for name, expected in tensors.items():
            assert f.shape(name) == expected.shape
            assert f.dtype(name) == expected.dtype
            got = f.get(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert _raw(got) == _raw(expected)


def test_get_is_a_read_only_view_that_outlives_close(tmp_path):
    path = tmp_path / "x.safetensors"
    expected = np.arange(1000, dtype=np.float32).reshape(10, 100)
    write_safetensors(path, {"w": expected, "b": np.ones(3, ml_dtypes.bfloat16)})
    f = SafetensorsFile(path)
    w = f.get("w")
    assert not w.flags.writeable and not w.flags.owndata
    assert w.flags.aligned
    with pytest.raises(ValueError):
        w[0, 0] = 1.0
    f.close()  # must not raise although `w` still references the mapping
    np.testing.assert_array_equal(w, expected)
    with pytest.raises(CheckpointError, match="closed"):
        f.get("w")


def test_every_tensor_is_aligned(tmp_path):
    # Mixed item sizes in name order would misalign the f32 after 3 bytes of int8; the writer's layout avoids it.
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.zeros(3, np.int8), "b": np.zeros(5, np.float32), "c": np.zeros(1, np.float64)})
    with SafetensorsFile(path) as f:
        for name in f.names():
            assert f.get(name).flags.aligned


def test_non_contiguous_and_big_endian_inputs(tmp_path):
    path = tmp_path / "x.safetensors"
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    write_safetensors(path, {"t": base.T, "be": base.astype(">f4")})
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.get("t"), base.T)
        np.testing.assert_array_equal(f.get("be"), base)
        assert f.dtype("be") == np.dtype("<f4")


def test_write_rejects_unsupported_dtype_and_bad_metadata(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match=r"x\.safetensors.*'c'.*complex64"):
        write_safetensors(path, {"c": np.zeros(2, np.complex64)})
    with pytest.raises(CheckpointError, match="metadata must map strings"):
        write_safetensors(path, {}, metadata={"n": 1})
    assert not path.exists() and list(tmp_path.iterdir()) == []


# --- parity with the reference implementation -------------------------------------------------------------------

TORCH_DTYPES = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e5m2: ml_dtypes.float8_e5m2, torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}


def _torch_raw(t) -> bytes:
    if t.numel() == 0:
        return b""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _torch_tensors(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tensors = {}
    for i, (torch_dtype, np_dtype) in enumerate(TORCH_DTYPES.items()):
        for shape in [(3, 5), (), (0, 4)]:
            raw = np.frombuffer(_raw(_random_array(rng, np_dtype, shape)), np.uint8).copy()
            # torch cannot reinterpret an empty byte tensor (its stride is 0), so empty tensors are made directly.
            tensors[f"t{i}.{len(shape)}"] = (torch.from_numpy(raw).view(torch_dtype).reshape(shape) if raw.size
                                            else torch.empty(shape, dtype=torch_dtype))
    return tensors


def test_reads_files_written_by_safetensors_torch(tmp_path):
    path = tmp_path / "ref.safetensors"
    tensors = _torch_tensors(0)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    with SafetensorsFile(path) as f:
        assert f.names() == sorted(tensors)
        assert f.metadata == {"format": "pt"}
        for name, t in tensors.items():
            got = f.get(name)
            assert got.dtype == np.dtype(TORCH_DTYPES[t.dtype]), name
            assert got.shape == tuple(t.shape), name
            assert _raw(got) == _torch_raw(t), name


def test_files_we_write_load_in_safetensors_torch(tmp_path):
    path = tmp_path / "ours.safetensors"
    rng = np.random.default_rng(1)
    tensors = {f"t{i}.{len(shape)}": _random_array(rng, np_dtype, shape)
               for i, np_dtype in enumerate(TORCH_DTYPES.values()) for shape in [(3, 5), (), (0, 4)]}
    write_safetensors(path, tensors, metadata={"format": "pt"})
    loaded = safetensors_torch.load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for name, array in tensors.items():
        t = loaded[name]
        assert TORCH_DTYPES[t.dtype] == array.dtype.type, name
        assert tuple(t.shape) == array.shape, name
        assert _torch_raw(t) == _raw(array), name


def test_bytes_identical_to_reference_writer(tmp_path):
    rng = np.random.default_rng(2)
    numpy_tensors = {f"n{i}": _random_array(rng, d, (2, 3)) for i, d in enumerate(
        [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_,
         np.uint16, np.uint32, np.uint64])}
    write_safetensors(tmp_path / "a.safetensors", numpy_tensors, metadata={"format": "np"})
    assert (tmp_path / "a.safetensors").read_bytes() == safetensors_numpy.save(numpy_tensors, {"format": "np"})

    torch_tensors = _torch_tensors(3)
    ours = {name: np.frombuffer(_torch_raw(t), TORCH_DTYPES[t.dtype]).reshape(tuple(t.shape))
            for name, t in torch_tensors.items()}
    write_safetensors(tmp_path / "b.safetensors", ours)
    assert (tmp_path / "b.safetensors").read_bytes() == safetensors_torch.save(torch_tensors)


# --- checkpoint directories ---------------------------------------------------------------------------------------

def _model_tensors():
    rng = np.random.default_rng(4)
    return {
        "embed": _random_array(rng, ml_dtypes.bfloat16, (16, 8)),  # 256 B
        "layers.0.w": _random_array(rng, np.float32, (8, 8)),  # 256 B
        "layers.1.w": _random_array(rng, np.float32, (8, 8)),  # 256 B
        "norm": _random_array(rng, np.float32, (8,)),  # 32 B
        "big": _random_array(rng, np.float32, (300,)),  # 1200 B, bigger than a shard
    }


def test_single_file_checkpoint(tmp_path):
    tensors = _model_tensors()
    assert write_checkpoint(tmp_path, tensors) == [SINGLE_FILE_NAME]
    with CheckpointReader(tmp_path) as reader:
        assert reader.names() == sorted(tensors)
        assert reader.metadata == {"format": "pt"}
        for name, array in tensors.items():
            assert reader.file_of(name) == SINGLE_FILE_NAME
            assert reader.shape(name) == array.shape and reader.dtype(name) == array.dtype
            assert _raw(reader.get(name)) == _raw(array)
        with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path} has no tensor 'x'"):
            reader.get("x")


def test_sharded_checkpoint_round_trip_and_reference_load(tmp_path):
    tensors = _model_tensors()
    written = write_checkpoint(tmp_path, tensors, max_shard_bytes=600)
    # Greedy in name order: [big] [embed, layers.0.w] [layers.1.w, norm].
    assert written == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX_FILE_NAME]
    index = json.loads((tmp_path / INDEX_FILE_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    assert index["weight_map"]["big"] == "model-00001-of-00003.safetensors"
    assert index["weight_map"]["norm"] == "model-00003-of-00003.safetensors"
    with CheckpointReader(tmp_path) as reader:
        assert reader.names() == sorted(tensors)
        for name, array in tensors.items():
            assert reader.file_of(name) == index["weight_map"][name]
            assert _raw(reader.get(name)) == _raw(array)
    for file_name in written[:-1]:
        assert safetensors_torch.load_file(tmp_path / file_name)  # every shard is valid for the reference too

    # Rewriting as a single file removes the shards and the index, so no stale layout can shadow it.
    assert write_checkpoint(tmp_path, {"x": np.zeros(2, np.float32)}) == [SINGLE_FILE_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE_NAME]


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*{SINGLE_FILE_NAME}.*{INDEX_FILE_NAME}"):
        CheckpointReader(tmp_path)

    write_checkpoint(tmp_path, _model_tensors(), max_shard_bytes=600)
    index_path = tmp_path / INDEX_FILE_NAME
    index = json.loads(index_path.read_text())

    index["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'ghost'.*model-00001-of-00003\.safetensors"):
        CheckpointReader(tmp_path)

    del index["weight_map"]["ghost"]
    index["weight_map"]["norm"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00009-of-00009\.safetensors.*does not exist"):
        CheckpointReader(tmp_path)

    index["weight_map"]["norm"] = "../model-00003-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        CheckpointReader(tmp_path)

    index_path.write_text("{not json")
    with pytest.raises(CheckpointError, match=INDEX_FILE_NAME):
        CheckpointReader(tmp_path)


# --- corrupt files ------------------------------------------------------------------------------------------------

F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def _valid_bytes() -> bytes:
    header = json.dumps({"w": F32_2x2}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(16)

CORRUPTIONS = {
    "empty file": (lambda p: p.write_bytes(b""), "shorter than the 8-byte header length"),
    "garbage bytes": (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100)), "header length"),
    "truncated data": (lambda p: p.write_bytes(_valid_bytes()[:-4]), r"run past the data buffer of 12 bytes"),
    "truncated header": (lambda p: p.write_bytes(_valid_bytes()[:20]), r"exceeds file size 20"),
    "header length too big": (lambda p: _corrupt(p, {}, header_len=123456789),
                              "header length 123456789 exceeds file size 10"),
    "header length over limit": (lambda p: _sparse_file(p, header_len=100_000_001), "exceeds the limit"),
    "non-JSON header": (lambda p: _corrupt(p, b"{this is not json}"), "not valid UTF-8 JSON"),
    "non-UTF-8 header": (lambda p: _corrupt(p, b"\xff\xfe{}"), "not valid UTF-8 JSON"),
    "header not an object": (lambda p: _corrupt(p, b"[1, 2]"), "expected an object"),
    "offsets out of range": (lambda p: _corrupt(p, {"w": {**F32_2x2, "data_offsets": [16, 32]}}, bytes(16)),
                             r"'w'.*\[16, 32\] run past the data buffer of 16 bytes"),
    "offsets disagree with shape": (lambda p: _corrupt(p, {"w": {**F32_2x2, "data_offsets": [0, 12]}}, bytes(16)),
                                    r"'w'.*span 12 bytes, expected 16 for F32 \[2, 2\]"),
    "overlapping offsets": (lambda p: _corrupt(p, {"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [8, 24]}},
                                               bytes(24)), r"'b'.*overlap tensor 'a'"),
    "unknown dtype": (lambda p: _corrupt(p, {"w": {**F32_2x2, "dtype": "F128"}}, bytes(16)),
                      r"'w': unknown dtype 'F128'"),
    "negative shape": (lambda p: _corrupt(p, {"w": {**F32_2x2, "shape": [-2, -2]}}, bytes(16)),
                       "non-negative integers"),
    "float shape": (lambda p: _corrupt(p, {"w": {**F32_2x2, "shape": [2.0, 2]}}, bytes(16)),
                    "non-negative integers"),
    "bad metadata": (lambda p: _corrupt(p, {"__metadata__": {"n": 1}}), "__metadata__"),
    "entry not an object": (lambda p: _corrupt(p, {"w": 3}), "'w': entry is not an object"),
    "header nested 100k deep": (lambda p: _corrupt(p, b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                                "nested too deeply"),
    "metadata nested 100k deep": (lambda p: _corrupt(p, b'{"__metadata__": ' + b'{"a": ' * 100_000
                                                     + b"1" + b"}" * 100_000 + b"}"), "nested too deeply"),
    # json.loads keeps the last of two entries silently; which one the writer meant is unknowable.
    "a tensor named twice": (lambda p: _corrupt(p, b'{"w": ' + json.dumps(F32_2x2).encode() + b', "w": '
                                                + json.dumps({**F32_2x2, "shape": [4]}).encode() + b"}", bytes(16)),
                             "names 'w' twice"),
    "a field named twice": (lambda p: _corrupt(p, b'{"w": {"dtype": "F32", "dtype": "I32", "shape": [2, 2], '
                                                  b'"data_offsets": [0, 16]}}', bytes(16)), "names 'dtype' twice"),
    "metadata named twice": (lambda p: _corrupt(p, b'{"__metadata__": {"format": "pt"}, "__metadata__": {}}'),
                             "names '__metadata__' twice"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_file_raises_checkpoint_error_naming_the_file(tmp_path, case):
    make, expected = CORRUPTIONS[case]
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert message.startswith(f"not a valid safetensors file: {path}: "), message
    assert re.search(expected, message), message


def test_an_index_mapping_a_tensor_twice_is_refused(tmp_path):
    write_checkpoint(tmp_path, _model_tensors(), max_shard_bytes=600)
    index_path = tmp_path / INDEX_FILE_NAME
    text = index_path.read_text()
    name, file_name = next(iter(json.loads(text)["weight_map"].items()))
    index_path.write_text(text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{file_name}", ', 1))
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE_NAME}.*{re.escape(name)}"):
        CheckpointReader(tmp_path)


def test_corrupt_shard_error_names_the_shard(tmp_path):
    write_checkpoint(tmp_path, _model_tensors(), max_shard_bytes=600)
    shard = tmp_path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=str(shard)):
        CheckpointReader(tmp_path)


def test_unknown_tensor_names_file_and_tensor(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.zeros(1, np.float32)})
    with SafetensorsFile(path) as f, pytest.raises(CheckpointError, match=f"{path}: no tensor 'b'"):
        f.get("b")


def test_deeply_nested_index_is_a_checkpoint_error(tmp_path):
    write_checkpoint(tmp_path, _model_tensors(), max_shard_bytes=600)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match=f"{index}: not valid JSON .*nested too deeply"):
        CheckpointReader(tmp_path)
