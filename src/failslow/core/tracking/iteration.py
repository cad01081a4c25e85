"""Iteration times from one rank's collective-call records (greyhound section 4.2).

"Once the recurring period is identified, the iteration time derives as the time difference
between a communication operation and its occurrence in the previous period." Each record of
:data:`failslow.core.events.RECORD_DTYPE` becomes a token from ``(op, group_key, nbytes)``; the
ACF of :mod:`.acf` finds the period and an *anchor* token that occurs exactly once per period;
an iteration time is the gap between consecutive ``t_start_ns`` of the anchor. Occasional extra
calls (logging every N steps, eval bursts) therefore never shift the count, and an iteration
that contains an eval burst simply measures longer, as it really was.

The anchor's place in the step moves (DDP's first bucket all-reduce is issued mid-backward), so
where the Python hook marked the end of each optimizer step (:mod:`failslow.nccl_hook.
step_marker`, records of :data:`~failslow.core.events.MARKER_OPS`), the iteration is the gap
between consecutive markers instead: the step as frameworks time it, and found without any
period (a stack of identical layers has no call that occurs once per step). The ACF still runs
on the calls (the period, and a new epoch when the pattern changes); ``period_calls`` is the
ACF period, or before one is found the calls between markers.

:class:`IterationTracker` is the online form, used by the node's LocalAnalyzer: it keeps a
bounded window of tokens, detects the pattern once enough calls have arrived, re-checks it every
``recheck`` calls, and re-detects it from scratch when the anchor stops occurring (for example
after a topology change, which changes every group key). Its decisions happen at fixed token
counts, so feeding records in any chunking gives the same result; :func:`iteration_times` is the
offline form and is exactly the tracker fed everything at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from failslow.core.events import is_marker
from failslow.core.tracking.acf import DEFAULT_THRESHOLD, Pattern, dominant_pattern

_KEY_FIELDS = ("op", "group_key", "nbytes")


def _check_records(records: np.ndarray) -> np.ndarray:
    arr = np.asarray(records)
    names = arr.dtype.names or ()
    missing = [f for f in ("t_start_ns", *_KEY_FIELDS) if f not in names]
    if arr.ndim != 1 or missing:
        raise ValueError(
            f"records must be a 1-D array of RECORD_DTYPE, got dtype {arr.dtype} "
            f"with shape {arr.shape} (missing fields: {missing or 'none'})"
        )
    return arr


class TokenCoder:
    """Maps ``(op, group_key, nbytes)`` of each record to a small stable integer."""

    SMALL = 64
    """Batches up to this size are coded record by record (``np.unique`` costs more)."""

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        self._ids: dict[tuple[int, int, int], int] = {}
        self._max = max_tokens

    def encode(self, records: np.ndarray) -> np.ndarray:
        if records.size == 0:
            return np.empty(0, dtype=np.int64)
        if records.size <= self.SMALL:
            return self._encode_few(records)
        keys = np.empty(records.size, dtype=[("op", "<u8"), ("g", "<u8"), ("b", "<u8")])
        keys["op"], keys["g"], keys["b"] = records["op"], records["group_key"], records["nbytes"]
        uniq, inverse = np.unique(keys, return_inverse=True)
        if len(self._ids) + uniq.size > self._max:  # e.g. variable-size calls: forget old ones
            self._ids.clear()
        ids = np.empty(uniq.size, dtype=np.int64)
        for i, key in enumerate(uniq.tolist()):
            ids[i] = self._ids.setdefault(key, len(self._ids))
        return ids[inverse.ravel()]

    def _encode_few(self, records: np.ndarray) -> np.ndarray:
        """A poll's few records: a dict lookup each, with the ids :meth:`encode` gives."""
        keys = list(
            zip(
                records["op"].tolist(),
                records["group_key"].tolist(),
                records["nbytes"].tolist(),
                strict=True,
            )
        )
        ids, uniq = self._ids, set(keys)
        if len(ids) + len(uniq) > self._max:  # the same rule as for a big batch
            ids.clear()
        if not ids.keys() >= uniq:
            for key in sorted(k for k in uniq if k not in ids):  # new ids in key order, as
                ids[key] = len(ids)  # np.unique numbers them
        return np.fromiter(map(ids.__getitem__, keys), dtype=np.int64, count=len(keys))


