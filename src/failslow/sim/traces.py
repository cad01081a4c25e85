"""Labeled synthetic iteration-time traces, shaped after greyhound section 3.

Three job categories, as in the characterization study (Table 1, Figure 1):

- ``1-node`` (section 3.2): ~0.45 s iterations; computation fail-slows (CPU contention, GPU
  throttling): short (mean ~10 minutes), 12-30% slowdown, one or two per slow job.
- ``4-node`` (section 3.3): ~1.8 s iterations; communication fail-slows from network
  congestion: longer (mean ~24 minutes, from under a minute to over 100), 15-60% slowdown,
  noisier while congested, sometimes a second step on top (Figure 4).
- ``at-scale`` (section 3.4): ~2.5 s iterations; long (mean ~72 minutes), large slowdowns with
  ladder-shaped compound steps (Figures 5 and 6).

Minutes convert to iterations through each job's base iteration time. Every trace also carries
the normal fluctuations a detector must ignore (section 4.2, R2): Gaussian jitter of 1-3%,
heavy-tailed per-iteration variation (Student-t, uneven sequence lengths), GC spikes
(single iterations 1.5-3x), periodic eval/checkpoint steps (one much longer step every N),
a decaying warm-up, slow drift of a few % over the job, and sub-10% level shifts (3-7%, either
sign) - none of which is labeled. Labels are ``(onset, relief, slowdown)``: the first slow
iteration, the first recovered iteration, and the slowdown relative to the level just before
the onset (a compound step's slowdown is relative to the fail-slow it sits on).

Everything is a deterministic function of the seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CATEGORIES = ("1-node", "4-node", "at-scale")


@dataclass(frozen=True, slots=True)
class CategorySpec:
    base_s: tuple[float, float]
    length: tuple[int, int]  # iterations
    mean_minutes: float  # mean fail-slow duration
    slowdown: tuple[float, float]
    max_events: int
    compound_prob: float
    noise: tuple[float, float]  # Gaussian log-sd range
    congested_noise: float  # noise multiplier during a fail-slow
    positive_share: float  # share of jobs with a fail-slow (raised from Table 1 to measure)
    job_share: float


SPECS: dict[str, CategorySpec] = {
    "1-node": CategorySpec(
        (0.4, 0.55), (2000, 4000), 10.0, (0.12, 0.30), 2, 0.0, (0.01, 0.025), 1.0, 0.3, 0.5
    ),
    "4-node": CategorySpec(
        (1.5, 2.1), (2000, 4500), 24.0, (0.15, 0.60), 2, 0.2, (0.015, 0.03), 1.5, 0.5, 0.35
    ),
    "at-scale": CategorySpec(
        (2.0, 3.0), (3000, 6000), 72.0, (0.20, 1.50), 2, 0.7, (0.015, 0.03), 1.5, 0.6, 0.15
    ),
}


@dataclass(frozen=True, slots=True)
class FailSlow:
    onset: int
    relief: int
    slowdown: float
    compound: bool = False


@dataclass(frozen=True, slots=True)
class Trace:
    job_id: str
    category: str
    base_s: float
    times: np.ndarray
    failslows: tuple[FailSlow, ...]
    distractors: dict[str, list[int]] = field(default_factory=dict)
    calls: np.ndarray | None = None  # collective calls of each iteration, where modelled

    @property
    def labels(self) -> list[tuple[int, int, float]]:
        return [(f.onset, f.relief, f.slowdown) for f in self.failslows]

    @property
    def positive(self) -> bool:
        return bool(self.failslows)


def _duration(rng: np.random.Generator, spec: CategorySpec, base_s: float) -> int:
    minutes = rng.lognormal(np.log(spec.mean_minutes) - 0.5, 1.0)  # mean = mean_minutes
    return int(np.clip(minutes * 60.0 / base_s, 40, 3000))


def _place_failslows(
    rng: np.random.Generator, spec: CategorySpec, base_s: float, n: int
) -> tuple[list[FailSlow], int]:
    count = int(rng.integers(1, spec.max_events + 1))
    events: list[FailSlow] = []
    cursor = int(rng.integers(300, 800))
    for _ in range(count):
        dur = _duration(rng, spec, base_s)
        onset, relief = cursor, cursor + dur
        slow = float(rng.uniform(*spec.slowdown))
        events.append(FailSlow(onset, relief, slow))
        if dur >= 200 and rng.random() < spec.compound_prob:  # ladder step on top
            inner_on = onset + int(rng.uniform(0.15, 0.5) * dur)
            inner_off = min(relief, inner_on + int(rng.uniform(0.2, 0.6) * dur))
            events.append(FailSlow(inner_on, inner_off, float(rng.uniform(0.2, 0.8)), True))
        cursor = relief + int(rng.integers(300, 1200))
    return events, max(n, cursor)


def job_shape(category: str, rng: np.random.Generator) -> tuple[CategorySpec, float, int]:
    """A job's category spec, base iteration time and length (the first draws of a trace)."""
    if category not in SPECS:
        raise ValueError(f"unknown job category {category!r}; expected one of {CATEGORIES}")
    spec = SPECS[category]
    return spec, float(rng.uniform(*spec.base_s)), int(rng.integers(*spec.length))


