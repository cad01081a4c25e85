"""Recurring-period detection over a call sequence with an auto-correlation function.

Implements the iteration-time analysis of greyhound section 4.2: every collective call becomes
one categorical token, and the recurring period is the first lag ``k`` whose ACF reaches the
threshold ``M`` (0.95 in the paper): ``Period = argmin_k (ACF_k >= M)``.

Why a one-hot ACF. The paper's formula needs numbers, but a call's type is categorical: any
integer coding (``AllReduce=1, AllGather=2``) would invent an order and a distance. Encoding each
token as its one-hot vector ``X_t`` and using the paper's formula with the dot product,

    ACF_k = [1/(L-k) * sum_t (X_t - mu).(X_{t+k} - mu)] / [1/L * sum_t |X_t - mu|^2],

gives ``(X_t - mu).(X_{t+k} - mu) = [x_t == x_{t+k}] - mu[x_t] - mu[x_{t+k}] + |mu|^2``: exact
matches score, and matches of frequent tokens (which agree by chance) score less. A sequence that
repeats exactly every ``k`` calls scores 1; shorter "sub-periods" of a repeated token score near
or below 0. The ``1/(L-k)`` normalisation (instead of the paper's implicit ``1/L``) removes the
bias that would otherwise make a perfect period at lag ``k`` score ``(L-k)/L`` and fail ``M`` for
long periods in short windows.

Robustness (start-up calls, a logging all-reduce every N steps, eval bursts every 100 steps).
Such calls break the exact match at the true period. :func:`dominant_pattern` therefore works in
two stages: a coarse period ``P0`` (first lag with ACF >= ``coarse_threshold``, 0.75), then only
the tokens that occur at least ``min_share`` (0.5) times per ``P0`` are kept - the dominant,
once-or-more-per-iteration pattern - and the period is the first lag with ACF >= ``M`` on that
filtered sequence. The *anchor* is the kept token that occurs exactly once per period with the
most regular spacing; iteration times are measured between its consecutive occurrences.

Bookkeeping calls. When payload sizes are known (``nbytes``), calls that are both infrequent
(less than half as often as the typical recurring heavy call) and light (under 1/64 of the largest
recurring payload) are left out before any ACF: a loss all-reduce every 10 steps, a
barrier, a metric reduction. They carry no training data, and with a short pattern (DDP with two
gradient buckets has two calls per step) a single extra call every few steps would otherwise
pull the ACF at the true lag below the coarse threshold. Infrequent *heavy* calls stay: the
data-parallel gradient all-reduce that closes a pipeline-parallel iteration of many
micro-batches is exactly such a call, and it must remain part of the iteration. When the
frequent calls alone form a clean shorter period (the micro-batch), a recurring call left out of
it that moves at least ``CLOSING_SHARE`` (10%) of the pattern's bytes widens the pattern to the
period that includes it. An eval-only call every 100 steps moves a far smaller share and does not.
A light call that occurs exactly once per period (a loss or grad-norm all-reduce of every step)
is not bookkeeping: it is re-admitted, counted in the period, and may anchor it - in a step of
identical layers (FSDP) it is the only call that occurs once per step (tracking v2).

What a hold-out of call logs found missing (issue 47; ``benchmarks/call_log_accuracy.py``):

Anchor sequences. FSDP over identical layers with no loss all-reduce makes no call once per
step: every all-gather and reduce-scatter has the same key. The period is still found (the
step repeats exactly); a call left out of the pattern that recurs once per period joins it
first (a root module's all-gather), else the anchor is the shortest sequence of 2-4 kept calls
that occurs once per period (the step's last reduce-scatter, then its first all-gathers):
``Pattern.context`` holds the calls before the anchor, and the tracker counts an anchor only
after them.

Reordered calls. ZeRO-3's prefetcher issues a module's all-gather before or after its
neighbour's reduce-scatter from one step to the next; when most steps differ somewhere, no
lag's ACF reaches the threshold. Then the period comes from a call that recurs once per step:
its gaps, in calls, are one period give or take the calls that swapped around it, the calls
between two of its occurrences are the same in most steps (whatever their order), and its
occurrences tile the sequence (a per-layer call recurs regularly too, but covers a fraction).

Start-up calls that repeat. A warm-up loop of identical all-reduces, or an evaluation before
the first step, repeats as regularly as a step does; with a pipeline's micro-batches it can
make the micro-batch (receive, send) look like the period. A step closed by small gradient
buckets moves little of the data, so a left-out call that recurs every so many periods like
clockwork closes the iteration as well as a heavy one; a pattern that keeps under 85% of the
calls is checked for a longer one that keeps more; and where start-up calls hold the ACF under
the threshold, it is taken again from the first call only steps make.

The step boundary. Among equally regular anchors the one followed by the longest pause in the
calls is taken (the optimizer and the next forward's data come between two steps): an
iteration measured from a call in the middle of the step mixes two steps' times, so one slow
step shows as two half-slow iterations - twice as many slow iterations in a window as there
were (DDP's first bucket, issued mid-backward, against its last). The tracker moves to a more
regular anchor at a re-check (an anchor picked before the first evaluation may be a call the
evaluation makes too), and keeps a pattern that still holds when a window's evaluation
batches suggest a shorter one.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

DEFAULT_THRESHOLD = 0.95
COARSE_THRESHOLD = 0.75


def _as_tokens(tokens: np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D integer array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def acf(tokens: np.ndarray, max_lag: int) -> np.ndarray:
    """One-hot ACF of a token sequence at lags 1..max_lag (see the module docstring)."""
    return np.fromiter(_acf_iter(_as_tokens(tokens), int(max_lag)), dtype=np.float64)


def _acf_iter(y: np.ndarray, max_lag: int):  # type: ignore[no-untyped-def]
    """Yield ACF_1, ACF_2, ... ACF_max_lag lazily (so callers can stop at the first hit)."""
    n = y.size
    _, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    mu = counts / n
    mu2 = float(np.dot(mu, mu))
    var = 1.0 - mu2
    m = mu[inverse]
    cs = np.concatenate(([0.0], np.cumsum(m)))
    for k in range(1, min(max_lag, n - 1) + 1):
        if var <= 1e-12:  # a single repeated token: trivially periodic at every lag
            yield 1.0
            continue
        pairs = n - k
        matches = np.count_nonzero(inverse[:-k] == inverse[k:])
        num = matches - cs[pairs] - (cs[n] - cs[k]) + pairs * mu2
        yield (num / pairs) / var


def _first_lag(y: np.ndarray, threshold: float, max_lag: int) -> int | None:
    for k, value in enumerate(_acf_iter(y, max_lag), start=1):
        if value >= threshold:
            return k
    return None


@dataclass(frozen=True, slots=True)
class Pattern:
    """The dominant recurring pattern of a call sequence."""

    period: int  # calls per period in the dominant (filtered) pattern
    kept: np.ndarray  # token values that belong to the dominant pattern
    anchor: int | None  # token that occurs once per period, most regularly (None: none does)
    calls_per_period: float  # raw calls (incl. occasional extras) per period, on average
    context: tuple[int, ...] = ()
    """The kept tokens right before the anchor, when the anchor token alone recurs within the
    period: the anchor is then the sequence ``(*context, anchor)`` (see "Anchor sequences")."""


def _check_threshold(threshold: float) -> None:
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"ACF threshold must be in (0, 1], got {threshold!r}")


LIGHT_FRACTION = 1 / 64
CLOSING_SHARE = 0.1


def bookkeeping_mask(tokens: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """True for calls that are infrequent and light (see "Bookkeeping calls" above)."""
    y = _as_tokens(tokens)
    b = np.asarray(nbytes, dtype=np.float64)
    if b.shape != y.shape:
        raise ValueError(f"nbytes must have the shape of tokens {y.shape}, got {b.shape}")
    if y.size == 0:
        return np.zeros(0, dtype=bool)
    values, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    size = np.zeros(values.size)
    np.maximum.at(size, inverse, b)
    # One-off start-up calls set no scale: a few broadcasts of the whole model before the
    # first step would otherwise make every bucket of the step look light.
    recurring = counts >= max(3.0, counts.max() / 64)
    if not recurring.any():
        return np.zeros(y.size, dtype=bool)
    heavy = size >= size[recurring].max() * LIGHT_FRACTION
    heavy_counts = counts[recurring & heavy]
    # The rate of the least frequent heavy call that belongs to every step (the once-per-step
    # gradient sync), ignoring heavy calls rarer than a tenth of the busiest (an eval's).
    rate = float(heavy_counts[heavy_counts >= 0.1 * heavy_counts.max()].min())
    light_rare = ~heavy & (counts < 0.5 * rate)
    return light_rare[inverse]


def dominant_pattern(
    tokens: np.ndarray,
    times_ns: np.ndarray | None = None,
    *,
    nbytes: np.ndarray | None = None,
    max_lag: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    coarse_threshold: float = COARSE_THRESHOLD,
    min_share: float = 0.5,
) -> Pattern | None:
    """Find the period, the dominant tokens and the anchor token of a call sequence."""
    _check_threshold(threshold)
    y = _as_tokens(tokens)
    t = None if times_ns is None else np.asarray(times_ns)
    b = None if nbytes is None else np.asarray(nbytes, dtype=np.float64)
    options = (max_lag, threshold, coarse_threshold, min_share)
    if b is None or not y.size:
        keep = np.ones(y.size, dtype=bool)
        found = _dominant(y, t, b, *options)
    else:
        keep = ~bookkeeping_mask(y, b)
        found = _dominant(y[keep], None if t is None else t[keep], b[keep], *options)
    light = ~keep
    if found is not None and light.any() and b is not None:
        per_step = _once_per_step(y, light, found)
        if per_step.size:  # light calls of every step belong to it (and can anchor it)
            keep |= np.isin(y, per_step)
            wider = _dominant(y[keep], None if t is None else t[keep], b[keep], *options)
            if wider is not None and wider.anchor is not None:
                found = wider
    yk, tk = y[keep], None if t is None else t[keep]
    lag_cap = max(1, yk.size // 3) if max_lag is None else max(1, int(max_lag))
    if found is not None and found.anchor is None:
        found = _anchored(yk, tk, found, threshold, lag_cap)
    if found is None:
        found = _by_gaps(yk, tk)
    if found is None or found.anchor is None:
        return None
    return _complete(y, found) if not found.context else found


def _complete(y: np.ndarray, found: Pattern) -> Pattern:
    """The pattern with every call that every step makes: a left-out token that occurs ``c``
    times between consecutive anchors on average (within 0.05), and ``c`` give or take one in
    95% of the steps (ZeRO-3's embedding all-gathers, twice per step among dozens of per-layer
    calls), joins it, so that the period is the calls of a whole step."""
    pos = np.flatnonzero(y == found.anchor)
    if pos.size < 4:
        return found
    inner = y[pos[0] : pos[-1]]
    step = np.searchsorted(pos, np.arange(pos[0], pos[-1]), side="right") - 1
    values, inverse = np.unique(inner, return_inverse=True)
    per = np.zeros((pos.size - 1, values.size), dtype=np.int64)
    np.add.at(per, (step, inverse.ravel()), 1)
    add = []
    for j in np.flatnonzero(~np.isin(values, found.kept)):
        mean = float(per[:, j].mean())  # a call swapped across the anchor moves to the next
        c = round(mean)  # step: the counts 2 and 0 keep the mean
        if c >= 1 and abs(mean - c) <= 0.05 and np.mean(np.abs(per[:, j] - c) <= 1) >= 0.95:
            add.append((int(values[j]), c))
    if not add:
        return found
    kept = np.union1d(found.kept, [v for v, _ in add])
    period = found.period + sum(c for _, c in add)
    return dataclasses.replace(found, period=period, kept=kept)


def _anchored(
    y: np.ndarray, t: np.ndarray | None, found: Pattern, threshold: float, lag_cap: int
) -> Pattern:
    """An anchor for a period that has none among its kept tokens (see "Anchor sequences"):
    a left-out call that recurs once per period joins the pattern; else a short sequence of
    kept calls that occurs once per period anchors it."""
    outside = ~np.isin(y, found.kept)
    extra = _once_per_step(y, outside, found)
    if extra.size:
        kept = np.union1d(found.kept, extra)
        wider = _period_and_anchor(y, t, kept, threshold, lag_cap)
        if wider is not None and wider[1] is not None:
            per_period = np.count_nonzero(np.isin(y, kept)) / wider[0]
            return Pattern(wider[0], kept, wider[1], y.size / max(per_period, 1.0))
    mask = np.isin(y, found.kept)
    yf, tf = y[mask], None if t is None else t[mask]
    for k in range(2, MAX_CONTEXT + 2):
        if yf.size < 3 * k:
            break
        grams = np.lib.stride_tricks.sliding_window_view(yf, k)
        _, coded = np.unique(grams, axis=0, return_inverse=True)
        coded = coded.ravel()
        pick = _pick_anchor(coded, found.period, None if tf is None else tf[k - 1 :])
        if pick is not None:
            at = int(np.flatnonzero(coded == pick)[0])
            gram = grams[at].tolist()
            return dataclasses.replace(found, anchor=int(gram[-1]), context=tuple(gram[:-1]))
    return found


MAX_CONTEXT = 3
"""Kept calls before the anchor that an anchor sequence may use (sequences of 2-4 calls)."""


def _by_gaps(y: np.ndarray, t: np.ndarray | None) -> Pattern | None:
    """The period and anchor from a call that recurs once per step, where no lag's ACF does
    (see "Reordered calls"): its gaps, counted in calls, are one period give or take the
    calls that swapped around it, and what lies between two of its occurrences holds the same
    calls in most steps, whatever their order."""
    if y.size < 12:
        return None
    values, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    # Every token's occurrences at once (grouped by token, in order), and a first sieve: the
    # share of its gaps that are about as long as the next one (few for calls at random
    # times, most for a call of every step).
    order = np.argsort(inverse, kind="stable")
    ends = np.cumsum(counts)
    starts = ends - counts
    gaps_all = np.diff(order)
    owner = inverse[order[1:]]
    inside = inverse[order[:-1]] == owner  # not across two tokens' groups
    pair = inside[:-1] & inside[1:]  # gaps k and k + 1 of one token
    alike = pair & (np.abs(np.diff(gaps_all)) <= np.maximum(2, gaps_all[:-1] // 20))
    share = np.bincount(owner[:-1][alike], minlength=values.size) / np.maximum(counts - 2, 1)
    best: tuple[int, float, int, np.ndarray] | None = None
    for v in np.flatnonzero((counts >= 4) & (share >= 0.5)):
        pos = order[starts[v] : ends[v]]
        gaps = np.diff(pos)
        g = int(np.median(gaps))
        if g < 2 or counts[v] * g < 0.9 * y.size:  # its steps must tile the calls
            continue
        if np.mean(np.abs(gaps - g) <= max(2, g // 20)) < 0.8:
            continue
        bags = np.stack(
            [np.bincount(inverse[a:b], minlength=values.size) for a, b in itertools.pairwise(pos)]
        )
        rows, seen = np.unique(bags, axis=0, return_counts=True)
        usual = rows[int(np.argmax(seen))]
        slack = 2 if g >= 10 else 0  # a call swapped across the anchor (in a long step)
        same = np.abs(bags - usual).sum(axis=1) <= slack
        in_bag = usual > 0
        if np.mean(same) < 0.8:
            continue
        spread = 0.0
        if t is not None:
            dt = np.diff(t[pos]).astype(np.float64)
            med = float(np.median(dt))
            spread = float(np.median(np.abs(dt - med)) / med) if med > 0 else np.inf
        key = (int(usual.sum()), spread, int(values[v]), values[in_bag])
        if best is None or key[:3] < best[:3]:
            best = key
    if best is None:
        return None
    period, _, anchor, kept = best
    per_period = np.count_nonzero(np.isin(y, kept)) / period
    return Pattern(period, kept, anchor, y.size / max(per_period, 1.0))


def _once_per_step(y: np.ndarray, light: np.ndarray, found: Pattern) -> np.ndarray:
    """Light tokens (``light`` marks their calls) that occur once per period of ``found``.

    A loss or gradient-norm all-reduce of a few bytes in every step is light and rarer than
    any heavy call, so :func:`bookkeeping_mask` leaves it out; but it is part of every
    iteration, and in a step of identical layers (FSDP: an all-gather per layer in forward,
    an all-gather and a reduce-scatter per layer in backward) it is the only call that occurs
    once per step. Counted in calls of the dominant pattern, consecutive occurrences of such
    a token lie exactly one period apart (at least 80% of them).
    """
    dominant = np.isin(y, found.kept) & ~light
    iterations = np.count_nonzero(dominant) / found.period
    calls = np.cumsum(dominant)
    out = []
    for value in np.unique(y[light]):
        pos = np.flatnonzero(y == value)
        if pos.size < 3 or not 0.8 * iterations <= pos.size <= 1.2 * iterations:
            continue
        if np.mean(np.diff(calls[pos]) == found.period) >= 0.8:
            out.append(value)
    return np.asarray(out, dtype=y.dtype)


def _dominant(
    y: np.ndarray,
    t: np.ndarray | None,
    b: np.ndarray | None,
    max_lag: int | None,
    threshold: float,
    coarse_threshold: float,
    min_share: float,
) -> Pattern | None:
    """The dominant pattern of ``y``; its ``anchor`` is None when no token occurs once per
    period (the caller may still find one among the calls it left out)."""
    n = y.size
    if n < 4:
        return None
    lag_cap = max(1, n // 3) if max_lag is None else max(1, int(max_lag))
    p0 = _first_lag(y, coarse_threshold, lag_cap)
    if p0 is None:
        p0 = _first_lag(y, threshold, lag_cap)
        if p0 is None:
            return None
    values, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    kept = values[counts >= min_share * n / p0]
    found = _period_and_anchor(y, t, kept, threshold, lag_cap)
    if found is None:
        return None
    if b is not None:  # an infrequent call moving much of the data closes the iteration ...
        volume = np.zeros(values.size)
        np.add.at(volume, inverse, b)
        excluded = ~np.isin(values, kept) & (counts >= 3)
        closing = excluded & (volume >= CLOSING_SHARE * volume[np.isin(values, kept)].sum())
        closers = np.flatnonzero(closing)
        rate = counts[closers].min() if closers.size else 0
        if not rate:  # or one that recurs every so many periods, like clockwork
            in_kept = np.cumsum(np.isin(y, kept))
            regular = [
                v for v in np.flatnonzero(excluded) if _every(in_kept[inverse == v], found[0])
            ]
            rate = max((counts[v] for v in regular), default=0)
            closers = np.asarray([v for v in regular if counts[v] == rate], dtype=np.int64)
        if rate:
            wider = values[counts >= 0.5 * rate]
            coarse = _settled(y, t, wider, values[closers], threshold, lag_cap)
            if coarse is not None and coarse[1] is not None:
                kept, found = wider, coarse
    covered = np.count_nonzero(np.isin(y, kept)) / n
    if covered < MIN_COVERED:  # a sub-pattern (see "Start-up calls that repeat")
        wider = values[counts >= 0.5 * min_share * n / p0]
        rarest = wider[np.argmin(counts[np.isin(values, wider)])]
        coarse = _settled(y, t, wider, np.array([rarest]), threshold, lag_cap)
        if coarse is not None and coarse[0] > found[0]:
            kept, found = wider, coarse
    period, anchor = found
    per_period = np.count_nonzero(np.isin(y, kept)) / period
    return Pattern(period, kept, anchor, n / max(per_period, 1.0))


MIN_COVERED = 0.85
"""A pattern whose kept calls are fewer than this share of all calls is checked for a longer
one that keeps more (see "Start-up calls that repeat")."""


def _settled(
    y: np.ndarray,
    t: np.ndarray | None,
    kept: np.ndarray,
    first: np.ndarray,
    threshold: float,
    lag_cap: int,
) -> tuple[int, int | None] | None:
    """Period and anchor (None: no single call) of the ``kept`` calls; where start-up calls
    before the first step hold the ACF under the threshold (they may repeat too), of those
    from the first call of ``first`` (a call that only steps make) on."""
    found = _period_and_anchor(y, t, kept, threshold, lag_cap)
    if found is None or found[1] is None:
        start = int(np.flatnonzero(np.isin(y, first))[0])
        tail = None if t is None else t[start:]
        found = _period_and_anchor(y[start:], tail, kept, threshold, lag_cap) or found
    return found


def _every(at: np.ndarray, period: int) -> bool:
    """Whether a call seen after these counts of kept calls recurs every so many periods: a
    pipeline's gradient reduce-scatter after each step's micro-batches, whatever its size."""
    gaps = np.diff(at)
    if gaps.size < 2:
        return False
    values, seen = np.unique(gaps, return_counts=True)
    g = int(values[np.argmax(seen)])
    return g > period and g % period == 0 and seen.max() >= 0.8 * gaps.size


def _period_and_anchor(
    y: np.ndarray, times: np.ndarray | None, kept: np.ndarray, threshold: float, lag_cap: int
) -> tuple[int, int | None] | None:
    mask = np.isin(y, kept)
    yf = y[mask]
    period = _first_lag(yf, threshold, max(1, min(lag_cap, yf.size // 3)))
    if period is None:
        return None
    return period, _pick_anchor(yf, period, None if times is None else times[mask])


def _pick_anchor(yf: np.ndarray, period: int, times: np.ndarray | None) -> int | None:
    """The token occurring once per period whose spacing is most regular; among equally
    regular ones, the one followed by the longest pause in the calls (see "The step
    boundary"), then the one whose times are the most regular."""
    values, counts = np.unique(yf, return_counts=True)
    per = yf.size / period
    best: tuple[float, float, float, int] | None = None
    for value in values[(counts >= 0.8 * per) & (counts <= 1.2 * per)]:
        pos = np.flatnonzero(yf == value)
        if pos.size < 2:
            continue
        gaps = np.diff(pos)
        exact = float(np.mean(gaps == period))
        spread, pause = 0.0, 0.0
        if times is not None:
            dt = np.diff(times[pos]).astype(np.float64)
            med = float(np.median(dt))
            spread = float(np.median(np.abs(dt - med)) / med) if med > 0 else np.inf
            nxt = pos[pos + 1 < times.size]
            if med > 0 and nxt.size:
                pause = float(np.median(times[nxt + 1] - times[nxt])) / med
        key = (-round(exact, 2), -round(pause, 2), round(spread, 3), int(value))
        if best is None or key < best:
            best = key
    return None if best is None or best[0] > -0.5 else best[3]


def find_period(
    tokens: np.ndarray,
    *,
    max_lag: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> int | None:
    """Calls per iteration of the dominant pattern: the first lag with ACF >= ``threshold``.

    ``tokens`` holds one integer per call in call order. Start-up calls and calls that occur
    less than about every other iteration are left out of the pattern (module docstring), so
    the answer is the number of calls of one regular iteration. ``None`` when no lag up to
    ``max_lag`` (default: a third of the sequence) reaches the threshold.
    """
    pattern = dominant_pattern(tokens, max_lag=max_lag, threshold=threshold)
    return None if pattern is None else pattern.period
