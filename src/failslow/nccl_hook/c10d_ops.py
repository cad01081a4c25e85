"""What each torch.distributed dispatcher op means to the capture layer (greyhound 4.2).

The Monitor of greyhound 4.2 logs the *type* of every top-level communication call. In torch
every collective and point-to-point call of every backend reaches the c10d dispatcher as one
of the ``c10d::*`` ops listed here (``c10d::allreduce_``, ``c10d::_allgather_base_``,
``c10d::send``, ...), whoever issued it: ``torch.distributed`` Python functions, DDP's C++
reducer, FSDP2, DeepSpeed's stored function references or Megatron's p2p code. This module maps
each op's schema to an :class:`~failslow.core.events.OpCode`, where its process group, root or
peer, and ``async_op`` arguments sit, and how to count this rank's input payload bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from failslow.core.events import DType, OpCode


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _sum_list(ts: Sequence[Any]) -> int:
    return sum(_nbytes(t) for t in ts)


def _sum_nested(tss: Sequence[Sequence[Any]]) -> int:
    return sum(_sum_list(ts) for ts in tss)


def _first(ts: Any) -> Any:
    """First tensor of a tensor, a list or a list of lists (None when empty)."""
    while isinstance(ts, (list, tuple)):
        if not ts:
            return None
        ts = ts[0]
    return ts


@dataclass(frozen=True, slots=True)
class OpSpec:
    """How to read one ``c10d::`` op's arguments."""

    name: str  # op name in the c10d namespace
    op: OpCode
    input_arg: int  # index of the argument holding this rank's input payload
    nbytes: Callable[[Any], int]  # bytes of that argument
    pg_arg: int  # index of the ProcessGroup argument
    peer_arg: int | None = None  # index of the root / peer argument (a group rank)
    async_arg: int | None = None  # index of the async_op argument
    returns_tuple: bool = False  # (tensors, Work) rather than a bare Work
    coalesced: bool = False


OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec("allreduce_", OpCode.ALLREDUCE, 0, _sum_list, 1, async_arg=4, returns_tuple=True),
    OpSpec("allreduce_coalesced_", OpCode.ALLREDUCE_COALESCED, 0, _sum_list, 1, async_arg=3,
           coalesced=True),
    OpSpec("allgather_", OpCode.ALLGATHER, 1, _sum_list, 2, async_arg=3, returns_tuple=True),
    OpSpec("_allgather_base_", OpCode.ALLGATHER, 1, _nbytes, 2, async_arg=3, returns_tuple=True),
    OpSpec("allgather_coalesced_", OpCode.ALLGATHER_COALESCED, 1, _sum_list, 2, async_arg=3,
           coalesced=True),
    OpSpec("allgather_into_tensor_coalesced_", OpCode.ALLGATHER_COALESCED, 1, _sum_list, 2,
           async_arg=3, coalesced=True),
    OpSpec("reduce_scatter_", OpCode.REDUCE_SCATTER, 1, _sum_nested, 2, async_arg=4,
           returns_tuple=True),
    OpSpec("_reduce_scatter_base_", OpCode.REDUCE_SCATTER, 1, _nbytes, 2, async_arg=4,
           returns_tuple=True),
    OpSpec("reduce_scatter_tensor_coalesced_", OpCode.REDUCE_SCATTER_COALESCED, 1, _sum_list, 2,
           async_arg=4, coalesced=True),
    OpSpec("broadcast_", OpCode.BROADCAST, 0, _sum_list, 1, peer_arg=2, async_arg=4,
           returns_tuple=True),
    OpSpec("reduce_", OpCode.REDUCE, 0, _sum_list, 1, peer_arg=3, async_arg=5),
    OpSpec("alltoall_", OpCode.ALLTOALL, 1, _sum_list, 2, async_arg=3, returns_tuple=True),
    OpSpec("alltoall_base_", OpCode.ALLTOALL, 1, _nbytes, 2, async_arg=5),
    OpSpec("gather_", OpCode.GATHER, 1, _sum_list, 2, peer_arg=3, async_arg=4),
    OpSpec("scatter_", OpCode.SCATTER, 1, _sum_nested, 2, peer_arg=3, async_arg=4,
           returns_tuple=True),
    OpSpec("send", OpCode.SEND, 0, _sum_list, 1, peer_arg=2),
    OpSpec("recv_", OpCode.RECV, 0, _sum_list, 1, peer_arg=2),
    OpSpec("recv_any_source_", OpCode.RECV, 0, _sum_list, 1),
    OpSpec("barrier", OpCode.BARRIER, 0, lambda _t: 0, 1, async_arg=3),
)
"""Every c10d op the Python hook records (torch 2.13 schemas)."""


_DTYPES: dict[str, DType] = {
    "torch.float32": DType.FLOAT32,
    "torch.float16": DType.FLOAT16,
    "torch.bfloat16": DType.BFLOAT16,
    "torch.float64": DType.FLOAT64,
    "torch.int8": DType.INT8,
    "torch.uint8": DType.UINT8,
    "torch.int32": DType.INT32,
    "torch.int64": DType.INT64,
    "torch.float8_e4m3fn": DType.FP8_E4M3,
    "torch.float8_e5m2": DType.FP8_E5M2,
    "torch.bool": DType.BOOL,
}


def dtype_table() -> list[tuple[Any, int]]:
    """``(torch dtype, DType code)`` for every mapped dtype this torch has (the native hook's
    table: the same mapping as :func:`payload_dtype`)."""
    import torch

    out = []
    for name, code in _DTYPES.items():
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            out.append((dtype, int(code)))
    return out


def payload_dtype(payload: Any) -> DType:
    """DType of the first tensor of a payload argument (UNKNOWN if empty or unmapped)."""
    t = _first(payload)
    if t is None:
        return DType.UNKNOWN
    return _DTYPES.get(str(t.dtype), DType.UNKNOWN)
