"""The snapshot format: one self-verifying byte buffer per rank and step (byterobust 6.3).

A snapshot of an arbitrary training state (nested dicts/lists/tuples of tensors, numpy arrays and
picklable Python objects) is laid out in one flat buffer, so it can live in host memory, in a
``/dev/shm`` file that outlives the process, or travel to a backup holder as raw bytes::

    header (64 bytes) | manifest (pickle) | padding to 64 | payload (tensor bytes, 64-aligned)

Header, little endian: magic ``FSCKPT01`` (8 s), version (u32), reserved (u32), step (i64),
manifest bytes (u64), payload bytes (u64), checksum (u64: CRC-32 of manifest + payload),
commit word (u64, at offset 48, written last: ``step + 1`` once sealed; 0 while being written),
reserved (u64). The manifest is the state with every tensor replaced by a :class:`TensorRef`
(offset into the payload, bytes, dtype, shape). A reader trusts a buffer only if the magic, the
commit word and the checksum all agree (:func:`read` / :func:`verify`); anything else raises
:class:`CorruptSnapshot` naming what failed, and callers fall back to the previous snapshot.

Writing is split so the expensive part can run off the training thread: :func:`plan` (sizes;
cacheable while the state's structure is unchanged), :func:`write_payload` (the tensor copies -
what the optimizer step must wait for), :func:`seal` (checksum, then the commit word).
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from failslow.core.checkpoint import crc32
from failslow.errors import FailslowError

MAGIC = b"FSCKPT01"
VERSION = 1
HEADER = struct.Struct("<8sIIqQQQQQ")
HEADER_BYTES = 64
COMMIT_OFFSET = 48
ALIGN = 64


class CorruptSnapshot(FailslowError):
    """A snapshot buffer that must not be restored (torn, uncommitted or damaged)."""


@dataclass(frozen=True, slots=True)
class TensorRef:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str = "torch"
    """``torch`` or ``numpy``: what :func:`read` gives back."""

    def __reduce__(self) -> tuple[type[TensorRef], tuple[int, int, str, tuple[int, ...], str]]:
        # plain constructor call: pickles ~2x faster and smaller than the dataclass default
        return TensorRef, (self.offset, self.nbytes, self.dtype, self.shape, self.kind)


@dataclass
class Layout:
    """Where every tensor of one state goes; reusable while the state's structure is unchanged."""

    manifest: bytes
    tensors: list[tuple[Any, int]]
    """(tensor or array, payload offset) in payload order."""
    payload_bytes: int

    @property
    def payload_start(self) -> int:
        return _align(HEADER_BYTES + len(self.manifest))

    @property
    def total_bytes(self) -> int:
        return self.payload_start + self.payload_bytes


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_tensor(obj: Any) -> bool:
    """A dense torch tensor with real storage (sparse, quantized and meta tensors are pickled)."""
    if not (type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")):
        return False
    return str(obj.layout) == "torch.strided" and not obj.is_quantized and not obj.is_meta


def _is_raw_array(obj: Any) -> bool:
    """A numpy array whose bytes are its value (object and structured arrays are pickled)."""
    return isinstance(obj, np.ndarray) and not obj.dtype.hasobject and obj.dtype.fields is None


def _rebuild_dict(original: dict[Any, Any], items: Any) -> dict[Any, Any]:
    """``original``'s type with ``items``; keeps a ``defaultdict``'s factory and instance attributes
    (``Module.state_dict()`` is an ``OrderedDict`` carrying ``_metadata``)."""
    if isinstance(original, defaultdict):
        out: dict[Any, Any] = type(original)(original.default_factory, items)
    else:
        out = type(original)(items)
    attributes = getattr(original, "__dict__", None)
    if attributes:
        out.__dict__.update(attributes)
    return out


def plan(state: Any) -> Layout:
    """Lay out ``state``: a manifest with :class:`TensorRef` placeholders and the payload size."""
    tensors: list[tuple[Any, int]] = []
    offset = 0

    def walk(obj: Any) -> Any:
        nonlocal offset
        if _is_tensor(obj):
            t = obj.detach()
            ref = TensorRef(offset, t.numel() * t.element_size(), str(t.dtype), tuple(t.shape))
        elif _is_raw_array(obj):
            t = obj
            ref = TensorRef(offset, t.nbytes, t.dtype.str, tuple(t.shape), kind="numpy")
        elif isinstance(obj, dict):
            return _rebuild_dict(obj, ((k, walk(v)) for k, v in obj.items()))
        elif isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
            return type(obj)(walk(v) for v in obj)
        else:
            return obj
        tensors.append((t, offset))
        offset = _align(offset + ref.nbytes)
        return ref

    tree = walk(state)
    buffer = io.BytesIO()
    pickle.dump(tree, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return Layout(buffer.getvalue(), tensors, offset)


def write_payload(buf: memoryview, layout: Layout, step: int) -> None:
    """Header (uncommitted), manifest and every tensor's bytes into ``buf``."""
    if len(buf) < layout.total_bytes:
        raise ValueError(f"snapshot buffer of {len(buf)} bytes < {layout.total_bytes} needed")
    buf[COMMIT_OFFSET : COMMIT_OFFSET + 8] = bytes(8)  # uncommitted while being written
    start = layout.payload_start
    header = HEADER.pack(
        MAGIC, VERSION, 0, step, len(layout.manifest), layout.payload_bytes, 0, 0, 0
    )
    buf[: len(header)] = header
    buf[HEADER_BYTES : HEADER_BYTES + len(layout.manifest)] = layout.manifest
    target = np.frombuffer(buf, dtype=np.uint8)
    for tensor, offset in layout.tensors:
        dst = target[start + offset : start + offset + _nbytes(tensor)]
        _copy_into(dst, tensor)


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, np.ndarray):
        return int(tensor.nbytes)
    return int(tensor.numel() * tensor.element_size())


def _copy_into(dst: np.ndarray, tensor: Any) -> None:
    if isinstance(tensor, np.ndarray):
        dst[:] = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
        return
    import torch

    src = tensor.detach()
    if src.device.type != "cpu":
        src = src.to("cpu")
    out = torch.from_numpy(dst).view(src.dtype).view(src.shape) if src.numel() else None
    if out is not None:
        out.copy_(src)


def checksum(buf: memoryview) -> int:
    """CRC-32 of manifest + payload (the bytes after the header)."""
    _, _, _, _, manifest, payload, _, _, _ = HEADER.unpack_from(buf, 0)
    start = _align(HEADER_BYTES + manifest)
    crc = zlib.crc32(buf[HEADER_BYTES : HEADER_BYTES + manifest])
    return crc32.crc32(buf[start : start + payload], crc)


def seal(buf: memoryview) -> int:
    """Write the checksum, then the commit word; returns the step sealed."""
    magic, _, _, step, *_ = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptSnapshot("seal: no snapshot header in the buffer")
    struct.pack_into("<Q", buf, 40, checksum(buf))
    struct.pack_into("<Q", buf, COMMIT_OFFSET, step + 1)
    return int(step)


def header_of(buf: memoryview) -> dict[str, int]:
    magic, version, _, step, manifest, payload, crc, commit, _ = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptSnapshot("not a failslow snapshot (bad magic)")
    if version != VERSION:
        raise CorruptSnapshot(f"snapshot format version {version}, expected {VERSION}")
    return {
        "step": int(step),
        "manifest_bytes": int(manifest),
        "payload_bytes": int(payload),
        "checksum": int(crc),
        "commit": int(commit),
        "total_bytes": _align(HEADER_BYTES + manifest) + int(payload),
    }


def verify(buf: memoryview) -> int:
    """The step of a committed, intact snapshot; raises :class:`CorruptSnapshot` otherwise."""
    if len(buf) < HEADER_BYTES:
        raise CorruptSnapshot(f"snapshot of {len(buf)} bytes is shorter than its header")
    h = header_of(buf)
    if h["commit"] != h["step"] + 1:
        raise CorruptSnapshot(f"snapshot of step {h['step']} was never committed (torn write)")
    if len(buf) < h["total_bytes"]:
        raise CorruptSnapshot(f"snapshot truncated: {len(buf)} of {h['total_bytes']} bytes")
    if checksum(buf) != h["checksum"]:
        raise CorruptSnapshot(f"snapshot of step {h['step']}: checksum mismatch (corrupted)")
    return h["step"]


def read(buf: memoryview, *, check: bool = True) -> tuple[int, Any]:
    """(step, state) with every tensor copied out of ``buf`` (bitwise)."""
    step = verify(buf) if check else header_of(buf)["step"]
    h = header_of(buf)
    manifest = bytes(buf[HEADER_BYTES : HEADER_BYTES + h["manifest_bytes"]])
    start = _align(HEADER_BYTES + h["manifest_bytes"])
    raw = np.frombuffer(buf, dtype=np.uint8)

    def build(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            data = raw[start + obj.offset : start + obj.offset + obj.nbytes].copy()
            if obj.kind == "numpy":
                return data.view(np.dtype(obj.dtype)).reshape(obj.shape)
            import torch

            dtype = getattr(torch, obj.dtype.removeprefix("torch."))
            if obj.nbytes == 0:
                return torch.empty(obj.shape, dtype=dtype)
            return torch.from_numpy(data).view(dtype).view(obj.shape)
        if isinstance(obj, dict):
            return _rebuild_dict(obj, ((k, build(v)) for k, v in obj.items()))
        if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
            return type(obj)(build(v) for v in obj)
        return obj

    return step, build(pickle.loads(manifest))
