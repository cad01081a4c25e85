"""Peer backups of every sealed snapshot, off the training thread (byterobust 6.3, Fig. 8-9).

ByteRobust backs each rank's in-memory checkpoint up on a peer outside all of its parallel
groups (:mod:`.placement`), "employs P2P communication for each rank to exchange these shards
with its peer rank" during forward and backward, and "partition[s] the states into small chunks".
:class:`BackupService` does that over a dedicated gloo process group, from one background thread:

* the local :class:`~failslow.core.checkpoint.snapshot.Snapshotter` calls :meth:`submit` (an
  ``on_sealed`` callback) with each sealed buffer; the service sends it to ``holders[rank]`` in
  chunks of ``chunk_bytes`` (payload first, the 64-byte header with its commit word last) while it
  receives its wards' snapshots the same way;
* a holder stores ward ``w``'s snapshot in the node-local file
  ``<directory>/backup-of-rank{w}-slot{k}.fsck`` (``directory`` is a tmpfs such as ``/dev/shm``,
  so it outlives a restart of the holder's processes), double-buffered: a new backup goes to the
  slot that does not hold the newest one; its commit word is zeroed first and it counts only once
  fully received and verified (:func:`blob.verify`), so a holder killed mid-receive keeps the
  previous backup intact.

**Pairing rule.** Transfers run in *rounds*, one per backed-up step ``s`` (``s % every == 0``,
``s > after_step``), in increasing order, identical on every rank. In round ``s`` a rank sends a
size header ``(s, nbytes)`` and then its snapshot of step ``s`` to its holder, and receives one
header (and snapshot) from each ward - O(1) messages per rank and step, never O(world). A rank
that did not seal step ``s`` (its Snapshotter skipped it while busy) still takes part: it runs
round ``s`` with ``nbytes = 0`` when it seals a later step (or at :meth:`close`), and the holder
keeps the previous backup. A slow rank therefore only delays the backup thread of its holder and
wards, never the training step. While a round is in flight the next ``submit`` (on the snapshot
thread) returns only when its round is done, so a slot is never reused while it is being sent,
and the round of step ``s`` overlaps the compute of step ``s + 1``; if it is slower than a step,
the Snapshotter skips (``on_busy="skip"``) or waits (``"wait"``). Restoring needs a step every
rank still has: with the training's collectives keeping ranks within a step of each other,
``on_busy="wait"`` and three local slots (``Snapshotter(slots=3)``) guarantee one (two slots can
leave a survivor one step ahead of an evicted rank's newest backup). Steps must
be submitted in increasing order; ``after_step`` (the step the job started or restored from) and
``every`` must be the same on every rank, and every rank must :meth:`close` with the same
``last_step``.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import struct
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from failslow.core.checkpoint import blob
from failslow.errors import FailslowError

log = logging.getLogger(__name__)

SLOTS = 2


class BackupError(FailslowError):
    """The backup protocol broke (peers out of step, a peer gone, a full tmpfs)."""


def backup_path(directory: Path, ward: int, slot: int) -> Path:
    """Node-local file holding slot ``slot`` of ``ward``'s backup."""
    return Path(directory) / f"backup-of-rank{ward}-slot{slot}.fsck"


def committed_step(view: memoryview) -> int | None:
    """The step a buffer claims to hold if its commit word is set (cheap: no checksum)."""
    if len(view) < blob.HEADER_BYTES:
        return None
    try:
        header = blob.header_of(view)
    except blob.CorruptSnapshot:
        return None
    if header["commit"] != header["step"] + 1 or len(view) < header["total_bytes"]:
        return None
    return header["step"]


def forget_backups(directory: Path, wards: Iterable[int], from_step: int) -> list[int]:
    """Uncommit the backups this node holds for ``wards`` of ``from_step`` or later (a rollback:
    those states may hold the bad values); the steps forgotten. Before the backup service of
    this process starts (the files are not mapped yet)."""
    gone = []
    for ward in wards:
        for k in range(SLOTS):
            path = backup_path(directory, ward, k)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                header = blob.header_of(memoryview(os.pread(fd, blob.HEADER_BYTES, 0)))
                step = header["step"]
                if header["commit"] == step + 1 and step >= from_step:
                    os.pwrite(fd, bytes(8), blob.COMMIT_OFFSET)
                    gone.append(step)
            except (blob.CorruptSnapshot, struct.error):
                pass  # empty or not a snapshot: nothing committed to forget
            finally:
                os.close(fd)
    return gone