_NO_ENDS = np.empty(0, dtype=np.int64)
_NO_SECS = np.empty(0, dtype=np.float64)
_NO_ENDS.flags.writeable = _NO_SECS.flags.writeable = False


def _none() -> tuple[np.ndarray, np.ndarray]:
    """No iteration completed (shared read-only empties: most polls complete none)."""
    return _NO_ENDS, _NO_SECS


@dataclass(frozen=True, slots=True)
class IterationTimes:
    """Per-iteration times of one rank (offline result)."""

    period_calls: int | None  # calls per iteration of the dominant pattern (last one seen)
    end_ns: np.ndarray  # t_start_ns of the anchor call that closes each iteration
    seconds: np.ndarray  # duration of each iteration
    calls: np.ndarray | None = None  # collective calls of each iteration (feed_steps)

    def __len__(self) -> int:
        return int(self.seconds.size)


class IterationTracker:
    """Online iteration-time tracker with bounded memory (``window`` tokens)."""

    def __init__(
        self,
        *,
        window: int = 8192,
        min_tokens: int = 64,
        retry: int = 256,
        recheck: int = 8192,
        max_lag: int = 2048,
        threshold: float = DEFAULT_THRESHOLD,
    ) -> None:
        if min(window, min_tokens, retry, recheck, max_lag) <= 0:
            raise ValueError("window, min_tokens, retry, recheck and max_lag must be positive")
        if min_tokens > window:
            raise ValueError(f"min_tokens ({min_tokens}) must not exceed window ({window})")
        self.window, self.min_tokens, self.retry, self.recheck = window, min_tokens, retry, recheck
        self.max_lag, self.threshold = max_lag, threshold
        self._coder = TokenCoder()
        self._tok = np.empty(2 * window, dtype=np.int64)
        self._t = np.empty(2 * window, dtype=np.int64)
        self._b = np.empty(2 * window, dtype=np.int64)  # payload bytes of each call
        self._len = 0
        self._total = 0  # tokens seen so far; absolute index of the next token
        self._pattern: Pattern | None = None
        self._search_from = 0
        self._next_attempt = min_tokens
        self._next_recheck = 0
        self._recheck_gap = min_tokens  # doubles after each recheck, up to ``recheck``
        self.epoch = 0
        """+1 whenever the times start measuring something else: the pattern found anew or its
        period changed; between step markers, only the pattern lost and found again (a
        topology change), measuring markers at all after anchors, or another marker key."""
        self._last_anchor_idx = -1
        self._last_anchor_t = 0
        self._found = False  # the ACF found a pattern once
        self._marker_key: int | None = None  # the step markers measured (module docstring)
        self._marker_t = 0  # t_start_ns of the last of them
        self._marker_calls = 0  # calls fed up to the last of them
        self._other: tuple[int, int] = (0, 0)  # (key, run) of markers of another key in a row
        self._calls = 0  # calls fed so far
        self._per_step: list[int] = []  # calls between the last few pairs of markers
        self._last_anchor_at = 0  # token index of the anchor at ``_last_anchor_t``
        self._step_calls: list[int] = []  # calls of each iteration the current feed completes
        self._hold: np.ndarray | None = None  # calls not fed to the ACF yet (ACF_EVERY) ...
        self._held_calls = 0  # ... in its first this many entries
        self._deferred_marks = 0  # step markers since they were last fed
        self._tail = _NO_TOKENS  # the last kept tokens fed (an anchor sequence's context)

    @property
    def period_calls(self) -> int | None:
        if self._pattern is not None:
            return self._pattern.period
        if self._per_step:  # no ACF pattern (yet): the calls between step markers
            return sorted(self._per_step)[len(self._per_step) // 2]
        return None

    @property
    def marked(self) -> bool:
        """Whether iterations are measured between step markers (else between anchor calls)."""
        return self._marker_key is not None

    def feed(self, records: np.ndarray) -> np.ndarray:
        """Take new records of this rank; return the iteration times (s) completed by them."""
        return self._feed(records)[1]

    def feed_steps(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Like :meth:`feed`, also returning the ``t_start_ns`` closing each iteration (its step
        marker or anchor call) and how many collective calls each iteration made (between its
        step markers, or from its anchor call to the next, that one included): an eval,
        checkpoint or logging step makes others than the usual step (:mod:`.special`)."""
        ends, secs = self._feed(records)
        calls = np.asarray(self._step_calls, dtype=np.int64)
        if calls.size != secs.size:  # cannot happen: every emitted iteration notes its calls
            raise AssertionError(f"{calls.size} call counts for {secs.size} iterations")
        return ends, secs, calls

    def flush(self) -> np.ndarray:
        """Try a detection on what is buffered now (end of an offline trace)."""
        return self._flush()[1]

    # -- internals ---------------------------------------------------------------------------

    def _flush(self) -> tuple[np.ndarray, np.ndarray]:
        self._feed_deferred()
        if self._pattern is not None or self._total - self._search_from < 4:
            return _none()
        found = self._attempt()
        if self._marker_key is not None:  # the period only: markers measure the iterations
            self._step_calls = []
            return _none()
        return found

    def _feed(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._step_calls = []
        recs = _check_records(records)
        if recs.size == 0:
            return _none()
        starts = recs["t_start_ns"]
        if not (starts[1:] >= starts[:-1]).all():  # the analyzer's come in order already
            recs = recs[np.argsort(starts, kind="stable")]
        marks = is_marker(recs)
        if not marks.any() and self._marker_key is None:
            return self._feed_calls(recs)
        if self._marker_key is None:
            self._adopt(int(recs["group_key"][marks][0]))
        calls = recs[~marks]
        if calls.size:  # copied into one buffer (concatenating record arrays costs more)
            n = self._held_calls
            hold = self._hold
            if hold is None or n + calls.size > hold.size or hold.dtype != calls.dtype:
                grown = np.empty(max(256, 2 * (n + calls.size)), dtype=calls.dtype)
                if n and hold is not None:
                    grown[:n] = hold[:n]
                self._hold = hold = grown
            hold[n : n + calls.size] = calls
            self._held_calls = n + calls.size
        self._deferred_marks += recs.size - calls.size
        if self._deferred_marks >= self.ACF_EVERY:
            self._feed_deferred()
        return self._feed_markers(recs, marks)

    ACF_EVERY = 4
    """Between step markers, the calls reach the ACF every this many markers, in one batch:
    there they only keep the period and notice a new pattern (whose anchor is missed for
    4 periods + 64 calls first anyway), and a feed's cost is mostly per feed, not per call.
    The tracker's decisions happen at fixed token counts, so batching changes none of them,
    only when they are seen."""

    def _feed_deferred(self) -> None:
        """The calls held back between step markers, to the ACF (the period; a new epoch on a
        new pattern). Their anchors' iterations are not the ones measured: none is emitted."""
        n, self._held_calls, self._deferred_marks = self._held_calls, 0, 0
        if n and self._hold is not None:
            self._feed_calls(self._hold[:n])  # (copied into the window by _append)
        self._step_calls = []

    def _feed_markers(self, recs: np.ndarray, marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Iterations between consecutive markers of one key. The first key seen is measured;
        when three markers of one other key come in a row (the optimizer was rebuilt over
        other parameters), that key is measured from then on, in a new epoch."""
        at = marks.nonzero()[0]
        first_calls = self._calls
        self._calls += recs.size - at.size
        ends: list[int] = []
        secs: list[float] = []
        for j, (i, key, t) in enumerate(
            zip(
                at.tolist(),
                recs["group_key"][at].tolist(),
                recs["t_start_ns"][at].tolist(),
                strict=True,
            )
        ):
            if key != self._marker_key:
                run = self._other[1] + 1 if self._other[0] == key else 1
                self._other = (key, run)
                if run < 3:
                    continue
                self._adopt(key)
            self._other = (0, 0)
            calls = first_calls + i - j  # the calls before this marker (i records, j markers)
            if self._marker_t and t > self._marker_t:
                ends.append(t)
                secs.append((t - self._marker_t) / 1e9)
                self._per_step = [*self._per_step[-7:], calls - self._marker_calls]
                self._step_calls.append(calls - self._marker_calls)
            self._marker_t = max(self._marker_t, t)
            self._marker_calls = calls
        if not ends:
            return _none()
        return np.asarray(ends, dtype=np.int64), np.asarray(secs, dtype=np.float64)

    def _adopt(self, key: int) -> None:
        """Measure between the markers of ``key`` from its next marker on."""
        if self._found or self._marker_key is not None:
            self.epoch += 1  # times measured another way from here on
        self._marker_key, self._marker_t, self._per_step = key, 0, []

    def _feed_calls(self, recs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if recs.size == 0:
            return _none()
        times = recs["t_start_ns"].astype(np.int64, copy=False)
        nbytes = recs["nbytes"].astype(np.int64, copy=False)
        tokens = self._coder.encode(recs)
        ends: list[np.ndarray] = []
        secs: list[np.ndarray] = []
        i, m = 0, tokens.size
        while i < m:
            if self._pattern is None:
                boundary = self._next_attempt
            else:
                limit = math.ceil(4 * self._pattern.calls_per_period) + 64
                boundary = min(self._next_recheck, self._last_anchor_idx + limit + 1)
            step = max(1, min(m - i, boundary - self._total))
            e, s = self._process(tokens[i : i + step], times[i : i + step], nbytes[i : i + step])
            ends.append(e)
            secs.append(s)
            i += step
            if self._pattern is None and self._total >= self._next_attempt:
                e, s = self._attempt()
                ends.append(e)
                secs.append(s)
            elif self._pattern is not None:
                if self._total - self._last_anchor_idx - 1 >= limit:  # anchor vanished
                    self._pattern = None
                    self._search_from = self._last_anchor_idx + 1
                    self._next_attempt = max(self._search_from + self.min_tokens, self._total)
                elif self._total >= self._next_recheck:
                    self._recheck()
        if len(ends) == 1:  # one chunk (a poll's few records): no concatenation
            return ends[0], secs[0]
        return np.concatenate(ends), np.concatenate(secs)

    def _append(self, tok: np.ndarray, t: np.ndarray, b: np.ndarray) -> None:
        n = tok.size
        if self._len + n > self._tok.size:
            keep = max(0, self.window - n)
            for buf in (self._tok, self._t, self._b):
                buf[:keep] = buf[self._len - keep : self._len]
            self._len = keep
        self._tok[self._len : self._len + n] = tok
        self._t[self._len : self._len + n] = t
        self._b[self._len : self._len + n] = b
        self._len += n

    def _process(
        self, tok: np.ndarray, t: np.ndarray, b: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        start = self._total
        self._append(tok, t, b)
        self._total += tok.size
        if self._pattern is None:
            return _none()
        pos, self._tail = _anchor_positions(self._pattern, tok, self._tail)
        if pos.size == 0:
            return _none()
        self._last_anchor_idx = start + int(pos[-1])
        if self._marker_key is not None:  # markers measure the iterations; anchors only the
            return _none()  # period (their times unused)
        return self._emit(t[pos], start + pos)

    def _emit(self, anchor_t: np.ndarray, anchor_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Iteration times between consecutive anchor calls.

        Batches are sorted by start time, but a record that arrives in a later batch than
        newer ones (several writer threads) may be older: an anchor that would close an
        iteration of non-positive length is skipped instead of reported.
        """
        keep = np.maximum.accumulate(np.concatenate(([self._last_anchor_t], anchor_t)))
        fresh = np.concatenate(([False], np.diff(keep) > 0))
        at = np.concatenate(([self._last_anchor_t], keep[fresh]))
        index = np.concatenate(([self._last_anchor_at], anchor_at[fresh[1:]]))
        self._last_anchor_t, self._last_anchor_at = int(at[-1]), int(index[-1])
        self._step_calls.extend(np.diff(index).tolist())
        return at[1:], np.diff(at) / 1e9

    def _buffered(self, since: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        first = max(since, self._total - self._len, self._total - self.window)
        lo = self._len - (self._total - first)
        return self._tok[lo : self._len], self._t[lo : self._len], self._b[lo : self._len], first

    def _attempt(self) -> tuple[np.ndarray, np.ndarray]:
        tok, t, b, first = self._buffered(self._search_from)
        pattern = None
        if tok.size >= 4:
            pattern = dominant_pattern(
                tok,
                t,
                nbytes=b,
                max_lag=min(self.max_lag, tok.size // 3),
                threshold=self.threshold,
            )
        if pattern is None:  # back off geometrically up to ``retry`` calls between attempts
            span = self._total - self._search_from
            self._next_attempt = self._total + min(self.retry, max(self.min_tokens, span))
            return _none()
        self._pattern = pattern
        if self._found or self._marker_key is None:  # markers: the first pattern changes none
            self.epoch += 1
        self._found = True
        # A pattern found on little data is confirmed on doubling amounts of it: a call that
        # closes each iteration (a pipeline's gradient all-reduce) may not have recurred yet.
        self._recheck_gap = self.min_tokens
        self._next_recheck = self._total + self._recheck_gap
        pos, self._tail = _anchor_positions(pattern, tok, _NO_TOKENS)
        if pos.size == 0:  # cannot happen: the pattern's anchor was found in these calls
            self._pattern = None
            return _none()
        self._last_anchor_idx = first + int(pos[-1])
        self._last_anchor_t, self._last_anchor_at = int(t[pos[0]]), first + int(pos[0])
        return self._emit(t[pos[1:]], first + pos[1:])

    def _recheck(self) -> None:
        self._recheck_gap = min(self.recheck, 2 * self._recheck_gap)
        self._next_recheck = self._total + self._recheck_gap
        tok, t, b, first = self._buffered(self._search_from)  # never mix in an old pattern
        pattern = dominant_pattern(
            tok, t, nbytes=b, max_lag=min(self.max_lag, tok.size // 3), threshold=self.threshold
        )
        if pattern is None or self._pattern is None:
            return
        old = self._pattern
        if pattern.period < old.period and _regularity(old, tok) >= 0.8:
            return  # still every step: a shorter period is the window's (evaluation batches)
        if pattern.period == old.period and np.isin([old.anchor, *old.context], pattern.kept).all():
            # Same pattern: keep measuring from the same anchor (switching may lose an
            # iteration), unless the new one keeps its period better on what came since: an
            # anchor picked before the job's first evaluation may be a call evaluations make too.
            same = dataclasses.replace(pattern, anchor=old.anchor, context=old.context)
            if _regularity(same, tok) + 0.01 >= _regularity(pattern, tok):
                pattern = same
        elif self._marker_key is None:  # between markers, the times stay what they were
            self.epoch += 1
        pos, tail = _anchor_positions(pattern, tok, _NO_TOKENS)
        if pos.size == 0:  # the old anchor no longer in this window: keep measuring as before
            return
        if (pattern.anchor, pattern.context) != (old.anchor, old.context):
            self._last_anchor_idx = first + int(pos[-1])
            self._last_anchor_t, self._last_anchor_at = int(t[pos[-1]]), first + int(pos[-1])
        self._pattern, self._tail = pattern, tail


_NO_TOKENS = np.empty(0, dtype=np.int64)


def _anchor_positions(
    pattern: Pattern, tok: np.ndarray, tail: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Where in ``tok`` the pattern's anchor occurs, and the kept tokens to carry to the next
    call (``tail``: the last kept tokens before ``tok``). An anchor with a context is a
    sequence of kept calls (:mod:`.acf`, "Anchor sequences"): its last call, where the kept
    calls before it are the context."""
    if not pattern.context:
        return np.flatnonzero(tok == pattern.anchor), tail
    k = len(pattern.context)
    idx = np.flatnonzero(np.isin(tok, pattern.kept))
    seq = np.concatenate((tail, tok[idx]))
    if seq.size <= k:
        return _NO_TOKENS, seq
    gram = np.asarray((*pattern.context, pattern.anchor), dtype=seq.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(seq, k + 1)
    hit = np.flatnonzero((windows == gram).all(axis=1))
    return idx[hit + k - tail.size], seq[-k:]


def _regularity(pattern: Pattern, tok: np.ndarray) -> float:
    """The share of the anchor's consecutive occurrences in ``tok`` exactly one period of kept
    calls apart."""
    pos, _ = _anchor_positions(pattern, tok, _NO_TOKENS)
    if pos.size < 2:
        return 0.0
    kept = np.cumsum(np.isin(tok, pattern.kept))
    return float(np.mean(np.diff(kept[pos]) == pattern.period))


def iteration_times(records: np.ndarray, **tracker_options: int | float) -> IterationTimes:
    """Iteration times of one rank's records (offline; the tracker fed everything at once)."""
    options = dict(tracker_options)
    if "min_tokens" not in options:  # offline, the first attempt may see the whole trace
        window = int(options.get("window", 8192))
        options["min_tokens"] = max(64, min(window, len(records)))
    tracker = IterationTracker(**options)  # type: ignore[arg-type]
    ends, secs, calls = tracker.feed_steps(records)
    more_ends, more_secs = tracker._flush()
    more_calls = np.asarray(tracker._step_calls, dtype=np.int64)
    ends, secs = np.concatenate((ends, more_ends)), np.concatenate((secs, more_secs))
    return IterationTimes(tracker.period_calls, ends, secs, np.concatenate((calls, more_calls)))
