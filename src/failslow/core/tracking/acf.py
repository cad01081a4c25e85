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
"""

from __future__ import annotations

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
    recurring = counts >= 3  # one-off start-up calls set no scale
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
        found = _dominant(y, t, b, *options)
        return found if found is not None and found.anchor is not None else None
    light = bookkeeping_mask(y, b)
    keep = ~light
    found = _dominant(y[keep], None if t is None else t[keep], b[keep], *options)
    if found is not None and light.any():
        per_step = _once_per_step(y, light, found)
        if per_step.size:  # light calls of every step belong to it (and can anchor it)
            keep |= np.isin(y, per_step)
            wider = _dominant(y[keep], None if t is None else t[keep], b[keep], *options)
            if wider is not None and wider.anchor is not None:
                found = wider
    return found if found is not None and found.anchor is not None else None


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
    if b is not None:  # an infrequent call moving much of the data closes the iteration
        volume = np.zeros(values.size)
        np.add.at(volume, inverse, b)
        excluded = ~np.isin(values, kept) & (counts >= 3)
        closing = excluded & (volume >= CLOSING_SHARE * volume[np.isin(values, kept)].sum())
        if closing.any():
            wider = values[counts >= 0.5 * counts[closing].min()]
            coarse = _period_and_anchor(y, t, wider, threshold, lag_cap)
            if coarse is not None and coarse[1] is not None:
                kept, found = wider, coarse
    period, anchor = found
    per_period = np.count_nonzero(np.isin(y, kept)) / period
    return Pattern(period, kept, anchor, n / max(per_period, 1.0))


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
    """The token occurring once per period whose spacing is most regular."""
    values, counts = np.unique(yf, return_counts=True)
    per = yf.size / period
    best: tuple[float, float, int] | None = None
    for value in values[(counts >= 0.8 * per) & (counts <= 1.2 * per)]:
        pos = np.flatnonzero(yf == value)
        if pos.size < 2:
            continue
        gaps = np.diff(pos)
        exact = float(np.mean(gaps == period))
        spread = 0.0
        if times is not None:
            dt = np.diff(times[pos]).astype(np.float64)
            med = float(np.median(dt))
            spread = float(np.median(np.abs(dt - med)) / med) if med > 0 else np.inf
        key = (-round(exact, 2), round(spread, 3), int(value))
        if best is None or key < best:
            best = key
    return None if best is None or best[0] > -0.5 else best[2]


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
