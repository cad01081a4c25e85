"""The Python collective hook: records every torch.distributed call into the event ring.

This is the Python side of greyhound 4.2's Monitor ("intercepts communication operations ...
and logs their types and timestamps" into shared memory for the LocalAnalyzer). It works on
any backend (gloo in tests) and sees what real frameworks issue, because it sits in the c10d
*dispatcher*, below every caller: a Python kernel is registered for the ``Autograd`` dispatch key
of each ``c10d::`` collective/p2p op (see :mod:`failslow.nccl_hook.c10d_ops`). Every call, from
``torch.distributed`` functions, DDP's C++ reducer, FSDP2, DeepSpeed's stored references to
``torch.distributed`` functions or Megatron's ``batch_isend_irecv``, passes through that key
before the backend kernel. The kernel stamps ``t_start``, runs the real op below autograd
(``_AutoDispatchBelowAutograd``), and writes the record from the Work's future callback, so the
caller is never blocked; ``t_end`` is when that callback ran (see the README's capture notes for
the GIL bias). Only c10d ops pay the Python cost - unlike a TorchDispatchMode, which pays per
aten op and is thread-local. Measured: ``benchmarks/hook_mechanisms.py``. Before ``t_start``
the kernel passes through the pause trap (:mod:`failslow.nccl_hook.trap`), one header load
while no pause is requested.

The kernel's per-call work runs in C++ when the native hook is built
(:mod:`failslow.nccl_hook.native_hook`, ``native/hook.cpp``: the same record, about 1-4 us per
call instead of ~0.1 ms plus the GIL on the backend's completion threads); this module then
keeps the group table, the pause trap and the step markers, and the C++ kernel calls into it
only for a new group, a requested pause or a ring not yet open. Without the build the Python
kernel below does it all.

The hook also marks the end of every optimizer step in the ring (:mod:`.step_marker`), where
the iteration tracker measures iterations when it can.

Known gaps: collectives issued before :func:`install` are not recorded (groups created before
it are, from their next call on, and are published at install time); collectives issued under
``torch.inference_mode()`` skip the Autograd key and are not recorded; ``monitored_barrier``
is not a recorded op; a call whose work never completes (a hang) leaves no record.
"""

from __future__ import annotations

import atexit
import collections
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.core.events import Flags, OpCode, Source
from failslow.core.group_files import groups_path
from failslow.core.ring import DEFAULT_CAPACITY, RingWriter, ring_path
from failslow.nccl_hook import native_hook
from failslow.nccl_hook.c10d_ops import OP_SPECS, OpSpec, dtype_table, payload_dtype
from failslow.nccl_hook.groups import (
    GroupEntry,
    GroupTable,
    NativeCallCounter,
    backend_name_of,
    group_ranks_of,
)
from failslow.nccl_hook.step_marker import StepMarker
from failslow.nccl_hook.trap import Trap

log = logging.getLogger(__name__)

_NEVER_POLLED = frozenset({OpCode.REDUCE_SCATTER, OpCode.REDUCE_SCATTER_COALESCED})


def shim_active(ring_dir: Path) -> bool:
    """Whether the C shim is loaded in this process and recording into ``ring_dir``."""
    import ctypes

    try:
        loaded = hasattr(ctypes.CDLL(None), "failslow_shim_version")
    except OSError:
        return False
    env = os.environ.get(envvars.RING_DIR)
    return loaded and env is not None and Path(env).resolve() == Path(ring_dir).resolve()


