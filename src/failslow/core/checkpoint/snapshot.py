"""Every-step in-memory snapshots of a rank's training state (byterobust 6.3 and section 7).

ByteRobust checkpoints every step into host memory with a dual buffer that "alternately stores
the optimizer's state dictionary between different iterations"; the copies run beside the
forward and backward passes (D2H on a dedicated CUDA stream) and "the optimizer step ... waits
for the completion of saving each rank's own checkpoints"; recovery picks "the latest available
checkpoints based on D2H and serialization completion status". :class:`Snapshotter` is that
engine for one rank::

    snap = Snapshotter(Path("/dev/shm/failslow-job"), rank=rank)
    for step in ...:
        loss = forward_backward()      # the previous step's copy runs meanwhile
        snap.wait_consistent()         # the optimizer may mutate the snapshotted tensors now
        optimizer.step()
        snap.start(state(), step)      # returns at once; copy, checksum and commit off-thread

Each slot is one :mod:`~failslow.core.checkpoint.blob` buffer: a file ``rank{r}-slot{k}.fsck``
in ``directory`` (a node-local tmpfs such as ``/dev/shm``), memory-mapped and grown as needed,
so a committed snapshot outlives the process and a hot-update restart resumes from it; or
anonymous memory when ``directory`` is None. A snapshot goes to a slot that does not hold the
newest committed one, so a crash mid-copy always leaves the previous step intact; it counts
only once :func:`blob.seal` has written its checksum and then its commit word.

One background thread does, per snapshot: header and manifest, every tensor copy (on CUDA:
``non_blocking`` copies into page-locked slot memory on a side stream that first waits for the
training stream, then an event), "consistent", the CRC-32 and commit word ("sealed"), then the
:meth:`Snapshotter.on_sealed` callbacks (the peer backup service). One snapshot is in flight at
a time: if the previous one is still being sealed or sent when the next :meth:`start` comes,
``on_busy="skip"`` (the default) drops the new step and counts it in ``skipped`` - the training
step never waits for a checksum or a peer - and ``on_busy="wait"`` blocks until it is done.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import pickle
import queue
import struct
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from failslow.core.checkpoint import blob
from failslow.errors import FailslowError

log = logging.getLogger(__name__)

SealedCallback = Callable[[int, memoryview], None]


class SnapshotError(FailslowError):
    """A snapshot could not be taken (slot directory locked or full, copy failed)."""


@dataclass(slots=True)
class SnapshotStats:
    """Costs of one snapshot. ``start_s`` is spent on the training thread, the rest off it."""

    step: int
    nbytes: int
    start_s: float
    """plan (or layout-cache check) and hand-off, on the caller's thread."""
    copy_s: float
    """header, manifest and tensor copies, until consistent (on CUDA: until the D2H finished)."""
    seal_s: float
    """CRC-32 and commit word."""
    replanned: bool
    """whether blob.plan ran (first snapshot, or the state's structure changed)."""


