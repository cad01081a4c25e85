"""A harder labeled corpus: the normal life of a training job around its fail-slows.

The first corpus (:mod:`.traces`) scored even a sliding window at 100%: its distractors were
single-iteration spikes and eval steps far apart. Real jobs (greyhound 3, 4.2 R2; byterobust
2) spend their healthy time in a *rhythm* of slow steps, and that rhythm is what false alarms
come from. Every trace here has, none of it labeled:

- **Periodic steps** - one to three rhythms per job, each with its own period and phase:
  logging (every 10-50 iterations, 1 iteration, 1.1-1.5x), evaluation (every 50-250, 1-3
  consecutive iterations, 1.3-4x) and checkpointing (every 100-1000, 1-3 iterations,
  1.5-4x). Each occurrence's size varies by +-15%, they go on during a fail-slow, and two
  rhythms' steps never touch (a 3-iteration eval right after a checkpoint would be a 5-6
  iteration slow step, more than real jobs show).
- **GC / allocator bursts** - besides isolated spikes (0.2-1% of iterations, 1.5-3x), bursts of
  2-6 collections every other iteration (1.3-3x), a few per thousand iterations.
- **Warm-up** - a compile step (the first 1-3 iterations 3-20x) and a decaying slowdown of
  20-100% over the first 20-120 iterations.
- **Drift** - a smooth wander of up to +-12% over the job, at most ~3% per 100 iterations.
- **Sub-10% level shifts** - 3-8%, either sign (a neighbour's job starting, a data shard with
  longer sequences).
- **Heavy-tailed noise** - Gaussian 1-3% (x1.6 for high-variance jobs) plus Student-t (3-4
  degrees of freedom) sequence-length noise of 0.3-1.5%.

**Calls.** Each iteration also has its count of collective calls, as the tracker measures it
between step markers (:meth:`failslow.core.tracking.IterationTracker.feed_steps`): the usual
step's count (3-500), and 1-200 more on a periodic step that makes calls of its own - in half
the jobs for logging (an all-reduce of the loss or a norm), 70% for evaluation (forward passes
with no gradient reduction, plus a metric all-reduce; a DDP job with rank-local metrics makes
none) and 60% for checkpointing (the barriers and gathers of a save; a rank-0 ``torch.save``
without a barrier makes none). In 5% of the jobs the count varies from step to step (30-90% of
steps make 1-7 more: data-dependent calls), so it says nothing. GC, warm-up, drift, shifts and
fail-slows never change it (greyhound 3: a fail-slow slows the same calls). The calls are drawn
after everything else, so the iteration times are those of the corpus before they existed.

The fail-slows keep the characterization's categories (:data:`.traces.SPECS`: durations,
slowdowns, congestion noise) and add the shapes of greyhound Figures 4-6: ramps of 1-3
iterations, congestion that wanders, and ladders (one or two further steps of >= 20% on top,
each labeled as a compound onset). Labels and scoring are :mod:`.traces`'s (``FailSlow``,
``Trace``, :func:`.traces.score_job`). Everything is a deterministic function of the seed.
"""

from __future__ import annotations

import numpy as np

from failslow.sim.traces import (
    CATEGORIES,
    SPECS,
    FailSlow,
    Trace,
    _duration,
    category_counts,
    failslow_level,
    job_shape,
    level_shifts,
)

# name: (periods to choose from, duration range in iterations, slowdown range, share of jobs)
RHYTHMS: dict[str, tuple[tuple[int, ...], tuple[int, int], tuple[float, float], float]] = {
    "log": ((10, 20, 25, 50), (1, 1), (1.1, 1.5), 0.5),
    "eval": ((50, 64, 100, 128, 150, 200, 250), (1, 3), (1.3, 4.0), 0.8),
    "checkpoint": ((100, 200, 250, 500, 1000), (1, 3), (1.5, 4.0), 0.6),
}


def _failslows(
    rng: np.random.Generator, category: str, base_s: float, n: int
) -> tuple[list[FailSlow], int]:
    """Labeled fail-slows (top level, then ladder steps on top), and the trace length."""
    spec = SPECS[category]
    events: list[FailSlow] = []
    cursor = int(rng.integers(300, 900))
    for _ in range(int(rng.integers(1, spec.max_events + 1))):
        dur = _duration(rng, spec, base_s)
        onset, relief = cursor, cursor + dur
        events.append(FailSlow(onset, relief, float(rng.uniform(*spec.slowdown))))
        steps = 0
        if dur >= 200 and rng.random() < spec.compound_prob:
            steps = 1 + int(rng.random() < 0.4)
        at = onset
        for _ in range(steps):  # a ladder: each step >= 20% on top of the one below
            at += int(rng.uniform(0.15, 0.35) * dur)
            if relief - at < 80:
                break
            longest = relief - at if rng.random() < 0.5 else int(rng.uniform(0.3, 0.6) * dur)
            end = min(relief, at + longest)
            events.append(FailSlow(at, end, float(rng.uniform(0.2, 0.8)), True))
        cursor = relief + int(rng.integers(300, 1200))
    return events, max(n, cursor)