class Capture:
    """One process's capture: the ring writer, the group table and the dispatcher kernels."""

    def __init__(self, ring_dir: Path, *, capacity: int, global_rank: int | None) -> None:
        self.ring_dir = ring_dir
        self.capacity = capacity
        self.writer: RingWriter | None = None
        self.trap: Trap | None = None
        self.ring_path: Path | None = None
        self.groups = GroupTable()
        self.active = False
        self._tls = threading.local()
        self._lib: Any = None
        self._orig_helper: Any = None
        self._open_lock = threading.Lock()
        self._watcher = _Watcher(self)
        self._steps = StepMarker()
        self.defer_nccl = False
        """True when the C shim records this process's NCCL calls (they are skipped here)."""
        self.global_rank = -1
        self._world_name: str | None = None
        self.pause_calls: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=256)
        """Recent ``(call_index, token, t_start_ns)`` of the pause group's calls (read-only for
        others: the rank runtime finds the iteration's phase in them, control/phase.py)."""
        self._ring_listeners: list[Callable[[Capture], None]] = []
        self.inflight = 0
        """Completion callbacks handed to torch and not yet released by it (:class:`_Callback`)."""
        self._inflight_lock = threading.Lock()
        self._exit_registered = False
        self.native: Any = None
        """The native hook module while its C++ kernel records the calls (native_hook.py)."""
        if global_rank is not None:
            self._open(global_rank)

    # -- ring ------------------------------------------------------------------------------
    def _open(self, global_rank: int) -> None:
        with self._open_lock:
            if self.writer is not None:
                return
            self.defer_nccl = shim_active(self.ring_dir)
            source = "py" if self.defer_nccl else ""
            path = ring_path(self.ring_dir, global_rank, os.getpid(), source)
            local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
            self.writer = RingWriter(
                path, capacity=self.capacity, global_rank=global_rank, local_rank=local_rank
            )
            self.trap = Trap(self.writer)
            if self.native is not None:
                self.writer.use_native(self.native)
            self.ring_path = path
            self.global_rank = global_rank
            self.groups.set_path(groups_path(path))
            listeners = list(self._ring_listeners)
        for listener in listeners:
            self._notify(listener)

    def on_ring(self, listener: Callable[[Capture], None]) -> None:
        """Call ``listener(capture)`` once the ring exists (at once if it does already): the
        global rank is known then, and so is the trap (the rank runtime attaches its control
        there, :mod:`failslow.runtime.rank_control`)."""
        with self._open_lock:
            ready = self.writer is not None
            if not ready:
                self._ring_listeners.append(listener)
        if ready:
            self._notify(listener)

    def _notify(self, listener: Callable[[Capture], None]) -> None:
        try:
            listener(self)
        except Exception:  # whatever sits on top of capture must never stop training
            log.warning("failslow: ring listener %r failed", listener, exc_info=True)

    def pause_group(self, world_size: int) -> GroupEntry | None:
        """The group every rank pauses on: the busiest one spanning all ranks (WORLD, or the
        data-parallel group a framework created over the same ranks - DeepSpeed's gradient
        all-reduce never touches WORLD). Every rank of a synchronous job calls such groups
        equally often, so all pick the same one once training runs."""
        spanning = [e for e in self.groups.entries() if len(e.ranks) == world_size]
        if not spanning:
            return None
        entry = max(spanning, key=lambda e: (e.calls.peek(), e.key))
        if entry.name != self._world_name:
            self._world_name = entry.name
            self.pause_calls.clear()  # the phase is of the new group's call sequence
            if self.native is not None:
                self.native.set_pause_group(entry.name)
        return entry

    def recent_pause_calls(self) -> list[tuple[int, int, int]]:
        """``(call_index, token, t_start_ns)`` of the pause group's recent calls, oldest
        first (kept by whichever kernel records them)."""
        if self.native is not None:
            return [tuple(c) for c in self.native.pause_calls()]  # type: ignore[misc]
        return list(self.pause_calls)

    def ensure_ring(self) -> RingWriter | None:
        """The ring writer, opening it now if the default process group already exists."""
        if self.writer is None:
            import torch.distributed as dist

            if dist.is_initialized():
                self._open(dist.get_rank())
        return self.writer

    # -- activation ------------------------------------------------------------------------
    def activate(self) -> None:
        import torch
        import torch.distributed.distributed_c10d as c10d

        if self.active:
            return
        specs = [s for s in OP_SPECS if getattr(torch.ops.c10d, s.name, None) is not None]
        native = native_hook.load()
        if native is not None:
            self._start_native(native, specs)
        else:
            lib = torch.library.Library("c10d", "IMPL")
            for spec in specs:
                overload = getattr(torch.ops.c10d, spec.name).default
                lib.impl(spec.name, self._make_kernel(spec, overload), "Autograd")
            self._lib = lib
        if not self._exit_registered:  # after torch's import: runs before torch tears down
            atexit.register(self.quiesce)
            self._exit_registered = True
        self._orig_helper = c10d._new_process_group_helper
        c10d._new_process_group_helper = self._wrap_helper(self._orig_helper)
        self._steps.attach(self.ensure_ring)
        self.active = True
        if c10d.is_initialized():
            self.ensure_ring()
            for pg in list(c10d._world.pg_group_ranks):
                if hasattr(pg, "group_name"):  # Megatron-core files some under other keys
                    self._entry_for(pg)

    def deactivate(self) -> None:
        import torch.distributed.distributed_c10d as c10d

        if not self.active:
            return
        self.active = False
        self._steps.detach()
        if self._orig_helper is not None:
            c10d._new_process_group_helper = self._orig_helper
            self._orig_helper = None
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
        if self.native is not None:
            self.native.uninstall()  # the C++ kernel is gone; its counters and ring stay

    def quiesce(self, timeout_s: float = 2.0) -> bool:
        """Stop capturing and wait (up to ``timeout_s``) until torch released every completion
        callback; stop the work watcher. Run at interpreter exit (registered by
        :meth:`activate`), before the process group goes: afterwards no backend thread needs
        the GIL for failslow. True when every callback was released in time."""
        self.deactivate()
        self._watcher.stop()
        deadline = time.monotonic() + timeout_s
        while self.inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL: the backend threads drop their references
        return self.inflight <= 0

    def close(self) -> None:
        self.deactivate()
        with self._open_lock:
            if self.writer is not None:
                self.writer.close()

    # -- the native hook (native_hook.py, native/hook.cpp) ------------------------------------
    def _start_native(self, native: Any, specs: list[OpSpec]) -> None:
        """Record with the C++ kernel: it gets the op table, every group known so far (and
        each new one, with its call counter), and the ring."""
        table = [_native_spec(spec) for spec in specs]
        self.native = native
        self.groups.on_add = self._register_native
        for entry in self.groups.entries():
            self._register_native(entry)
        if self.writer is not None and self.writer._native is None:
            self.writer.use_native(native)
        native.install(self, table, dtype_table())
        if self._world_name is not None:
            native.set_pause_group(self._world_name)

    def _register_native(self, entry: GroupEntry) -> None:
        native = self.native
        if native is None or isinstance(entry.calls, NativeCallCounter):
            return
        defer = self.defer_nccl and "nccl" in entry.backend.lower()
        native.add_group(entry.name, entry.key, list(entry.ranks), defer, entry.calls.peek())
        entry.calls = NativeCallCounter(native, entry.name)

    def _native_resolve(self, pg_obj: Any) -> None:
        """The C++ kernel met a group it does not know, or has no ring yet (GIL held)."""
        from torch._C._distributed_c10d import ProcessGroup

        try:
            self.ensure_ring()
            self._register_native(self._entry_for(ProcessGroup.unbox(pg_obj)))
        except Exception:  # the call goes on unrecorded; it must never fail for failslow
            log.debug("failslow: could not register a group with the native hook", exc_info=True)

    def _native_trap(self, pg_obj: Any) -> None:
        """The C++ kernel saw a pause requested in the ring header (GIL held)."""
        from torch._C._distributed_c10d import ProcessGroup

        self._check_trap(pg_obj, ProcessGroup)

    # -- groups ----------------------------------------------------------------------------
    def _wrap_helper(self, orig: Any) -> Any:
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def helper(*args: Any, **kwargs: Any) -> Any:
            result = orig(*args, **kwargs)
            try:
                self._on_group_created(sig.bind(*args, **kwargs).arguments, result[0])
            except Exception:  # never break group creation
                log.exception("failslow: could not register a new process group")
            return result

        return helper

    def _on_group_created(self, arguments: dict[str, Any], pg: Any) -> None:
        import torch.distributed.distributed_c10d as c10d

        if pg is None or pg is c10d.GroupMember.NON_GROUP_MEMBER:
            return
        members = list(arguments.get("global_ranks_in_group") or [])
        is_world = not members
        if is_world:
            members = list(range(int(arguments["group_size"])))
            if self.writer is None:
                self._open(int(arguments["group_rank"]))
        self.groups.add(
            str(arguments["group_name"]),
            members,
            backend=str(arguments.get("backend", "")),
            role="world" if is_world else None,
        )

    def _entry_for(self, pg: Any) -> GroupEntry:
        name = pg.group_name
        entry = self.groups.get(name)
        if entry is None:
            import torch.distributed.distributed_c10d as c10d

            ranks = group_ranks_of(pg) or tuple(range(pg.size()))
            role = "world" if pg is c10d.GroupMember.WORLD else None
            entry = self.groups.add(name, ranks, backend=backend_name_of(pg), role=role)
        return entry

    # -- the dispatcher kernel -------------------------------------------------------------
    def _make_kernel(self, spec: OpSpec, overload: Any) -> Any:
        import torch
        from torch._C._distributed_c10d import ProcessGroup, Work

        below = torch._C._AutoDispatchBelowAutograd
        tls = self._tls

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if getattr(tls, "busy", False) or not self.active:
                with below():
                    return overload(*args, **kwargs)
            tls.busy = True  # a collective issued from inside this call is not recorded
            try:
                if self.trap is not None:  # the pause trap (trap.py)
                    self._check_trap(args[spec.pg_arg], ProcessGroup)
                writer = self.writer  # it keeps the call in flight until its record is in
                token: int | None = None
                if writer is not None:
                    token, t_start = writer.begin()
                else:
                    t_start = time.monotonic_ns()
                try:
                    with below():
                        out = overload(*args, **kwargs)
                except BaseException:
                    self._safely(self._record, spec, args, None, t_start, ProcessGroup, Work, token)
                    raise
                self._safely(self._record, spec, args, out, t_start, ProcessGroup, Work, token)
                return out
            finally:
                tls.busy = False

        return kernel

    def park_here(self) -> None:
        """Park this thread in the trap now (a pause requested at a step boundary); the
        validation traffic it runs while parked is not recorded, as inside a collective."""
        trap = self.trap
        if trap is None:
            return
        tls = self._tls
        busy, tls.busy = getattr(tls, "busy", False), True
        native = self.native
        native_busy = native.set_busy(True) if native is not None else False
        try:
            trap.park()
        finally:
            tls.busy = busy
            if native is not None:
                native.set_busy(native_busy)

    def _check_trap(self, pg_obj: Any, pg_cls: Any) -> None:
        """Park here if a pause asks for this call (``pg_obj``: the call's boxed group)."""
        try:
            trap = self.trap
            if trap is not None and trap.requested():
                entry = self._entry_for(pg_cls.unbox(pg_obj))
                trap.check(entry.key, entry.calls.peek())
        except Exception:  # the trap must never break the call it guards
            log.debug("failslow: pause trap failed", exc_info=True)

    def _safely(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` (the last argument the call's writer token); a failure drops the
        record and settles past the call."""
        try:
            fn(*args)
        except Exception:
            log.debug("failslow: capture failed", exc_info=True)
            writer = self.writer
            if writer is not None:
                writer.count_dropped()
                if args[-1] is not None:
                    writer.end(args[-1])

    def _record(
        self,
        spec: OpSpec,
        args: tuple[Any, ...],
        out: Any,
        t_start: int,
        pg_cls: Any,
        work_cls: Any,
        token: int | None,
    ) -> None:
        writer = self.ensure_ring()
        if writer is None:
            return
        entry = self._entry_for(pg_cls.unbox(args[spec.pg_arg]))
        if self.defer_nccl and "nccl" in entry.backend.lower():
            if token is not None:
                writer.end(token)
            return  # the shim records this call below, with NCCL's own timing
        payload = args[spec.input_arg]
        flags = Flags.COALESCED if spec.coalesced else Flags.NONE
        if spec.async_arg is not None:  # torch leaves out trailing arguments at their
            is_async = args[spec.async_arg] if spec.async_arg < len(args) else True  # default
            if is_async:
                flags |= Flags.ASYNC_OP
        peer = -1
        if spec.peer_arg is not None:
            peer = entry.global_rank(int(args[spec.peer_arg]))
        fields: dict[str, Any] = dict(
            t_start_ns=t_start,
            nbytes=spec.nbytes(payload),
            group_key=entry.key,
            op=int(spec.op),
            dtype=int(payload_dtype(payload)),
            source=int(Source.PYTHON),
            peer=peer,
            call_index=next(entry.calls),
            token=token,
        )
        if entry.name == self._world_name:  # the pause group's recent calls (control/phase.py)
            self.pause_calls.append(
                (fields["call_index"], spec.op * 1_000_003 + fields["nbytes"], t_start)
            )
        if out is None:  # the call raised
            writer.write(t_end_ns=time.monotonic_ns(), flags=int(flags | Flags.FAILED), **fields)
            return
        raw = out[1] if spec.returns_tuple else out
        work = _unbox_work(work_cls, raw)
        if work is None:  # no Work to follow (torch 2.11's synchronous NCCL collectives):
            writer.write(  # the record ends when the call returns
                t_end_ns=time.monotonic_ns(), flags=int(flags | Flags.END_IS_ENQUEUE), **fields
            )
            return
        anysource = spec.name == "recv_any_source_"
        try:
            fut = work.get_future()
        except Exception:  # no future (gloo send/recv and reduce-scatter works)
            if spec.op in _NEVER_POLLED:
                # gloo's reduce-scatter works report is_completed() False forever; the call
                # has finished its exchange when it returns, so the return time is the end.
                writer.write(
                    t_end_ns=time.monotonic_ns(),
                    flags=int(flags | Flags.END_IS_ENQUEUE),
                    **fields,
                )
            else:
                self._watcher.watch(work, fields, flags, entry, anysource)
            return
        fut.add_done_callback(
            _Callback(
                self,
                functools.partial(
                    self._complete, fields, flags, work if anysource else None, entry
                ),
            )
        )

    def _complete(
        self, fields: dict[str, Any], flags: Flags, work: Any, entry: GroupEntry, fut: Any
    ) -> None:
        t_end = time.monotonic_ns()
        try:
            try:
                fut.value()
            except Exception:
                flags |= Flags.FAILED
            self._finish(fields, flags, work, entry, t_end)
        except Exception:  # never raise into a backend thread
            log.debug("failslow: completion record failed", exc_info=True)
            writer = self.writer
            if writer is not None and fields.get("token") is not None:
                writer.end(fields["token"])

    def _finish(
        self, fields: dict[str, Any], flags: Flags, work: Any, entry: GroupEntry, t_end: int
    ) -> None:
        if work is not None and not flags & Flags.FAILED:  # recv from any source
            fields["peer"] = entry.global_rank(int(work._source_rank()))
        writer = self.writer
        if writer is not None and not writer._mm.closed:
            writer.write(t_end_ns=t_end, flags=int(flags), **fields)


def _unbox_work(work_cls: Any, raw: Any) -> Any:
    """The op's Work, or None where the backend returned none (None, or a script object
    holding a null Work: torch 2.11's synchronous NCCL all_reduce on an H200, issue 50)."""
    if raw is None:
        return None
    try:
        return work_cls.unbox(raw)
    except RuntimeError:  # a script object holding no Work
        return None


def _native_spec(spec: OpSpec) -> dict[str, Any]:
    """One op's row of hook.cpp's table (it sums a payload's bytes by the argument's type:
    a tensor, a list or a list of lists, as the spec's ``nbytes`` does)."""
    return {
        "name": spec.name,
        "op": int(spec.op),
        "input_arg": spec.input_arg,
        "payload": spec.op != OpCode.BARRIER,
        "pg_arg": spec.pg_arg,
        "peer_arg": -1 if spec.peer_arg is None else spec.peer_arg,
        "async_arg": -1 if spec.async_arg is None else spec.async_arg,
        "coalesced": spec.coalesced,
        "at_return": spec.op in _NEVER_POLLED,
        "any_source": spec.name == "recv_any_source_",
    }


class _Callback:
    """A completion callback on a work's future, counted from creation until torch drops it.

    torch releases the callback on the backend's worker thread, which takes the GIL to do it;
    a worker that does so after interpreter finalization began is killed mid C++ frame and the
    process aborts ("terminate called without an active exception"). :meth:`Capture.quiesce`
    waits at exit until every callback is gone (``Capture.inflight`` back to 0)."""

    __slots__ = ("_capture", "_fn")

    def __init__(self, capture: Capture, fn: Callable[[Any], None]) -> None:
        self._capture = capture
        self._fn = fn
        with capture._inflight_lock:
            capture.inflight += 1

    def __call__(self, fut: Any) -> None:
        self._fn(fut)

    def __del__(self) -> None:
        capture = self._capture
        with capture._inflight_lock:
            capture.inflight -= 1


class _Watcher:
    """Polls works that have no future (gloo send/recv/reduce_scatter) on one daemon thread.

    ``t_end`` is the first poll that saw the work completed (poll period ``POLL_S``, plus the
    wait for the GIL). The thread sleeps on a condition while nothing is pending.
    """

    POLL_S = 0.0002
    GIVE_UP_NS = 600 * 10**9

    def __init__(self, capture: Capture) -> None:
        self._capture = capture
        self._pending: list[tuple[Any, dict[str, Any], Flags, GroupEntry, bool]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(
        self, work: Any, fields: dict[str, Any], flags: Flags, entry: GroupEntry, anysource: bool
    ) -> None:
        with self._cond:
            self._pending.append((work, fields, flags, entry, anysource))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="failslow-work-watcher", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        """Stop the thread and join it (works still pending wait for the next one)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
        with self._cond:  # a later watch starts a new thread (capture turned on again)
            self._thread = None
            self._stopped = False

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                items = list(self._pending)
            done = []
            for item in items:
                work, fields, flags, entry, anysource = item
                try:
                    if not work.is_completed():
                        if time.monotonic_ns() - fields["t_start_ns"] < self.GIVE_UP_NS:
                            continue
                        flags |= Flags.END_IS_ENQUEUE  # never saw it complete: give up
                        self._capture._finish(fields, flags, None, entry, fields["t_start_ns"])
                        done.append(item)
                        continue
                    t_end = time.monotonic_ns()
                    if work.exception() is not None:
                        flags |= Flags.FAILED
                    self._capture._finish(fields, flags, work if anysource else None, entry, t_end)
                except Exception:
                    log.debug("failslow: watched work failed", exc_info=True)
                done.append(item)
            with self._cond:
                for item in done:
                    self._pending.remove(item)
            time.sleep(self.POLL_S)


# -- module-level API ------------------------------------------------------------------------
_lock = threading.Lock()
_capture: Capture | None = None


def _resolve_rank(global_rank: int | None) -> int | None:
    if global_rank is not None:
        return int(global_rank)
    if os.environ.get("RANK", "").strip():
        return int(os.environ["RANK"])
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return None


def install(
    ring_dir: str | os.PathLike[str] | None = None,
    *,
    capacity: int | None = None,
    global_rank: int | None = None,
) -> Capture:
    """Start recording every torch.distributed call of this process into its event ring.

    ``ring_dir`` defaults to ``$FAILSLOW_RING_DIR``, then to the directory of an earlier
    install; ``capacity`` (records, a power of two) to ``$FAILSLOW_RING_CAPACITY``, then
    :data:`DEFAULT_CAPACITY`. The global rank comes from ``global_rank``,
    ``$RANK`` or the initialized default group; when none is known yet the ring is created as
    soon as ``init_process_group`` runs. Call it before ``init_process_group`` to capture from
    the first collective; called later, it captures every group from its next call on.
    Idempotent: a second call returns the same :class:`Capture` (re-activating it after
    :func:`uninstall`).
    """
    global _capture
    if ring_dir is None:
        ring_dir = os.environ.get(envvars.RING_DIR) or (_capture.ring_dir if _capture else None)
        if ring_dir is None:
            raise ValueError(
                "failslow.nccl_hook.install: no ring directory; "
                f"pass ring_dir or set ${envvars.RING_DIR}"
            )
    directory = Path(ring_dir).resolve()
    if capacity is None:
        text = os.environ.get(envvars.RING_CAPACITY, "").strip()
        capacity = int(text) if text else DEFAULT_CAPACITY
    with _lock:
        if _capture is not None and _capture.ring_dir != directory:
            if _capture.active:
                raise ValueError(
                    f"failslow.nccl_hook is already installed with ring dir {_capture.ring_dir}; "
                    f"uninstall() before installing with {directory}"
                )
            _capture.close()
            _capture = None
        if _capture is None:
            _capture = Capture(directory, capacity=capacity, global_rank=_resolve_rank(global_rank))
        _capture.activate()
        return _capture


def uninstall() -> None:
    """Stop recording (works already in flight still complete into the ring)."""
    with _lock:
        if _capture is not None:
            _capture.deactivate()


def installed() -> Capture | None:
    """The capture of this process, active or not (None before :func:`install`)."""
    return _capture


def current() -> Capture | None:
    """The installed capture, if any."""
    return _capture if _capture is not None and _capture.active else None
