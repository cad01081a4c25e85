"""The snapshot format (byterobust 6.3): bitwise round trips and every way a buffer can be bad."""

from __future__ import annotations

import collections
import random
import struct
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from failslow.core.checkpoint import blob

torch = pytest.importorskip("torch")


def snapshot(state: Any, step: int = 7) -> memoryview:
    layout = blob.plan(state)
    buf = memoryview(bytearray(layout.total_bytes))
    blob.write_payload(buf, layout, step)
    blob.seal(buf)
    return buf


def raw_bytes(t: Any) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise(a: Any, b: Any) -> None:
    """Equal structure, types, dtypes, shapes and bytes (NaNs and -0.0 included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert raw_bytes(a) == raw_bytes(b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert np.ascontiguousarray(a).tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_bitwise(a[k], b[k])
    elif isinstance(a, list | tuple) and not hasattr(a, "_fields"):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise(x, y)
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b)
    else:
        assert a == b


class Point(NamedTuple):
    x: int
    y: float


def mixed_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 5, generator=gen)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "fp32": torch.randn(3, 4, generator=gen),
        "fp16": torch.randn(7, generator=gen).half(),
        "bf16": torch.randn(2, 3, generator=gen).bfloat16(),
        "int64": torch.arange(-5, 6, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(12.0).view(3, 4).t(),
        "specials": torch.tensor([float("nan"), -0.0, float("inf")]),
        "numpy": {"f8": np.linspace(0, 1, 5), "u1": np.arange(9, dtype=np.uint8).reshape(3, 3)},
        "numpy_objects": np.array([{"a": 1}, None], dtype=object),
        "nested": [({"deep": torch.ones(2)},), [], ()],
        "python": {"step": 12, "lr": 3e-4, "name": "run", "none": None, "point": Point(1, 2.0)},
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.default_rng(3).bit_generator.state,
        "python_rng": random.Random(4).getstate(),
        "counts": collections.defaultdict(int, {"a": 2}),
        "sparse": torch.eye(3).to_sparse(),
    }


def test_mixed_state_round_trips_bitwise() -> None:
    state = mixed_state()
    step, out = blob.read(snapshot(state, step=41))
    assert step == 41
    assert_bitwise(
        {k: v for k, v in state.items() if k not in ("numpy_objects", "sparse")},
        {k: v for k, v in out.items() if k not in ("numpy_objects", "sparse")},
    )
    assert out["numpy_objects"].tolist() == [{"a": 1}, None]
    assert torch.equal(out["sparse"].to_dense(), torch.eye(3))
    assert out["counts"].default_factory is int
    assert out["model"]._metadata == state["model"]._metadata  # load_state_dict reads it


def test_restored_state_loads_into_a_fresh_model_and_optimizer() -> None:
    state = mixed_state()
    _, out = blob.read(snapshot(state))
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(out["model"])
    opt.load_state_dict(out["optim"])
    assert_bitwise(model.state_dict(), state["model"])
    assert_bitwise(opt.state_dict()["state"], state["optim"]["state"])


def test_snapshot_is_a_copy_not_a_view() -> None:
    state = {"w": torch.zeros(4)}
    buf = snapshot(state)
    state["w"].add_(1)
    _, out = blob.read(buf)
    assert torch.equal(out["w"], torch.zeros(4))
    out["w"].add_(2)  # and the restored tensors do not alias the buffer
    assert torch.equal(blob.read(buf)[1]["w"], torch.zeros(4))


def test_payload_is_aligned() -> None:
    layout = blob.plan({"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5), "c": np.ones(1)})
    assert layout.payload_start % blob.ALIGN == 0
    assert all(offset % blob.ALIGN == 0 for _, offset in layout.tensors)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.complex64]  # fmt: skip
NP_DTYPES = ["<f4", "<f8", "<i2", ">i4", "|u1", "<c16"]


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * 16, max_size=n * 16))
    if draw(st.booleans()):
        dtype = draw(st.sampled_from(NP_DTYPES))
        itemsize = np.dtype(dtype).itemsize
        return np.frombuffer(raw[: n * itemsize], dtype=dtype).reshape(shape).copy()
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty(0, dtype=dtype).element_size()
    data = torch.frombuffer(bytearray(raw[: n * size]), dtype=torch.uint8) if n else None
    t = torch.empty(shape, dtype=dtype) if data is None else data.view(dtype).reshape(shape)
    if dtype == torch.bool:
        t = t.view(torch.uint8).remainder(2).bool()  # only 0/1 bytes are valid bools
    return t


leaves = st.one_of(
    tensors(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.none(),
    st.binary(max_size=5),
)
states = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
    ),
    max_leaves=12,
)


@given(state=states, step=st.integers(0, 2**40))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_state_round_trips_bitwise(state: Any, step: int) -> None:
    got_step, out = blob.read(snapshot(state, step))
    assert got_step == step
    assert_bitwise(state, out)


# ---------------------------------------------------------------- buffers that must not be read


def test_uncommitted_buffer_is_torn() -> None:
    layout = blob.plan({"w": torch.ones(8)})
    buf = memoryview(bytearray(layout.total_bytes))
    blob.write_payload(buf, layout, 3)  # copied, never sealed: the writer died here
    with pytest.raises(blob.CorruptSnapshot, match="step 3 was never committed"):
        blob.read(buf)


def test_rewrite_in_progress_is_torn() -> None:
    buf = snapshot({"w": torch.ones(8)}, step=3)
    layout = blob.plan({"w": torch.full((8,), 2.0)})
    blob.write_payload(buf, layout, 4)  # the slot is being reused; the old commit word is gone
    with pytest.raises(blob.CorruptSnapshot, match="never committed"):
        blob.verify(buf)


def test_truncated_buffer() -> None:
    buf = snapshot({"w": torch.ones(100)})
    with pytest.raises(blob.CorruptSnapshot, match="truncated"):
        blob.read(buf[: len(buf) - 1])
    with pytest.raises(blob.CorruptSnapshot, match="shorter than its header"):
        blob.verify(buf[:10])


def test_not_a_snapshot() -> None:
    with pytest.raises(blob.CorruptSnapshot, match="bad magic"):
        blob.verify(memoryview(bytearray(200)))
    buf = snapshot({"w": torch.ones(2)})
    struct.pack_into("<I", buf, 8, blob.VERSION + 1)
    with pytest.raises(blob.CorruptSnapshot, match="version"):
        blob.verify(buf)


@given(data=st.data())
@settings(max_examples=100, deadline=None)
def test_any_flipped_bit_in_manifest_or_payload_is_caught(data: st.DataObject) -> None:
    state = {"a": torch.arange(10.0), "b": np.arange(7, dtype=np.int16), "meta": {"step": 5}}
    buf = snapshot(state)
    h = blob.header_of(buf)
    start = blob._align(blob.HEADER_BYTES + h["manifest_bytes"])
    covered = [
        *range(blob.HEADER_BYTES, blob.HEADER_BYTES + h["manifest_bytes"]),
        *range(start, start + h["payload_bytes"]),
    ]
    where = data.draw(st.sampled_from(covered))
    buf[where] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(blob.CorruptSnapshot, match="checksum mismatch"):
        blob.read(buf)


def test_seal_refuses_a_buffer_without_header() -> None:
    with pytest.raises(blob.CorruptSnapshot, match="no snapshot header"):
        blob.seal(memoryview(bytearray(128)))


def test_write_payload_refuses_a_small_buffer() -> None:
    layout = blob.plan({"w": torch.ones(100)})
    with pytest.raises(ValueError, match="bytes < "):
        blob.write_payload(memoryview(bytearray(layout.total_bytes - 1)), layout, 0)
