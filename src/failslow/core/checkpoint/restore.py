"""Restore every rank to one common step after an eviction (byterobust 6.3 and 5).

After ByteRobust over-evicts machines - one host, or every machine of a PP group (section 5) -
warm standbys take the evicted ranks (same rank ids, new processes, empty node-local memory) and
training resumes from in-memory checkpoints: "Failure recovery is implemented by selecting the
latest available checkpoints". :func:`restore` runs in the new world, on every rank:

1. *inventory*: the rank's own snapshots in ``directory`` (the Snapshotter's
   ``rank{r}-slot{k}.fsck`` files that survived on the node) and the backups it holds for its
   wards (``backup-of-rank{w}-slot{k}.fsck``, :mod:`.backup`), by commit word only (cheap);
2. each holder tells each ward which backup steps it holds (one small p2p message);
3. *agreement*: ``all_reduce(MIN)`` of the newest step each rank can obtain, then ``MIN`` over a
   64-entry availability vector below it: the newest step every rank can obtain wins;
4. ranks with that step locally verify it; the others ask their holder, which sends it in chunks
   over p2p; every rank verifies the checksum (:func:`blob.verify`);
5. ``all_reduce(MIN)`` of success: if any copy was corrupt, its (source, step) is struck out and
   the agreement is repeated - everyone falls back to the previous step together.

Messages per rank are O(1) (one holder, its wards, and three fixed-size all-reduces per attempt).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failslow.core.checkpoint import blob
from failslow.core.checkpoint.backup import SLOTS, _as_tensor, _chunks, backup_path, committed_step
from failslow.errors import FailslowError

log = logging.getLogger(__name__)

_MAX_STEPS = 4
_SPAN = 64


class RestoreError(FailslowError):
    """No step can be restored on every rank (a rank's state is gone with its holder)."""


@dataclass
class Restored:
    step: int
    buffer: memoryview
    source: str
    """``local`` (this node's snapshot) or ``backup`` (pulled from the holder)."""
    attempts: int = 1

    def state(self) -> Any:
        """The training state, every tensor copied out of the buffer (bitwise)."""
        return blob.read(self.buffer, check=False)[1]


def _map_readonly(path: Path) -> memoryview | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < blob.HEADER_BYTES:
            return None
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def _inventory(paths: Sequence[Path]) -> dict[int, memoryview]:
    found: dict[int, memoryview] = {}
    for path in paths:
        view = _map_readonly(path)
        step = None if view is None else committed_step(view)
        if view is not None and step is not None and step not in found:
            found[step] = view[: blob.header_of(view)["total_bytes"]]
    return found


def local_snapshot_paths(directory: Path, rank: int) -> list[Path]:
    """The Snapshotter's slot files of ``rank`` in ``directory`` (snapshot.py's naming)."""
    return sorted(Path(directory).glob(f"rank{rank}-slot*.fsck"))


def _committed_header(path: Path) -> dict[str, int] | None:
    """The header of a committed snapshot file (commit word only, no checksum: cheap), else
    None (missing, torn, not a snapshot)."""
    try:
        with open(path, "rb") as f:
            head = f.read(blob.HEADER_BYTES)
        header = blob.header_of(memoryview(head))
    except Exception:
        return None
    return header if header["commit"] == header["step"] + 1 else None


def has_committed(directory: Path, rank: int) -> bool:
    """Whether this node holds any committed snapshot of ``rank`` or backup of another rank
    (commit words only; cheap): a job with none anywhere starts afresh."""
    paths = local_snapshot_paths(directory, rank)
    paths += sorted(Path(directory).glob("backup-of-rank*-slot*.fsck"))
    return any(_committed_header(path) is not None for path in paths)


def has_snapshot(directory: Path, rank: int) -> bool:
    """Whether this node holds a committed snapshot of ``rank``'s own (commit words only)."""
    return any(_committed_header(p) is not None for p in local_snapshot_paths(directory, rank))


def inventory(directory: Path) -> list[dict[str, Any]]:
    """Every rank's newest committed snapshot and newest backup held in ``directory``:
    ``{"rank", "backup", "step", "bytes"}`` each (headers only: cheap enough for a metrics
    scrape; no time: a memory-mapped slot's mtime does not move with its writes)."""
    newest: dict[tuple[int, bool], dict[str, Any]] = {}
    for path in Path(directory).glob("*.fsck"):
        name = path.name
        backup = name.startswith("backup-of-rank")
        digits = name.removeprefix("backup-of-rank" if backup else "rank").split("-", 1)[0]
        header = _committed_header(path) if digits.isdigit() else None
        if header is None:
            continue
        key = (int(digits), backup)
        if key not in newest or header["step"] > newest[key]["step"]:
            newest[key] = {
                "rank": key[0],
                "backup": backup,
                "step": header["step"],
                "bytes": header["total_bytes"],
            }
    return sorted(newest.values(), key=lambda r: (r["backup"], r["rank"]))


def restore(
    *,
    rank: int,
    holders: Sequence[int],
    directory: Path | str,
    local: Sequence[memoryview] | None = None,
    group: Any = None,
    chunk_bytes: int = 4 << 20,
) -> Restored:
    """Every rank's state of the newest step all ranks can obtain (collective; see module).

    ``holders`` is the placement the backups were made with (:func:`.placement.backup_holders`
    of the topology before the eviction). ``local`` overrides the local snapshot buffers
    (default: this rank's Snapshotter files in ``directory``).
    """
    import torch
    import torch.distributed as dist

    directory = Path(directory)
    g = group
    holder = holders[rank]
    wards = [w for w, h in enumerate(holders) if h == rank and w != rank]
    if local is None:
        mine = _inventory(local_snapshot_paths(directory, rank))
    else:
        mine = {}
        for view in local:
            step = committed_step(view)
            if step is not None:
                mine.setdefault(step, view[: blob.header_of(view)["total_bytes"]])
    kept = {w: _inventory([backup_path(directory, w, k) for k in range(SLOTS)]) for w in wards}

    # 2. holders tell wards which backup steps they hold
    def steps_tensor(steps: Sequence[int]) -> Any:
        newest = sorted(steps, reverse=True)[:_MAX_STEPS]
        return torch.tensor(newest + [-1] * (_MAX_STEPS - len(newest)), dtype=torch.int64)

    at_holder = torch.full((_MAX_STEPS,), -1, dtype=torch.int64)
    works: list[Any] = [dist.isend(steps_tensor(list(kept[w])), w, group=g) for w in wards]
    if holder != rank:
        works.append(dist.irecv(at_holder, holder, group=g))
    for work in works:
        work.wait()
    remote = {int(s) for s in at_holder.tolist() if s >= 0}
    bad_local: set[int] = set()
    bad_remote: set[int] = set()

    for attempt in range(1, 2 * _MAX_STEPS + 2):
        # 3. agreement on the newest common step
        available = (set(mine) - bad_local) | (remote - bad_remote)
        newest = torch.tensor([max(available, default=-1)], dtype=torch.int64)
        dist.all_reduce(newest, op=dist.ReduceOp.MIN, group=g)
        base = int(newest.item())
        if base < 0:
            raise RestoreError(
                "no snapshot can be restored on every rank: some rank has neither a local "
                f"snapshot nor a backup at its holder (rank {rank} can obtain "
                f"{sorted(available) or 'nothing'}; holder {holder})"
            )
        flags = torch.tensor([int(base - i in available) for i in range(_SPAN)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=g)
        common = [base - i for i, f in enumerate(flags.tolist()) if f]
        if not common:
            raise RestoreError(
                f"no step is available on every rank (newest common bound {base}; rank {rank} "
                f"has {sorted(available)})"
            )
        step = common[0]

        # 4. local copies verify; the others pull from their holders
        result: Restored | None = None
        pull = step not in mine or step in bad_local
        if not pull:
            try:
                blob.verify(mine[step])
                result = Restored(step, mine[step], "local", attempt)
            except blob.CorruptSnapshot as e:
                log.warning("rank %d: local snapshot of step %d unusable: %s", rank, step, e)
                bad_local.add(step)
                pull = step in remote and step not in bad_remote
        pulled = _pull(rank, holder, wards, kept, step if pull else -1, g, chunk_bytes)
        if pull:
            try:
                if pulled is None:
                    raise blob.CorruptSnapshot(f"holder {holder} has no backup of step {step}")
                blob.verify(pulled)
                result = Restored(step, pulled, "backup", attempt)
            except blob.CorruptSnapshot as e:
                log.warning(
                    "rank %d: backup of step %d at rank %d unusable: %s", rank, step, holder, e
                )
                bad_remote.add(step)

        # 5. everyone succeeded, or everyone tries again without the broken copies
        ok = torch.tensor([int(result is not None)], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=g)
        if int(ok.item()) and result is not None:
            return result
        log.info("rank %d: step %d could not be restored everywhere, falling back", rank, step)
        bad_local.add(step)  # struck out on every rank alike: the next attempt agrees anew
        bad_remote.add(step)
    raise RestoreError(f"rank {rank}: gave up restoring after {2 * _MAX_STEPS + 1} attempts")


def _pull(
    rank: int,
    holder: int,
    wards: Sequence[int],
    kept: dict[int, dict[int, memoryview]],
    step: int,
    group: Any,
    chunk_bytes: int,
) -> memoryview | None:
    """Ask the holder for ``step`` (``-1``: nothing) and serve the wards' requests, over p2p."""
    import torch
    import torch.distributed as dist

    g = group
    want = {w: torch.zeros(1, dtype=torch.int64) for w in wards}
    works: list[Any] = [dist.irecv(t, w, group=g) for w, t in want.items()]
    if holder != rank:
        works.append(dist.isend(torch.tensor([step], dtype=torch.int64), holder, group=g))
    for work in works:
        work.wait()
    # sizes first: what each requesting ward will get (0: not held)
    serve = {w: kept[w].get(int(t.item())) for w, t in want.items() if int(t.item()) >= 0}
    size = torch.zeros(1, dtype=torch.int64)
    works = [
        dist.isend(torch.tensor([0 if v is None else len(v)], dtype=torch.int64), w, group=g)
        for w, v in serve.items()
    ]
    if step >= 0 and holder != rank:
        works.append(dist.irecv(size, holder, group=g))
    for work in works:
        work.wait()
    nbytes = int(size.item())
    target: memoryview | None = None
    works = []
    if step >= 0 and nbytes and holder != rank:
        target = memoryview(mmap.mmap(-1, nbytes))
        dst = _as_tensor(target)
        works += [dist.irecv(dst[a:b], holder, group=g) for a, b in _chunks(nbytes, chunk_bytes)]
    for w, view in serve.items():
        if view is not None:
            src = _as_tensor(view)
            works += [dist.isend(src[a:b], w, group=g) for a, b in _chunks(len(view), chunk_bytes)]
    for work in works:
        work.wait()
    return target