class BackupSlot:
    """One backup file, memory-mapped, grown as needed; ``step`` is its verified content."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.mm: mmap.mmap | None = None
        size = os.fstat(self.fd).st_size
        if size:
            self.mm = mmap.mmap(self.fd, size)
        self.step = committed_step(self.view)

    @property
    def view(self) -> memoryview:
        return memoryview(self.mm) if self.mm is not None else memoryview(b"")

    def prepare(self, nbytes: int) -> memoryview:
        """Invalidate the slot, make room for ``nbytes`` and return a writable view of them."""
        self.step = None
        if self.mm is not None and len(self.mm) >= blob.HEADER_BYTES:
            struct.pack_into("<Q", self.mm, blob.COMMIT_OFFSET, 0)
        if self.mm is None or len(self.mm) < nbytes:
            try:  # reserve tmpfs pages now: a full /dev/shm is an error, not a SIGBUS later
                os.posix_fallocate(self.fd, 0, nbytes)
            except OSError as e:
                raise BackupError(
                    f"cannot grow backup file {self.path} to {nbytes} bytes: {e}"
                ) from e
            if self.mm is not None:
                self.mm.close()
            self.mm = mmap.mmap(self.fd, nbytes)
        return memoryview(self.mm)[:nbytes]

    def invalidate(self) -> None:
        self.step = None
        if self.mm is not None and len(self.mm) >= blob.HEADER_BYTES:
            struct.pack_into("<Q", self.mm, blob.COMMIT_OFFSET, 0)

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still exported; the mapping dies with it
                pass
            self.mm = None
        os.close(self.fd)


def _as_tensor(view: memoryview) -> Any:
    import torch

    with warnings.catch_warnings():  # read-only buffers are only ever sent, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Payload ranges first, the header (and its commit word) last."""
    ranges = [
        (start, min(start + chunk_bytes, nbytes))
        for start in range(blob.HEADER_BYTES, nbytes, chunk_bytes)
    ]
    return [*ranges, (0, min(blob.HEADER_BYTES, nbytes))]