def failslow_level(
    rng: np.random.Generator, events: list[FailSlow], n: int, wander: bool
) -> tuple[np.ndarray, list[int]]:
    """Log slowdown of the labeled fail-slows (gradual build-up over 1-3 iterations for 40%
    of them; congestion severity that wanders, AR(1) +-20%, when ``wander``), and the onsets
    that ramp up."""
    level = np.zeros(n)
    ramped: list[int] = []
    for ev in events:
        step = np.full(ev.relief - ev.onset, np.log1p(ev.slowdown))
        ramp = 0 if rng.random() < 0.6 else int(rng.integers(1, 4))  # gradual build-up
        step[:ramp] *= (np.arange(1, ramp + 1) / (ramp + 1))[: step.size]
        if ramp:
            ramped.append(ev.onset)
        if wander:
            w = np.zeros(step.size)
            shocks = rng.normal(0.0, 0.2 * np.sqrt(1 - 0.98**2), step.size)
            for i in range(1, step.size):
                w[i] = 0.98 * w[i - 1] + shocks[i]
            step *= 1.0 + np.clip(w, -0.4, 0.4)
        level[ev.onset : ev.relief] += step
    return level, ramped


def level_shifts(
    rng: np.random.Generator,
    level: np.ndarray,
    events: list[FailSlow],
    *,
    rate: float,
    largest: float,
) -> list[int]:
    """Add distractors to ``level`` in place: a Poisson(``rate``) number of sub-10% level
    shifts (3% to ``largest``, either sign) at least 200 iterations from any labeled change
    and from each other; returns where they start."""
    n = level.size
    edges = [e for ev in events for e in (ev.onset, ev.relief)]
    shifts: list[int] = []
    for _ in range(int(rng.poisson(rate))):
        at = int(rng.integers(200, n - 100))
        if all(abs(at - e) > 200 for e in edges + shifts):
            level[at:] += rng.choice([-1.0, 1.0]) * np.log1p(rng.uniform(0.03, largest))
            shifts.append(at)
    return shifts


def category_counts(n_jobs: int) -> list[tuple[str, int]]:
    """How many of ``n_jobs`` jobs each category gets (:data:`SPECS` job shares)."""
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    shares = np.array([SPECS[c].job_share for c in CATEGORIES])
    counts = np.floor(shares / shares.sum() * n_jobs).astype(int)
    counts[0] += n_jobs - counts.sum()
    return list(zip(CATEGORIES, counts.tolist(), strict=True))


