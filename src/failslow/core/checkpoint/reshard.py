"""Every old rank's state, gathered in a smaller world: a job goes on without lost ranks.

odyssey (III-IV) keeps training after a fail-stop when no standby is left: the survivors either
take the lost replicas' micro-batches (rerouting) or start a new parallel layout
(reconfiguring). Either way the new world has fewer ranks than the snapshots were taken in, so
:func:`~.restore.restore` (each rank its own state) cannot serve it: a sharded optimizer's
partitions must be cut anew, and the lost ranks' partitions exist only as backups on their
holders (byterobust 6.3). :func:`restore_resharded` runs in the new world, on every rank:

1. *inventory*: each new rank knows which old rank it was (``old_rank``) and the node memory it
   kept (``directory``: the old rank's own snapshots and the backups it held for its wards);
2. *agreement*: for every old rank ``j`` the newest step some new rank can provide
   (``all_reduce(MAX)``), the newest step every old rank is available at (the ``MIN`` of
   those), then a 64-step availability matrix below it (``MAX``): the newest step at which
   every old rank's state can be obtained wins;
3. *providers*: for each old rank, the new rank that was it (its own snapshot) or else the
   lowest new rank holding its backup (one ``all_reduce(MIN)`` of a code per old rank);
4. each provider verifies its copy (:func:`blob.verify`); one ``all_reduce(MIN)`` says whether
   all did, else the broken copies are struck out and the agreement is repeated;
5. each old rank's state is broadcast from its provider to every new rank, and verified there.

Costs per new rank: O(old world) integers per agreement, and every old rank's state received
once - a restore, not a step, pays it; what an adapter keeps of the states is its own business
(a ZeRO-1 rank keeps its new partition, see the DeepSpeed adapter).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failslow.core.checkpoint import blob
from failslow.core.checkpoint.backup import SLOTS, _as_tensor, _chunks, backup_path
from failslow.core.checkpoint.restore import (
    RestoreError,
    _inventory,
    local_snapshot_paths,
)

log = logging.getLogger(__name__)

_SPAN = 64


@dataclass
class Resharded:
    step: int
    buffers: list[memoryview]
    """Old rank ``j``'s snapshot of ``step``, for every old rank (verified)."""
    providers: list[int]
    """The new rank each old rank's state came from."""
    sources: list[str]
    """``snapshot`` (the provider was that old rank) or ``backup`` (its holder's copy)."""
    attempts: int = 1

    def states(self) -> list[Any]:
        """Every old rank's training state, in old rank order (tensors copied out)."""
        return [blob.read(view, check=False)[1] for view in self.buffers]


