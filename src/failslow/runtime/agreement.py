"""All ranks agreeing on one small value: one all-reduce on the default group, the same on every
rank (the plan application's confirmation, the snapshot service's resume step, the phases of a
topology swap). Without a process group, or in a world of one, the rank agrees with itself."""

from __future__ import annotations


def distributed(world_size: int) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and world_size > 1


def agree(value: int, world_size: int) -> tuple[int, int]:
    """(min, max) of ``value`` over all ranks (one all-reduce of two ints)."""
    if not distributed(world_size):
        return value, value
    import torch
    import torch.distributed as dist

    pair = torch.tensor([-value, value], dtype=torch.int64)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX)
    return -int(pair[0]), int(pair[1])


def all_ranks_ok(ok: bool, world_size: int) -> bool:
    """True if every rank says ``ok``."""
    return agree(int(ok), world_size)[0] == 1
