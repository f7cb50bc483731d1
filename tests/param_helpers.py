"""Helpers shared by the ParameterService tests (test_param_service*.py): sample tensors, an exact
comparison, and a wire loopback that stands in for an RPC client."""

import collections

import ml_dtypes
import numpy as np

from jaxflow.data.param_service import DTYPES, RPC_METHODS
from jaxflow.transport import wire

SHM = ["private", "shm"]  # the two storage placements a ParameterService has
W = np.arange(12, dtype=np.float32).reshape(3, 4)


def random_bits(dtype: np.dtype, shape, rng: np.random.Generator) -> np.ndarray:
    """Arbitrary bit patterns (NaNs and infinities included for floats) of `dtype`."""
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def sample_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """One tensor of every supported dtype, plus a 0-d, an empty and an odd-sized one."""
    rng = np.random.default_rng(seed)
    out = {f"model.{name}.weight": random_bits(dtype, (3, 5, 7), rng) for name, dtype in DTYPES.items()}
    out["scalar"] = random_bits(np.dtype(np.float32), (), rng)
    out["empty"] = np.zeros((0, 4), ml_dtypes.bfloat16)
    out["odd"] = random_bits(np.dtype(np.uint8), (13,), rng)
    return out


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(arr).tobytes(), name


class WireLoopback:
    """Stands in for a jaxflow.transport.rpc.Client: arguments and results cross jaxflow.transport.wire
    encoding, and the calls of each method are counted."""

    def __init__(self, service, on_call=None):
        self.service = service
        self.counts = collections.Counter()
        self.on_call = on_call

    def call(self, method, *args, **kwargs):
        assert method in RPC_METHODS, method
        self.counts[method] += 1
        if self.on_call is not None:
            self.on_call(method, args)
        args, kwargs = wire.decode(wire.encode([list(args), kwargs]))
        return wire.decode(wire.encode(getattr(self.service, method)(*args, **kwargs)))