class BackupService:
    """Send each sealed local snapshot to its holder and keep the wards' snapshots (see module)."""

    def __init__(
        self,
        source: Any,
        holders: Sequence[int],
        rank: int,
        directory: Path | str,
        *,
        every: int = 1,
        after_step: int = -1,
        chunk_bytes: int = 4 << 20,
        window: int = 4,
        group: Any = None,
    ) -> None:
        import torch.distributed as dist

        if every < 1 or chunk_bytes < blob.HEADER_BYTES or window < 1:
            raise ValueError(
                f"every={every}, chunk_bytes={chunk_bytes}, window={window}: expected every >= 1, "
                f"chunk_bytes >= {blob.HEADER_BYTES}, window >= 1"
            )
        self.rank = rank
        self.holders = tuple(holders)
        self.holder = self.holders[rank]
        self.wards = [w for w, h in enumerate(self.holders) if h == rank and w != rank]
        self.every = every
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._own_group = group is None
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.slots = {
            w: [BackupSlot(backup_path(self.directory, w, k)) for k in range(SLOTS)]
            for w in self.wards
        }
        self.rounds_done = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._next_round = (after_step // every + 1) * every
        self._queue: queue.SimpleQueue[tuple[int, memoryview | None] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = 0
        self._completed = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"failslow-backup-rank{rank}", daemon=True
        )
        self._thread.start()
        if source is not None:
            register: Callable[[Callable[[int, memoryview], None]], None] = getattr(
                source, "on_sealed", source
            )
            register(self.submit)

    # ------------------------------------------------------------------ producer side

    def submit(self, step: int, buf: memoryview) -> None:
        """Back ``buf`` (the sealed snapshot of ``step``) up; returns once its round is done.

        Called on the Snapshotter's thread (``on_sealed``), so the next snapshot starts only after
        this one reached its holder: ``buf`` is never reused while it is being sent, and a rank's
        backups trail its local snapshots by at most one step (see the restore rule)."""
        with self._cond:
            if self._error is not None or self._closed:
                return
            if step % self.every or step < self._next_round:
                return
            self._submitted += 1
            ticket = self._submitted
            self._queue.put((step, buf))
            self._cond.wait_for(lambda: self._completed >= ticket or self._error is not None)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted round is done; False on timeout. Raises a thread error."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._completed == self._submitted or self._error, timeout_s
            )
        self._raise()
        return bool(done)

    def close(self, last_step: int | None = None, timeout_s: float | None = None) -> None:
        """Run the (empty) rounds up to ``last_step`` - the same on every rank - and stop."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            if last_step is not None:
                self._submitted += 1
                self._queue.put((last_step, None))
        self._queue.put(None)
        self._thread.join(timeout_s)
        for slots in self.slots.values():
            for slot in slots:
                slot.close()
        if self._own_group and not self._thread.is_alive():
            # the group this service made goes with it: its gloo threads are joined now, not
            # at interpreter teardown (where they abort the process)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self.group)
            self.group = None
        self._raise()

    def backups(self) -> dict[int, list[int]]:
        """Verified backup steps held per ward, newest first."""
        return {
            w: sorted((s.step for s in slots if s.step is not None), reverse=True)
            for w, slots in self.slots.items()
        }

    # ------------------------------------------------------------------ background thread

    def _raise(self) -> None:
        if self._error is not None:
            raise BackupError(f"backup thread of rank {self.rank} failed: {self._error!r}")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, buf = item
            try:
                if self._error is None:
                    while self._next_round < step:
                        self._round(self._next_round, None)
                        self._next_round += self.every
                    if buf is not None or self._next_round == step:
                        self._round(step, buf)
                        self._next_round = step + self.every
            except BaseException as e:
                log.error("backup round for step %d failed on rank %d: %r", step, self.rank, e)
                self._error = e
            finally:
                with self._cond:
                    self._completed += 1
                    self._cond.notify_all()

    def _round(self, step: int, buf: memoryview | None) -> None:
        import torch
        import torch.distributed as dist

        nbytes = 0
        if buf is not None:
            nbytes = blob.header_of(buf)["total_bytes"]
            buf = buf[:nbytes]
        g = self.group
        out_header = torch.tensor([step, nbytes], dtype=torch.int64)
        in_headers = {w: torch.zeros(2, dtype=torch.int64) for w in self.wards}
        works: list[Any] = (
            [dist.isend(out_header, self.holder, group=g)] if self.holder != self.rank else []
        )
        works += [dist.irecv(t, w, group=g) for w, t in in_headers.items()]
        for work in works:
            work.wait()
        targets: dict[int, tuple[BackupSlot, memoryview]] = {}
        for w, t in in_headers.items():
            their_step, their_bytes = (int(x) for x in t.tolist())
            if their_step != step:
                raise BackupError(
                    f"rank {w} is at backup round {their_step}, rank {self.rank} at {step}: "
                    "every rank must back up the same steps (same every/after_step)"
                )
            if their_bytes:
                slot = self._pick(w)
                targets[w] = (slot, slot.prepare(their_bytes))
        self._transfer(buf if self.holder != self.rank else None, targets)
        for w, (slot, view) in targets.items():
            try:
                slot.step = blob.verify(view)
                self.bytes_received += len(view)
            except blob.CorruptSnapshot as e:
                log.warning("backup of rank %d step %d unusable: %s", w, step, e)
                slot.invalidate()
        self.bytes_sent += nbytes if self.holder != self.rank else 0
        self.rounds_done += 1

    def _pick(self, ward: int) -> BackupSlot:
        """The slot not holding the newest verified backup (an empty one first)."""
        return min(self.slots[ward], key=lambda s: -1 if s.step is None else s.step)

    def _ops(self, op: Callable[..., Any], view: memoryview, peer: int) -> Iterator[Any]:
        tensor = _as_tensor(view)
        for a, b in _chunks(len(view), self.chunk_bytes):
            yield op(tensor[a:b], peer, group=self.group)

    def _transfer(
        self, buf: memoryview | None, targets: dict[int, tuple[BackupSlot, memoryview]]
    ) -> None:
        import torch.distributed as dist

        streams: list[Iterator[Any]] = []
        if buf is not None and len(buf):
            streams.append(self._ops(dist.isend, buf, self.holder))
        for w, (_, view) in sorted(targets.items()):
            streams.append(self._ops(dist.irecv, view, w))
        # Interleave every direction chunk by chunk and keep at most `window` chunks in flight
        # per direction: everyone posts chunk i of every stream before waiting on chunk i.
        pending: list[Any] = []
        limit = self.window * max(1, len(streams))
        while streams:
            alive = []
            for stream in streams:
                work = next(stream, None)
                if work is not None:
                    pending.append(work)
                    alive.append(stream)
            streams = alive
            while len(pending) > limit:
                pending.pop(0).wait()
        for work in pending:
            work.wait()