def _rhythms(rng: np.random.Generator, n: int) -> tuple[np.ndarray, dict[str, list[int]]]:
    """Log excess time of the periodic steps, and the iterations each rhythm slowed.

    Rhythms never touch: a phase whose steps would run into another rhythm's (an eval right
    after a checkpoint, a 4-6 iteration slow step) is redrawn, and a rhythm that finds no free
    phase is left out, so a periodic slow step lasts 1-3 iterations as in real jobs.
    """
    excess = np.zeros(n)
    busy = np.zeros(n + 1, dtype=bool)
    where: dict[str, list[int]] = {}
    for name, (periods, (d_lo, d_hi), (s_lo, s_hi), share) in RHYTHMS.items():
        if rng.random() >= share:
            continue
        period = int(rng.choice(periods))
        dur = int(rng.integers(d_lo, d_hi + 1))
        size = np.log(rng.uniform(s_lo, s_hi))
        for _ in range(20):
            phase = int(rng.integers(0, period))
            hit = [i for a in range(phase, n, period) for i in range(a, min(a + dur, n))]
            if not any(busy[max(i - 1, 0) : i + 2].any() for i in hit):
                break
        else:
            continue
        for i in hit:
            excess[i] += size + rng.uniform(-0.15, 0.15)
            busy[i] = True
        where[name] = hit
    return excess, where


def _gc(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[int]]:
    """Log excess time of isolated GC spikes and GC / allocator bursts."""
    excess = np.zeros(n)
    spikes = np.flatnonzero(rng.random(n) < rng.uniform(0.002, 0.01))
    excess[spikes] += np.log(rng.uniform(1.5, 3.0, spikes.size))
    hit = spikes.tolist()
    last = -100
    for start in np.flatnonzero(rng.random(n) < rng.uniform(0.001, 0.004)).tolist():
        if start - last < 16:  # one burst at a time
            continue
        last = start
        slots = int(rng.integers(2, 7))  # a collection every other iteration, for a while
        count = int(rng.integers(2, slots + 1))
        at = start + int(rng.integers(0, 2)) + 2 * np.sort(rng.choice(slots, count, replace=False))
        at = at[at < n]
        excess[at] += np.log(rng.uniform(1.3, 3.0, at.size))
        hit += at.tolist()
    return excess, sorted(hit)


VISIBLE: dict[str, float] = {"log": 0.5, "eval": 0.7, "checkpoint": 0.6}
"""Share of jobs whose periodic steps of each kind make other collective calls than the usual
step (module docstring, "Calls")."""
VARYING = 0.05
"""Share of jobs whose call count varies from step to step (data-dependent calls)."""


def _calls(rng: np.random.Generator, n: int, where: dict[str, list[int]]) -> np.ndarray:
    """Collective calls of each iteration: the usual step's count, more on visible periodic
    steps, and in a few jobs a count that varies from step to step."""
    usual = int(rng.integers(3, 500))
    calls = np.full(n, usual, dtype=np.int64)
    for name, share in VISIBLE.items():
        extra = int(rng.integers(1, 200))
        if rng.random() < share and name in where:
            calls[where[name]] += extra
    if rng.random() < VARYING:
        varying = rng.random(n) < rng.uniform(0.3, 0.9)
        calls[varying] += rng.integers(1, 8, int(varying.sum()))
    return calls


def drift(
    rng: np.random.Generator,
    n: int,
    *,
    bound: float = 0.12,
    per_100: float = 0.03,
    step_sd: float = 0.05,
) -> np.ndarray:
    """A smooth wander of the log level of up to ``bound`` over the job, at most ``per_100``
    per 100 iterations (3-6 knots, a Gaussian random walk of ``step_sd`` between them)."""
    knots = int(rng.integers(3, 7))
    xs = np.linspace(0, n - 1, knots)
    ys = np.clip(np.cumsum(rng.normal(0.0, step_sd, knots)), -bound, bound)
    ys -= ys[0]
    wander = np.interp(np.arange(n), xs, ys)
    steepest = float(np.max(np.abs(np.diff(ys)) / np.diff(xs))) * 100 if knots > 1 else 0.0
    return wander * min(1.0, per_100 / steepest) if steepest > 0 else wander


def life_trace(
    category: str, rng: np.random.Generator, *, positive: bool, job_id: str = ""
) -> Trace:
    """One job's trace, with or without fail-slows, in the rhythm of a real job."""
    spec, base, n = job_shape(category, rng)
    events: list[FailSlow] = []
    if positive:
        events, n = _failslows(rng, category, base, n)
    level, ramped = failslow_level(rng, events, n, spec.congested_noise > 1.0)
    congested = level > 0
    shifts = level_shifts(rng, level, events, rate=1.5, largest=0.08)
    level += drift(rng, n)
    sd = rng.uniform(*spec.noise) * (1.6 if rng.random() < 0.25 else 1.0)
    noise = rng.normal(0.0, sd, n) * np.where(congested, spec.congested_noise, 1.0)
    noise += rng.uniform(0.003, 0.015) * rng.standard_t(rng.uniform(3.0, 4.0), n)
    warm = int(rng.integers(20, 120))
    noise += np.log1p(rng.uniform(0.2, 1.0) * np.exp(-np.arange(n) / (warm / 3.0)))
    compile_steps = int(rng.integers(1, 4))
    noise[:compile_steps] += np.log(rng.uniform(3.0, 20.0, compile_steps))
    rhythm, where = _rhythms(rng, n)
    gc, gc_hit = _gc(rng, n)
    times = base * np.exp(level + noise + rhythm + gc)
    return Trace(
        job_id or category,
        category,
        base,
        times,
        tuple(events),
        {"level_shifts": shifts, "gc": gc_hit, **where, "ramped_onsets": ramped},
        _calls(rng, n, where),  # drawn last: the times are those of the corpus without calls
    )


def life_corpus(n_jobs: int, seed: int = 0) -> list[Trace]:
    """``n_jobs`` labeled traces of :func:`life_trace`; half the jobs have a fail-slow."""
    traces: list[Trace] = []
    for category, count in category_counts(n_jobs):
        for i in range(count):
            rng = np.random.default_rng([seed, 1000 + CATEGORIES.index(category), i])
            traces.append(life_trace(category, rng, positive=i % 2 == 1, job_id=f"{category}-{i}"))
    return traces
