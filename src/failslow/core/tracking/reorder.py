"""Put ring records back into issue order before tracking (greyhound 4.2 works on call order).

A capture layer that records a call when it *completes* (the Python hook over gloo, the shim's
device-completion path) commits records in completion order; asynchronous collectives - DDP's
overlapped bucket all-reduces, FSDP's prefetched all-gathers - finish out of issue order. The
ACF period and the iteration times are defined on the issue order (``t_start_ns``).

:class:`ReorderBuffer` releases a record once no call still in flight can have started before
it. If the newest completion seen is at ``T`` and no call lasts longer than ``D``, every call not
yet committed started after ``T - D``; so records that started before ``T - D`` are final. ``D``
is the longest duration among recent records (times a margin), so the extra latency is about one
collective's duration, never a fixed delay. Records that still arrive late (a call longer than
any seen before) would break the order already handed on: they are dropped and counted in
``late``.

A writer that knows its calls in flight says so exactly: the Python hook keeps the ring
header's ``settled_ns`` (:meth:`failslow.core.ring.RingWriter.begin`), before which every call
has been committed. Records that started before it are released at once - the horizon, a
guess sized by the longest call (a healthy rank's all-reduce that waits for a straggler), is
then only the fallback (the C shim does not keep the word; a call that never completes would
otherwise hold the stream for good).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from failslow.core.events import RECORD_DTYPE


class ReorderBuffer:
    """Sort a stream of record batches by ``t_start_ns`` with a bounded, adaptive horizon."""

    def __init__(self, *, margin: float = 1.5, recent: int = 256) -> None:
        self.margin = margin
        self._durations: deque[int] = deque(maxlen=recent)
        self._longest: int | None = 0  # max(self._durations); None: they changed since
        self._pending = np.empty(0, dtype=RECORD_DTYPE)
        self._released_until = np.iinfo(np.int64).min
        self._newest_end = np.iinfo(np.int64).min
        self.late = 0

    def push(self, records: np.ndarray, *, settled_ns: int | None = None) -> np.ndarray:
        """Add newly committed records; return the records now final, in issue order.
        ``settled_ns``: the writer's word that every call started before it is committed (read
        before these records): those are final at once, whatever the horizon says."""
        if len(records):
            ends, starts = records["t_end_ns"], records["t_start_ns"]
            done = ends > 0
            if done.all():
                self._newest_end = max(self._newest_end, int(ends.max()))
                self._durations.extend((ends - starts).tolist())
                self._longest = None
            elif done.any():
                self._newest_end = max(self._newest_end, int(ends[done].max()))
                self._durations.extend((ends[done] - starts[done]).tolist())
                self._longest = None
            else:  # records without completion times are already in issue order
                self._newest_end = max(self._newest_end, int(starts.max()))
            if len(self._pending):
                self._pending = np.concatenate([self._pending, records])
            else:  # the common case: nothing held back (no structured-dtype concatenation)
                self._pending = records
        if not len(self._pending):
            return self._pending[:0]
        starts = self._pending["t_start_ns"]
        if settled_ns is not None and settled_ns > int(starts.max()):
            if int(starts.min()) >= self._released_until:  # all final, none late: the
                out, self._pending = self._pending, self._pending[:0]  # writer's word (hook)
                return self._release(out)
            cutoff = settled_ns - 1  # the writer vouches for all of them: no horizon needed
        else:
            cutoff = self._newest_end - int(self.longest * self.margin)
            if settled_ns is not None:
                cutoff = max(cutoff, settled_ns - 1)
        ready = starts <= cutoff
        late = starts < self._released_until
        self.late += int(late.sum())
        out = self._pending[ready & ~late]
        self._pending = self._pending[~ready & ~late]
        return self._release(out)

    def _release(self, out: np.ndarray) -> np.ndarray:
        if len(out):
            out = out[np.argsort(out["t_start_ns"], kind="stable")]
            self._released_until = max(self._released_until, int(out["t_start_ns"][-1]))
        return out

    @property
    def longest(self) -> int:
        """The longest duration among the recent records (the horizon's base), computed when
        a horizon is needed, not on every push."""
        if self._longest is None:
            self._longest = max(self._durations, default=0)
        return self._longest

    def flush(self) -> np.ndarray:
        """Everything still held, in issue order (at the end of a run)."""
        out = self._pending[np.argsort(self._pending["t_start_ns"], kind="stable")]
        self._pending = self._pending[:0]
        return out

    @property
    def held(self) -> int:
        return len(self._pending)