def generate_trace(
    category: str, rng: np.random.Generator, *, positive: bool, job_id: str = ""
) -> Trace:
    """One job's trace of the given category, with or without fail-slows."""
    spec, base, n = job_shape(category, rng)
    events: list[FailSlow] = []
    if positive:
        events, n = _place_failslows(rng, spec, base, n)
    level, _ = failslow_level(rng, events, n, spec.congested_noise > 1.0)
    congested = np.zeros(n, dtype=bool)
    for ev in events:
        congested[ev.onset : ev.relief] = True
    shifts = level_shifts(rng, level, events, rate=1.2, largest=0.07)
    level += np.linspace(0.0, rng.uniform(-0.05, 0.05), n)  # slow drift
    sd = rng.uniform(*spec.noise)
    if category == "at-scale" and rng.random() < 0.3:  # high-variance jobs (MoE, Figure 5)
        sd *= 1.6
    noise = rng.normal(0.0, sd, n) * np.where(congested, spec.congested_noise, 1.0)
    noise += rng.uniform(0.002, 0.01) * rng.standard_t(3, n)  # uneven sequence lengths
    warm = int(rng.integers(20, 120))
    noise += np.log1p(rng.uniform(0.2, 1.0) * np.exp(-np.arange(n) / (warm / 3.0)))
    spikes = rng.random(n) < rng.uniform(0.002, 0.01)  # GC pauses
    noise[spikes] += np.log(rng.uniform(1.5, 3.0, int(spikes.sum())))
    evals: list[int] = []
    if rng.random() < 0.7:  # periodic eval / checkpoint step
        every = int(rng.choice([200, 500, 1000]))
        evals = list(range(every - 1, n, every))
        noise[evals] += np.log(rng.uniform(3.0, 10.0, len(evals)))
    times = base * np.exp(level + noise)
    return Trace(
        job_id or category,
        category,
        base,
        times,
        tuple(events),
        {"level_shifts": shifts, "gc_spikes": np.flatnonzero(spikes).tolist(), "evals": evals},
    )


def generate_corpus(n_jobs: int, seed: int = 0) -> list[Trace]:
    """``n_jobs`` labeled traces; category and fail-slow mix follow :data:`SPECS`."""
    traces: list[Trace] = []
    for category, count in category_counts(n_jobs):
        n_pos = round(SPECS[category].positive_share * count)
        for i in range(count):
            job_rng = np.random.default_rng([seed, CATEGORIES.index(category), i])
            traces.append(
                generate_trace(category, job_rng, positive=i < n_pos, job_id=f"{category}-{i}")
            )
    return traces


# -- scoring against labels --------------------------------------------------------------------

MATCH_WINDOW = 60  # iterations after a labeled onset within which a report counts as a match
RELIEF_GRACE = 60  # iterations after a labeled relief still counted as part of the fail-slow


@dataclass(frozen=True, slots=True)
class JobScore:
    """How one detector did on one labeled trace (see benchmarks/detection_accuracy.py)."""

    positive: bool
    correct: bool
    latencies: tuple[int | None, ...]  # per labeled onset: iterations to report, None = missed
    false_alarms: int  # reported onsets outside every labeled fail-slow (plus grace)
    quiet_iterations: int  # iterations outside every labeled fail-slow (plus grace)
    reliefs_found: int
    reliefs_labeled: int
    errors: tuple[int, ...] = ()  # per matched onset: |reported change point - labeled onset|
    order_faults: int = 0  # reliefs reported with no reported onset open (live order, issue 47)


def score_job(trace: Trace, events: list) -> JobScore:  # type: ignore[type-arg]
    """Score one job: match each labeled onset, count reported onsets outside fail-slows."""
    n = trace.times.size
    inside = np.zeros(n + 1, dtype=bool)
    for f in trace.failslows:
        inside[f.onset : min(n, f.relief + RELIEF_GRACE)] = True
    onsets = [e for e in events if e.type == "onset"]
    used: set[int] = set()
    latencies: list[int | None] = []
    errors: list[int] = []
    for f in sorted(trace.failslows, key=lambda f: f.onset):
        hit = None
        for k, e in enumerate(onsets):
            if k not in used and f.onset <= e.detected_at <= f.onset + MATCH_WINDOW:
                hit = k
                break
        if hit is None:
            latencies.append(None)
        else:
            used.add(hit)
            latencies.append(onsets[hit].detected_at - f.onset)
            errors.append(abs(onsets[hit].iteration - f.onset))
    false_alarms = sum(
        1 for k, e in enumerate(onsets) if k not in used and not inside[min(e.detected_at, n)]
    )
    outer = [f for f in trace.failslows if not f.compound]
    reliefs = [e.detected_at for e in events if e.type == "relief"]
    found = sum(1 for f in outer if any(f.relief <= d <= f.relief + 120 for d in reliefs))
    correct = false_alarms == 0 and all(lat is not None for lat in latencies)
    open_, order_faults = False, 0
    for e in events:
        if e.type == "onset":
            open_ = True
        elif open_:
            open_ = False
        else:
            order_faults += 1
    return JobScore(
        trace.positive,
        correct,
        tuple(latencies),
        false_alarms,
        int(n - inside[:n].sum()),
        found,
        len(outer),
        tuple(errors),
        order_faults,
    )