def restore_resharded(
    *,
    rank: int,
    world_size: int,
    old_rank: int | None,
    old_holders: Sequence[int],
    directory: Path | str,
    group: Any = None,
    chunk_bytes: int = 4 << 20,
    readable: Mapping[int, Path | str] | None = None,
    before_step: int | None = None,
) -> Resharded:
    """Every old rank's state of the newest step all of them can be obtained at (collective
    over the new world; see the module). ``old_holders`` is the backup placement of the old
    world (its length is the old world size); ``old_rank`` is the rank this process's node
    memory belonged to (None: a node that kept nothing). ``readable``: other old ranks whose
    own snapshots this process can read, and where (a replay, in which every old machine is
    alive); ``before_step``: only steps before it (the step a replay reproduces)."""
    import torch
    import torch.distributed as dist

    old_world = len(old_holders)
    directory = Path(directory)
    mine: dict[int, dict[int, memoryview]] = {}
    if old_rank is not None:
        mine[old_rank] = _inventory(local_snapshot_paths(directory, old_rank))
        wards = [w for w, h in enumerate(old_holders) if h == old_rank and w != old_rank]
        for w in wards:
            mine.setdefault(w, {})
            kept = _inventory([backup_path(directory, w, k) for k in range(SLOTS)])
            for step, view in kept.items():
                mine[w].setdefault(step, view)
    for j, where in (readable or {}).items():
        if j != old_rank:
            mine[j] = {**mine.get(j, {}), **_inventory(local_snapshot_paths(Path(where), j))}
    if before_step is not None:
        mine = {j: {s: v for s, v in steps.items() if s < before_step} for j, steps in mine.items()}
    own = ({old_rank} if old_rank is not None else set()) | set(readable or {})
    bad: set[tuple[int, int]] = set()  # (old rank, step) copies of this rank found broken

    for attempt in range(1, 2 * SLOTS + 3):
        avail = {j: {s for s in steps if (j, s) not in bad} for j, steps in mine.items()}
        newest = torch.full((old_world,), -1, dtype=torch.int64)
        for j, steps in avail.items():
            newest[j] = max(steps, default=-1)
        dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=group)
        lost = [j for j, s in enumerate(newest.tolist()) if s < 0]
        if lost:
            raise RestoreError(
                f"the state of old rank(s) {lost} is gone: no surviving rank has its snapshot "
                f"or its backup (their holders: {[old_holders[j] for j in lost]})"
            )
        base = int(newest.min().item())
        flags = torch.zeros((old_world, _SPAN), dtype=torch.int64)
        for j, steps in avail.items():
            for k in range(_SPAN):
                flags[j, k] = int(base - k in steps)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        common = [k for k in range(_SPAN) if bool(flags[:, k].all())]
        if not common:
            raise RestoreError(
                f"no step is available for every old rank (newest common bound {base})"
            )
        step = base - common[0]

        # providers: the old rank itself (code = new rank), else a holder (world + new rank)
        code = torch.full((old_world,), 2 * world_size, dtype=torch.int64)
        for j, steps in avail.items():
            if step in steps:
                code[j] = rank if j in own else world_size + rank
        dist.all_reduce(code, op=dist.ReduceOp.MIN, group=group)
        providers = [c % world_size for c in code.tolist()]
        ok = torch.ones(old_world, dtype=torch.int64)
        for j in range(old_world):
            if providers[j] == rank:
                try:
                    blob.verify(mine[j][step])
                except blob.CorruptSnapshot as e:
                    log.warning("rank %d: its copy of old rank %d, step %d: %s", rank, j, step, e)
                    bad.add((j, step))
                    ok[j] = 0
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not bool(ok.all()):
            continue  # the broken copies are struck out; the next agreement avoids them
        buffers = [
            _broadcast(mine.get(j, {}).get(step), providers[j], rank, group, chunk_bytes)
            for j in range(old_world)
        ]
        good = torch.ones(1, dtype=torch.int64)
        for j, view in enumerate(buffers):
            try:
                blob.verify(view)
            except blob.CorruptSnapshot as e:
                log.warning("rank %d: old rank %d's state arrived broken: %s", rank, j, e)
                good[0] = 0
        dist.all_reduce(good, op=dist.ReduceOp.MIN, group=group)
        if not int(good.item()):
            raise RestoreError(f"old states of step {step} arrived broken on some rank")
        sources = ["snapshot" if c < world_size else "backup" for c in code.tolist()]
        return Resharded(step, buffers, providers, sources, attempt)
    raise RestoreError(f"rank {rank}: gave up gathering the old ranks' states ({attempt} tries)")


def _broadcast(
    view: memoryview | None, src: int, rank: int, group: Any, chunk_bytes: int
) -> memoryview:
    """``view`` (at ``src``) on every rank, in chunks; its size first."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(view) if rank == src and view is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=_global(src, group), group=group)
    nbytes = int(size.item())
    if rank == src:
        assert view is not None
        target = view  # read-only: a broadcast's root only sends
    else:
        target = memoryview(mmap.mmap(-1, nbytes))
    tensor = _as_tensor(target)
    for a, b in _chunks(nbytes, chunk_bytes):
        dist.broadcast(tensor[a:b], src=_global(src, group), group=group)
    return target


def _global(rank: int, group: Any) -> int:
    """The default group's rank of ``group``'s rank ``rank``."""
    if group is None:
        return rank
    import torch.distributed as dist

    return int(dist.get_global_rank(group, rank))