@dataclass(eq=False)
class _Job:
    step: int
    slot: int
    layout: blob.Layout
    stats: SnapshotStats
    cuda_ready: Any = None
    """event recorded on the training stream at start(); the side stream waits for it."""
    cuda_copied: Any = None
    consistent: threading.Event = field(default_factory=threading.Event)
    sealed: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Slot:
    """One snapshot buffer: a memory-mapped file that only grows, or anonymous memory."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.fd: int | None = None
        self.mm: mmap.mmap | None = None
        self.view = memoryview(b"")
        self.pinned_at: int | None = None
        if path is not None:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            size = os.fstat(self.fd).st_size
            if size:
                self._map(size)

    @property
    def size(self) -> int:
        return len(self.view)

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        nbytes = max(nbytes, self.size + self.size // 8)  # some headroom against creeping growth
        if self.fd is not None:
            try:  # reserve the pages now: a full tmpfs is an error here, not a SIGBUS mid-copy
                os.posix_fallocate(self.fd, 0, nbytes)
            except OSError as e:
                raise SnapshotError(
                    f"cannot grow snapshot slot {self.path} to {nbytes} bytes: {e}"
                ) from e
        self._map(nbytes)

    def _map(self, nbytes: int) -> None:
        was_pinned = self.pinned_at is not None
        self._release()
        # MAP_POPULATE: fault every page in now (off the training thread), not during the copy
        populate = getattr(mmap, "MAP_POPULATE", 0)
        if self.fd is None:
            self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        else:
            self.mm = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | populate)
        self.view = memoryview(self.mm)
        if was_pinned:
            self.pin()

    def pin(self) -> None:
        """Page-lock the mapping so D2H copies into it are asynchronous (cudaHostRegister)."""
        if self.pinned_at is not None or not self.size:
            return
        import torch

        address = int(np.frombuffer(self.view, dtype=np.uint8).ctypes.data)
        err = torch.cuda.cudart().cudaHostRegister(address, self.size, 0)
        if int(err) != 0:
            log.warning(
                "cudaHostRegister of %d bytes failed (%s): D2H copies will block", self.size, err
            )
            return
        self.pinned_at = address

    def _release(self) -> None:
        if self.pinned_at is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.pinned_at)
            self.pinned_at = None
        self.view = memoryview(b"")
        if self.mm is not None:
            # A buffer handed out by latest()/on_sealed keeps the old mapping alive until the
            # holder drops it; the file itself only grows, so that mapping stays valid.
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None

    def close(self) -> None:
        self._release()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_PRIMITIVES = (int, bool, str, bytes, type(None))


class _Uncacheable(Exception):
    pass


def _walk(state: Any, refs: list[blob.TensorRef]) -> tuple[Hashable, list[Any], list[Any], Any]:
    """One pass over ``state`` with blob.plan's rules: (structure key, primitive values, tensors
    in payload order, manifest tree with ``refs[i]`` in place of the i-th tensor). Equal keys
    mean equal layouts; equal keys and values mean an identical manifest. Any other object
    (DeepSpeed's optimizer state holds its ``LossScaler``) is compared by its pickled bytes -
    the manifest pickles it anyway - and, where it appears again, by which earlier one it is
    (the manifest's pickle shares it). Raises _Uncacheable for one that does not pickle."""
    key: list[Any] = []
    values: list[Any] = []
    tensors: list[Any] = []
    objects: dict[int, int] = {}  # id -> its index among the objects seen (kept alive by state)

    def value(obj: Any) -> None:  # typed, so 1 / 1.0 / True and 0.0 / -0.0 differ
        if isinstance(obj, float):
            values.append(obj.hex())
        elif isinstance(obj, _PRIMITIVES):
            values.append((type(obj), obj))
        elif isinstance(obj, dict | list | tuple) and not hasattr(obj, "_fields"):
            values.append((type(obj), len(obj)))
            for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
                value(k)
                value(v)
        elif id(obj) in objects:
            values.append(("again", objects[id(obj)]))
        else:
            objects[id(obj)] = len(objects)
            try:
                pickled = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                raise _Uncacheable from None
            values.append((type(obj), pickled))

    def walk(obj: Any) -> Any:
        if blob._is_tensor(obj):
            t = obj.detach()
            key.append((t.dtype, t.shape))
            tensors.append(t)
        elif blob._is_raw_array(obj):
            key.append((obj.dtype.str, obj.shape))
            tensors.append(obj)
        elif isinstance(obj, dict):
            factory = getattr(obj, "default_factory", None)
            key.append((type(obj), tuple(obj), tuple(map(type, obj)), factory))
            value(getattr(obj, "__dict__", None))  # instance attributes go into the manifest
            return blob._rebuild_dict(obj, ((k, walk(v)) for k, v in obj.items()))
        elif isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
            key.append((type(obj), len(obj)))
            return type(obj)(walk(v) for v in obj)
        else:
            key.append(None)  # a value here: where the tensors sit is part of the structure
            value(obj)
            return obj
        return refs[len(tensors) - 1] if len(tensors) <= len(refs) else None

    tree = walk(state)
    return tuple(key), values, tensors, tree


def _refs(tree: Any) -> list[blob.TensorRef]:
    """The TensorRefs of an unpickled manifest, in payload order."""
    if isinstance(tree, blob.TensorRef):
        return [tree]
    if isinstance(tree, dict):
        return [r for v in tree.values() for r in _refs(v)]
    if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        return [r for v in tree for r in _refs(v)]
    return []


@dataclass(slots=True)
class _LayoutCache:
    """blob.plan's result for one structure, so an unchanged state costs one walk (and a pickle
    of the manifest if a Python value such as a step counter or learning rate changed)."""

    key: Hashable
    values: list[Any]
    refs: list[blob.TensorRef]
    layout: blob.Layout

    def layout_for(self, state: Any) -> blob.Layout | None:
        key, values, tensors, tree = _walk(state, self.refs)
        if key != self.key:
            return None
        if values != self.values:
            manifest = pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL)
            self.values = values
            self.layout = blob.Layout(manifest, self.layout.tensors, self.layout.payload_bytes)
        offsets = [offset for _, offset in self.layout.tensors]
        tensor_offsets = list(zip(tensors, offsets, strict=True))
        return blob.Layout(self.layout.manifest, tensor_offsets, self.layout.payload_bytes)

    @classmethod
    def plan(cls, state: Any) -> tuple[blob.Layout, _LayoutCache | None]:
        layout = blob.plan(state)
        try:
            key, values, _, _ = _walk(state, [])
        except _Uncacheable:
            return layout, None
        return layout, cls(key, values, _refs(pickle.loads(layout.manifest)), layout)


_LOCK_FDS: set[int] = set()
"""Lock files this process holds. A forked child (a DataLoader worker) would keep a flock
alive after the owner closed it; children close their copies at once."""


def _close_locks_in_child() -> None:
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


class Snapshotter:
    """Every-step snapshots of one rank's state into ``slots`` alternating buffers."""

    def __init__(
        self,
        directory: Path | None,
        *,
        rank: int,
        slots: int = 2,
        on_busy: Literal["skip", "wait"] = "skip",
    ) -> None:
        if slots < 2:
            raise ValueError(f"slots={slots}: at least 2 are needed to keep one committed")
        if on_busy not in ("skip", "wait"):
            raise ValueError(f"on_busy={on_busy!r}: expected 'skip' or 'wait'")
        self.directory = None if directory is None else Path(directory)
        self.rank = rank
        self.on_busy = on_busy
        self.skipped = 0
        """start() calls dropped because the previous snapshot was still being sealed or sent."""
        self.taken = 0
        self.stats: SnapshotStats | None = None
        """the last sealed snapshot's costs."""
        self._lock_fd: int | None = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = self._take_lock(self.directory / f"rank{rank}.lock")
        self._slots: list[_Slot] = []
        self._committed: list[int | None] = [None] * slots
        for k in range(slots):
            path = None if self.directory is None else self.directory / f"rank{rank}-slot{k}.fsck"
            self._slots.append(_Slot(path))
            self._committed[k] = self._recover(self._slots[k])
        self._callbacks: list[SealedCallback] = []
        self._mutex = threading.Lock()
        self._pending: _Job | None = None
        self._failed: _Job | None = None
        self._layout_cache: _LayoutCache | None = None
        self._side_stream: Any = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ training thread

    def start(self, state: Any, step: int) -> None:
        """Snapshot ``state`` as of ``step`` without blocking on the copy (see the module doc)."""
        if self._closed:
            raise SnapshotError("start() on a closed Snapshotter")
        began = time.perf_counter()
        previous = self._pending
        if previous is not None and not previous.done.is_set():
            if self.on_busy == "skip":
                self.skipped += 1
                log.debug(
                    "snapshot of step %d skipped: step %d still in flight", step, previous.step
                )
                return
            previous.done.wait()
        self._raise_failure()
        layout, replanned = self._plan(state)
        with self._mutex:
            for k, committed in enumerate(self._committed):
                if committed is not None and committed > step:  # training went back in time
                    log.info("discarding the snapshot of step %d: now at step %d", committed, step)
                    self._uncommit(k)
            target = self._pick_slot()
            self._uncommit(target)
        job = _Job(
            step, target, layout, SnapshotStats(step, layout.total_bytes, 0.0, 0.0, 0.0, replanned)
        )
        if any(getattr(t, "is_cuda", False) for t, _ in layout.tensors):
            import torch

            job.cuda_ready = torch.cuda.Event()
            job.cuda_ready.record()
        self._pending = job
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._run, name=f"failslow-snapshot-rank{self.rank}", daemon=True
            )
            self._worker.start()
        job.stats.start_s = time.perf_counter() - began
        self._jobs.put(job)

    def wait_consistent(self) -> None:
        """Return once the pending snapshot's tensors are copied: they may be mutated now.

        On CUDA the host returns once the copies are queued; the current stream then waits for
        them on the device, so the optimizer kernels run after the copies."""
        job = self._pending
        if job is None:
            return
        job.consistent.wait()
        self._raise_failure()
        if job.cuda_copied is not None:
            import torch

            torch.cuda.current_stream().wait_event(job.cuda_copied)

    def wait_sealed(self, timeout_s: float | None = None) -> int | None:
        """The newest committed step once the pending snapshot is sealed (or ``timeout_s`` passed:
        then the newest committed so far)."""
        job = self._pending
        if job is not None:
            job.sealed.wait(timeout_s)
        self._raise_failure()
        with self._mutex:
            steps = [s for s in self._committed if s is not None]
        return max(steps) if steps else None

    # ------------------------------------------------------------------ recovery

    def latest(self) -> tuple[int, memoryview] | None:
        """(step, buffer) of the newest committed snapshot that verifies; a torn or corrupt one is
        logged, forgotten, and the next older one tried. The buffer is the slot itself: it stays
        valid until that slot is reused, ``slots - 1`` snapshots later (copy it to keep it)."""
        while True:
            with self._mutex:
                candidates = [(s, k) for k, s in enumerate(self._committed) if s is not None]
            if not candidates:
                return None
            step, k = max(candidates)
            view = self._slots[k].view
            try:
                found = blob.verify(view)
                if found != step:
                    raise blob.CorruptSnapshot(f"slot holds step {found}, expected {step}")
                return step, view[: blob.header_of(view)["total_bytes"]]
            except blob.CorruptSnapshot as e:
                log.warning("snapshot slot %s unusable, falling back: %s", self._name(k), e)
                with self._mutex:
                    if self._committed[k] == step:
                        self._committed[k] = None

    def forget_from(self, step: int) -> list[int]:
        """Uncommit every slot holding a snapshot of ``step`` or later, in memory and on disk
        (a rollback: those states may hold the bad values); the steps forgotten."""
        with self._mutex:
            gone = [c for c in self._committed if c is not None and c >= step]
            for k, committed in enumerate(self._committed):
                if committed is not None and committed >= step:
                    self._uncommit(k)
        return sorted(gone)

    def load(self) -> tuple[int, Any] | None:
        """(step, state) of :meth:`latest`, every tensor copied out, bitwise equal to the source."""
        found = self.latest()
        if found is None:
            return None
        return blob.read(found[1], check=False)  # latest() has just verified it

    def on_sealed(self, callback: SealedCallback) -> None:
        """Call ``callback(step, buffer)`` on the snapshot thread after each seal (e.g. to send the
        buffer to a backup peer). The next snapshot waits for the callbacks (or is skipped);
        the buffer is valid until its slot is reused. Exceptions are logged, not raised."""
        self._callbacks.append(callback)

    def close(self) -> None:
        """Finish the pending snapshot, stop the thread and unmap; files stay for a restart."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
        for slot in self._slots:
            slot.close()
        if self._lock_fd is not None:
            _LOCK_FDS.discard(self._lock_fd)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _name(self, k: int) -> str:
        path = self._slots[k].path
        return str(path) if path is not None else f"rank{self.rank}-slot{k} (memory)"

    @staticmethod
    def _take_lock(path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SnapshotError(
                f"{path}: another live process (or an unclosed Snapshotter) owns these slots"
            ) from None
        _LOCK_FDS.add(fd)
        return fd

    @staticmethod
    def _recover(slot: _Slot) -> int | None:
        if slot.size < blob.HEADER_BYTES:
            return None
        try:
            return blob.verify(slot.view)
        except blob.CorruptSnapshot as e:
            log.info("ignoring snapshot slot %s: %s", slot.path, e)
            return None

    def _pick_slot(self) -> int:
        """A free slot, else the one with the oldest snapshot; never the newest committed."""

        def age(k: int) -> int:
            committed = self._committed[k]
            return -1 if committed is None else committed

        return min(range(len(self._slots)), key=age)

    def _uncommit(self, k: int) -> None:
        if self._committed[k] is not None:
            self._committed[k] = None
            view = self._slots[k].view
            struct.pack_into("<Q", view, blob.COMMIT_OFFSET, 0)  # on disk too: never resume it

    def _plan(self, state: Any) -> tuple[blob.Layout, bool]:
        if self._layout_cache is not None:
            try:
                layout = self._layout_cache.layout_for(state)
            except _Uncacheable:
                layout = None
            if layout is not None:
                return layout, False
        layout, self._layout_cache = _LayoutCache.plan(state)
        return layout, True

    def _raise_failure(self) -> None:
        job, self._failed = self._failed, None
        if job is not None:
            raise SnapshotError(f"snapshot of step {job.step} failed: {job.error!r}") from job.error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._take(job)
            except BaseException as e:
                job.error = e
                self._failed = job
                log.error("snapshot of step %d failed: %r", job.step, e)
            finally:
                job.consistent.set()
                job.sealed.set()
                job.done.set()

    def _take(self, job: _Job) -> None:
        import torch

        began = time.perf_counter()
        layout = job.layout
        slot = self._slots[job.slot]
        slot.ensure(layout.total_bytes)
        buf = slot.view
        on_cuda = job.cuda_ready is not None
        if on_cuda:
            slot.pin()
        # header (uncommitted) and manifest; the tensors follow
        blob.write_payload(buf, blob.Layout(layout.manifest, [], layout.payload_bytes), job.step)
        raw = np.frombuffer(buf, dtype=np.uint8)
        start = layout.payload_start
        with torch.no_grad(), self._copy_stream(job) as stream:
            for tensor, offset in layout.tensors:
                nbytes = blob._nbytes(tensor)
                if not nbytes:
                    continue
                dst = raw[start + offset : start + offset + nbytes]
                if stream is not None and getattr(tensor, "is_cuda", False):
                    out = torch.from_numpy(dst).view(tensor.dtype).view(tensor.shape)
                    out.copy_(tensor, non_blocking=True)
                    tensor.record_stream(stream)
                else:
                    blob._copy_into(dst, tensor)
            if stream is not None:
                job.cuda_copied = torch.cuda.Event()
                job.cuda_copied.record(stream)
        del raw
        job.consistent.set()
        if job.cuda_copied is not None:
            job.cuda_copied.synchronize()
        sealing = time.perf_counter()
        job.stats.copy_s = sealing - began
        blob.seal(buf)
        job.stats.seal_s = time.perf_counter() - sealing
        with self._mutex:
            self._committed[job.slot] = job.step
        self.stats = job.stats
        self.taken += 1
        job.sealed.set()
        sealed = buf[: layout.total_bytes]
        for callback in self._callbacks:
            try:
                callback(job.step, sealed)
            except Exception:
                log.exception("on_sealed callback %r failed for step %d", callback, job.step)

    @contextlib.contextmanager
    def _copy_stream(self, job: _Job) -> Any:
        if job.cuda_ready is None:
            yield None
            return
        import torch

        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        stream = self._side_stream
        stream.wait_event(job.cuda_ready)
        with torch.cuda.stream(stream):
            yield stream
