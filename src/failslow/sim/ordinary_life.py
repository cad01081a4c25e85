"""A labeled corpus built from the ordinary, healthy behaviour of real training jobs (issue 47).

The two earlier corpora (:mod:`.traces`, :mod:`.training_life`) surround their fail-slows with
regular rhythms: periodic eval / checkpoint / logging steps, GC spikes and bursts, sub-10% level
shifts. This corpus (issue 47) adds the healthy behaviour those leave out - the things a
training job does that are irregular, clustered or tied to the wall clock, and that a detector
reading only the iteration times (greyhound section 4.2, R2: "training performance inherently
fluctuates") must stay silent on. The fail-slows keep the characterization of greyhound
section 3 (Table 1, Figures 1 and 4-6): computation slowdowns of 12-30% lasting minutes,
congestion of 15-60% (some much larger) lasting up to hours, compound steps at scale.

**Label definition.** A fail-slow is a slowdown of the median iteration time by >= 1.1x,
relative to the level just before it, lasting >= 20 iterations, that is not part of the job's
healthy life. Concretely, on the trace itself: with ``ref`` the median of the 100 iterations
before the onset, the median of 20 consecutive iterations inside ``[onset, relief)`` is
>= 1.1 ``ref`` for at least ``min(20, relief - onset - 19)`` of the 20-iteration windows
there. Everything else is healthy and unlabeled; healthy behaviour is kept below the definition:
outside the iterations around an announced restart (``[r - 19, r + 150)`` for window starts),
no 20-iteration stretch of a negative job has a median >= 1.1x the median of the 100 iterations
before it. Labels are :class:`.traces.FailSlow` ``(onset, relief, slowdown, compound)``: the
first slow iteration, the first recovered iteration, the slowdown relative to the level just
before the onset (for a compound step: relative to the fail-slow under it).

What had to give for that: noisy-neighbour bursts last 2-8 iterations, not 10 (10 slow
iterations of 20 put the window median between the two levels: (1 + 2.5) / 2 > 1.1); a
checkpoint's tail is >= 1.04x for at most ``cap - 2`` iterations; and the short transient steps
(bursts, stalls, evaluations, checkpoint steps and tails, the slower buckets of a multimodal
job, blips) are thinned so that no 20 consecutive iterations hold more than ``cap`` iterations
>= 1.04x - :data:`CAP` (8) in a job whose robust jitter, MoE spread included, is under 1.5%, 6
under 3%, 4 above. A neighbour who stays for half of every 20 iterations *is* a fail-slow by
the definition, and in a noisy job fewer slow iterations already lift the window median. A
transient that would break the cap is dropped (bursts, stalls, blips; a bucket draw goes back
to the base bucket) or waits (a checkpoint due during an evaluation starts after it, up to 40
iterations later). Measured on 80 corpora of 400 jobs (seeds 0-79: 32,000 jobs, 17,600 of
them negative): no label fails the definition and no healthy stretch reaches it, in negative
jobs or in positive ones outside their fail-slows (the largest healthy ratio seen: 1.0995) -
the stated rate is zero, and the tests check it on their corpus.

**Healthy behaviours** (unlabeled; each is recorded in ``Trace.distractors`` by name, as the
list of iterations it slowed, so that errors can be inspected):

- ``startup`` - iteration 0's compile step (1-3 iterations of 3-20x) and a warm-up slowdown of
  20-100% decaying over the first 30-100 iterations. Never labeled.
- ``drift`` - a smooth wander of the level by up to +-5% over the job, at most 2% per 100
  iterations (iterations where it is >= 1% away from the start).
- jitter - every job: Gaussian 0.5-3% (log-sd); in half the jobs a heavy-tailed Student-t
  term (2.5-4 degrees of freedom, clipped at 30 scales) of 0.3-1% on top (``heavy_tail``: its
  iterations beyond 4 scales).
- ``quiet_blips`` - 15% of jobs are very quiet: Gaussian 0.2-0.5% and no heavy tail, with
  single-iteration blips of 1.02-1.08x on 0.5-3% of iterations.
- ``multimodal`` - 20% of the other jobs draw each iteration from sequence-length buckets: the
  base bucket with probability 0.72-0.9, a 1.2-1.4x bucket, and in half of them a 1.5-2x
  bucket (the iterations drawn from a slower bucket).
- ``moe`` - 15% of the other jobs (30% at scale) are MoE jobs with routing imbalance: a
  per-iteration factor, right-skewed (a centred Gamma with shape 1.5-4) with a log-sd of 2-4.5%
  (recorded: the iterations in its top 5%).
- ``bursts`` - noisy neighbours (half the jobs): Poisson times, 1-5 per 1000 iterations, each
  2-8 iterations of 1.15-2.5x (+-10% per iteration).
- ``checkpoints`` / ``checkpoint_tails`` - asynchronous checkpoints (half the jobs) every
  150-2000 iterations: a 1.5-4x step (the snapshot to host memory), then a tail of
  ``1 + A exp(-(t - 1) / tau)``, A = 0.2-0.8, tau = 1-4 iterations (shortened so the tail is
  >= 1.04x for at most ``cap - 2`` iterations: 6, 4 or 2) while the copy drains; tails listed
  while >= 1.01x.
- ``loader_stalls`` - data-loader stalls (45% of jobs) at Poisson times, 1-10 per 1000
  iterations: 1-3 iterations of 1.5-6x.
- ``evals_jittered`` / ``evals_wallclock`` - evaluations (70% of jobs, always in a job whose
  fail-slow starts on one), 1-4 iterations of 1.3-4x (+-15% per occurrence), either every
  80-800 iterations with the period jittered by +-10-30% each time, or every T seconds of
  training time (T = that many iterations at the base step time; the timer restarts when an
  evaluation ends): the gap in iterations then follows the current iteration time, so during a
  fail-slow of s x the gap shrinks to 1/s of it. The clock counts the job's smooth time (level,
  warm-ups, fail-slows, jitter), not its transient steps.
- ``restarts`` / ``restart_warmup`` - hot updates (30% of jobs, 1-3 each, at least 300 apart):
  a 3-20x compile step at the first iteration after the restart, a warm-up slowdown of 20-100%
  decaying over 20-100 iterations, and in 60% of them a level shift of +-5%.
  ``distractors["restarts"]`` lists the first iteration after each restart, which the node
  layer announces to the detector. No labeled onset (nor the start of a ramp) lies within
  ``max(150, warm-up + 120)`` iterations after a restart, and no restart falls inside a
  fail-slow.

**Fail-slows** (labeled; 45% of jobs, 1-3 labels each, the first onset at iteration >= 200,
>= 200 iterations between one's relief and the next one's onset). Step slowdowns are mostly
1.12-2x: 2-5x in 3% / 10% / 20% of them (1-node / 4-node / at-scale), 1.35-2x in 25%, 1.12-1.35x
in the rest; never under what the job's noise needs for the definition to hold
(:func:`_least_slowdown`). Durations follow the category's mean minutes
(:data:`.traces.SPECS`, lognormal) through the base iteration time, 20 iterations to 6000.
Slowdowns multiply everything: the healthy behaviours go on during a fail-slow. In 20% of
1-node jobs and 70% of the others, jitter is 1.3-2x larger while a step fail-slow lasts
(congestion). Their onsets are listed by kind in ``distractors["failslow_<kind>"]``
(labels, not distractors; ramps also in ``ramp_starts``):

- ``clean`` - a step, 40 iterations or more.
- ``ramp`` - thermal throttling: the slowdown grows log-linearly over 20-200 iterations to its
  final 1.2-2x and cools down over 0-30 iterations at the end. The onset is the first
  iteration where the ramp reaches 1.1x (the ramp is made short enough that at most 50
  iterations of it precede the onset); the relief is the first cool-down iteration under 1.1x.
- ``flapping`` - congestion that flaps on and off every 2-8 iterations (off phases 1-8),
  duty cycle 0.55-0.85, 1.25-2.5x while on, 80 iterations or more; the pattern is redrawn
  until at least ``min(20, windows)`` of its 20-iteration windows are >= 13 iterations on, so
  the rolling median is >= 1.1x as the definition asks. Labeled slowdown: the on level.
- ``eval_onset`` - a step that starts on the first iteration of an evaluation (the
  evaluation schedule is phased so that one begins exactly there).
- ``short`` - a step of 20-60 iterations.
- ``compound`` - a second step of 1.2-1.8x on top of a clean, eval-onset or ramp fail-slow's
  plateau (greyhound Figures 4 and 6), starting >= 100 iterations into the plateau; in 40% of
  cases it lasts until that plateau ends. Labeled ``compound=True``.

**Calls.** ``Trace.calls`` is each iteration's count of collective calls: the job's usual
count (3-500), and in half the jobs 1-200 more on every evaluation iteration and on checkpoint
steps; nothing else changes it.

**Sizes.** Jobs of 300-20,000 iterations (lognormal around 2,200, about three quarters of them
1,000-4,000); a positive job too short for its first fail-slow is lengthened to hold it, and
later fail-slows that do not fit are left out. Base iteration times and category shares are
:data:`.traces.SPECS`'s. Everything is a deterministic function of the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from failslow.sim.traces import CATEGORIES, SPECS, FailSlow, Trace, category_counts
from failslow.sim.training_life import drift as life_drift

POSITIVE_SHARE = 0.45
LENGTHS = (300, 20_000)
LABEL_WINDOW = 20
LABEL_RATIO = 1.1
REFERENCE = 100
RESTART_QUIET = 150
"""No labeled onset within this many iterations after a restart (the node layer announces
restarts; the detector may ignore what follows them)."""
EARLIEST_ONSET = 200
MIN_GAP = 200  # from one fail-slow's relief to the next one's onset, at least
TAIL = 120  # iterations after the last relief, at least
CAP = 8
"""Most iterations >= 1.04x from short healthy transients in any 20 consecutive iterations
(in a quiet job; :func:`_cap` lowers it for noisier ones)."""
OCCUPIED = float(np.log(1.04))

KIND_WEIGHTS: dict[str, dict[str, float]] = {
    "1-node": {"clean": 0.3, "ramp": 0.3, "flapping": 0.1, "eval_onset": 0.1, "short": 0.2},
    "4-node": {"clean": 0.3, "ramp": 0.1, "flapping": 0.3, "eval_onset": 0.1, "short": 0.2},
    "at-scale": {"clean": 0.35, "ramp": 0.15, "flapping": 0.2, "eval_onset": 0.1, "short": 0.2},
}
MIN_DURATION = {"clean": 40, "ramp": 80, "flapping": 80, "eval_onset": 40, "short": 20}
HOSTS = ("clean", "ramp", "eval_onset")  # fail-slows a compound step may sit on
COMPOUND_PROB = {"1-node": 0.25, "4-node": 0.4, "at-scale": 0.7}
CONGESTED = {"1-node": 0.2, "4-node": 0.7, "at-scale": 0.7}
LARGE = {"1-node": 0.03, "4-node": 0.1, "at-scale": 0.2}  # share of 2-5x slowdowns
SHARES = {
    "quiet": 0.15,
    "multimodal": 0.2,
    "heavy_tail": 0.5,
    "bursts": 0.5,
    "checkpoints": 0.5,
    "loader_stalls": 0.45,
    "evals": 0.7,
    "restarts": 0.3,
    "visible_calls": 0.5,
}
MOE_SHARE = {"1-node": 0.15, "4-node": 0.15, "at-scale": 0.3}


@dataclass(slots=True)
class _Episode:
    kind: str
    onset: int
    relief: int
    slowdown: float = 1.0
    start: int = -1  # first iteration the fail-slow changes (a ramp's start; else the onset)
    plateau_start: int = -1  # where a ramp reaches its full level
    plateau_end: int = -1  # where a host's full level ends (a ramp's cool-down starts)
    compound: bool = False


def _length(rng: np.random.Generator) -> int:
    return int(np.clip(round(rng.lognormal(np.log(2200.0), 0.6)), *LENGTHS))


def _plan(
    rng: np.random.Generator, category: str, base: float, n: int
) -> tuple[list[_Episode], int, int]:
    """Top-level fail-slows (kind, onset, relief), the index of the one that gets a compound
    step on top (-1: none) and the trace length (lengthened if the first does not fit)."""
    weights = KIND_WEIGHTS[category]
    labels = int(rng.choice([1, 2, 3], p=[0.5, 0.33, 0.17]))
    compound = labels >= 2 and rng.random() < COMPOUND_PROB[category]
    tops = labels - int(compound)
    kinds = [str(k) for k in rng.choice(list(weights), size=tops, p=list(weights.values()))]
    host = int(rng.integers(tops)) if compound else -1
    if host >= 0 and kinds[host] not in HOSTS:
        kinds[host] = "clean"
    for j in [j for j, k in enumerate(kinds) if k == "eval_onset"][1:]:
        kinds[j] = "clean"  # one evaluation schedule per job: one eval-aligned onset
    mean_it = SPECS[category].mean_minutes * 60.0 / base
    episodes: list[_Episode] = []
    cursor = int(rng.integers(EARLIEST_ONSET, 500))
    for j, kind in enumerate(kinds):
        lo = 360 if j == host else MIN_DURATION[kind]
        if kind == "short":
            dur = int(rng.integers(20, 61))
        else:
            dur = int(np.clip(rng.lognormal(np.log(mean_it) - 0.5, 1.0), lo, 6000))
        if kind == "ramp":
            cursor += 50  # the part of the ramp before its onset
        left = tops - j - 1
        room = n - TAIL - cursor - left * (MIN_GAP + 150)
        if room < lo:
            if j:
                break
            n, room = cursor + lo + TAIL, lo
        dur = min(max(dur, lo), room)
        onset = cursor + int(rng.integers(0, (room - dur) // (left + 1) + 1))
        episodes.append(_Episode(kind, onset, onset + dur, start=onset))
        cursor = onset + dur + int(rng.integers(MIN_GAP, MIN_GAP + 500))
    return episodes, host if host < len(episodes) else -1, n


def _rolling_median(x: np.ndarray, w: int, stride: int = 1) -> np.ndarray:
    return np.median(sliding_window_view(x, w)[::stride], axis=1)


def _least_slowdown(z_ref: np.ndarray, z_slow: np.ndarray) -> float:
    """The least slowdown that keeps a step honest on this job's noise: 1.1x times the spread
    between a high 100-iteration median (the reference) and a low 20-iteration median while
    slow (quantiles 99.8% / 0.2% over the job's own noise), plus 1%."""
    hi = float(np.quantile(_rolling_median(z_ref, REFERENCE, 7), 0.998))
    lo = float(np.quantile(_rolling_median(z_slow, LABEL_WINDOW, 3), 0.002))
    return LABEL_RATIO * float(np.exp(hi - lo + 0.01))


def _slowdown(rng: np.random.Generator, category: str) -> float:
    u = rng.random()
    if u < LARGE[category]:
        return float(rng.uniform(2.0, 5.0))
    if u < LARGE[category] + 0.25:
        return float(rng.uniform(1.35, 2.0))
    return float(rng.uniform(1.12, 1.35))


def _ramp(rng: np.random.Generator, ep: _Episode, least: float, level: np.ndarray) -> None:
    """Thermal throttling: log-linear growth to the final slowdown, plateau, cool-down."""
    final = max(float(rng.uniform(1.2, 2.0)), least * 1.05)
    lf, l11 = np.log(final), np.log(LABEL_RATIO)
    dur = ep.relief - ep.onset
    longest = min(200.0, 50.0 * lf / l11, (dur - 20) / (1.0 - l11 / lf))
    length = int(rng.integers(20, max(20, int(longest)) + 1))
    ramp = lf * np.arange(1, length + 1) / length
    pre = int(np.argmax(ramp >= l11 - 1e-12))
    start = ep.onset - pre
    cool_len = int(rng.integers(0, 31))
    cool = lf * (1.0 - np.arange(1, cool_len + 1) / (cool_len + 1))
    above = int((cool >= l11).sum())
    if start + length > ep.relief - above:  # no room for the cool-down: drop at the relief
        cool_len, above, cool = 0, 0, cool[:0]
    end = ep.relief - above
    level[start : start + length] += ramp
    level[start + length : end] += lf
    level[end : end + cool_len] += cool[: max(0, level.size - end)]
    ep.slowdown, ep.start, ep.plateau_start, ep.plateau_end = final, start, start + length, end


def _flapping(rng: np.random.Generator, ep: _Episode, least: float, level: np.ndarray) -> None:
    """Congestion flapping on and off; redrawn until the rolling median is honest."""
    on_level = max(float(rng.uniform(1.25, 2.5)), least * 1.06)
    duty = float(rng.uniform(0.55, 0.85))
    dur = ep.relief - ep.onset
    for _ in range(40):
        mu_on = float(rng.uniform(3.0, 8.0))
        mu_off = float(np.clip(mu_on * (1.0 - duty) / duty, 1.0, 8.0))
        on = np.zeros(dur, dtype=bool)
        at, is_on = 0, True
        while at < dur:
            mu, lo = (mu_on, 2) if is_on else (mu_off, 1)
            seg = int(rng.integers(max(lo, round(mu) - 2), min(8, round(mu) + 2) + 1))
            on[at : at + seg] = is_on
            at, is_on = at + seg, not is_on
        last = int(np.flatnonzero(on)[-1]) + 1
        counts = sliding_window_view(on[:last], LABEL_WINDOW).sum(axis=1)
        if last >= MIN_DURATION["flapping"] and (counts >= 13).sum() >= min(20, counts.size):
            break
        duty = min(0.85, duty + 0.03)
    ep.relief = ep.onset + last
    level[ep.onset : ep.relief][on[:last]] += np.log(on_level)
    ep.slowdown, ep.plateau_end = on_level, ep.relief


def _cap(noise: np.ndarray) -> int:
    """The cap on transient slow iterations per 20 for a job of this noise (robust log-sd):
    the noisier the job, the fewer, so that the window median stays under 1.1x."""
    mad = float(np.median(np.abs(noise - np.median(noise))))
    sd = 1.4826 * mad
    return CAP if sd < 0.015 else CAP - 2 if sd < 0.03 else CAP - 4


class _Occupancy:
    """Which iterations a short healthy transient slowed by >= 1.04x, and the cap on them."""

    def __init__(self, n: int, cap: int) -> None:
        self.occ = np.zeros(n, dtype=np.int64)
        self.cap = cap

    def fits(self, idx: np.ndarray) -> bool:
        n = self.occ.size
        if idx.size == 0 or n < LABEL_WINDOW:
            return True
        lo = max(0, int(idx[0]) - LABEL_WINDOW + 1)
        hi = min(n - LABEL_WINDOW, int(idx[-1]))
        seg = self.occ[lo : hi + LABEL_WINDOW].copy()
        seg[idx - lo] = 1
        cs = np.concatenate(([0], np.cumsum(seg)))
        return int((cs[LABEL_WINDOW:] - cs[:-LABEL_WINDOW]).max()) <= self.cap

    def take(self, idx: np.ndarray) -> None:
        self.occ[idx] = 1


def _eval_schedule(
    rng: np.random.Generator,
    n: int,
    anchor: int,
    *,
    wallclock: bool,
    period: int,
    jitter: float,
    clock: np.ndarray,
    seconds: float,
    longest: int,
) -> list[tuple[int, int]]:
    """Evaluation (start, length) pairs, one starting at ``anchor``, the rest before and after
    it: every ``period`` iterations +-``jitter``, or (``wallclock``) once ``seconds`` of
    training time (``clock``: the smooth iteration times) have passed since the previous one
    ended."""
    cum = np.concatenate(([0.0], np.cumsum(clock)))
    runs = [(anchor, int(rng.integers(1, longest + 1)))]
    while True:  # forward
        start, length = runs[-1]
        end = start + length
        if wallclock:
            nxt = int(np.searchsorted(cum, cum[min(end, n)] + seconds))
        else:
            nxt = start + round(period * (1.0 + rng.uniform(-jitter, jitter)))
        if nxt >= n:
            break
        runs.append((nxt, int(rng.integers(1, longest + 1))))
    before: list[tuple[int, int]] = []
    start = anchor
    while True:  # backward
        length = int(rng.integers(1, longest + 1))
        if wallclock:
            end = int(np.searchsorted(cum, cum[start] - seconds, side="right")) - 1
            prev = end - length
        else:
            prev = start - round(period * (1.0 + rng.uniform(-jitter, jitter)))
        if prev < 40:
            break
        before.append((prev, length))
        start = prev
    return [*before[::-1], *runs]


def ordinary_trace(
    category: str, rng: np.random.Generator, *, positive: bool, job_id: str = ""
) -> Trace:
    """One job's trace in its ordinary life, with (``positive``) or without fail-slows."""
    if category not in SPECS:
        raise ValueError(f"unknown job category {category!r}; expected one of {CATEGORIES}")
    base = float(rng.uniform(*SPECS[category].base_s))
    n = _length(rng)
    tops: list[_Episode] = []
    host = -1
    if positive:
        tops, host, n = _plan(rng, category, base, n)
    where: dict[str, list[int]] = {}

    # -- the job's character and its stationary noise (log) ----------------------------------
    quiet = rng.random() < SHARES["quiet"]
    multimodal = not quiet and rng.random() < SHARES["multimodal"]
    moe = not quiet and not multimodal and rng.random() < MOE_SHARE[category]
    if quiet:
        z = rng.normal(0.0, rng.uniform(0.002, 0.005), n)
    else:
        z = rng.normal(0.0, rng.uniform(0.005, 0.03), n)
        if rng.random() < SHARES["heavy_tail"]:
            scale = rng.uniform(0.003, 0.01)
            t = np.clip(rng.standard_t(rng.uniform(2.5, 4.0), n), -30.0, 30.0)
            z += scale * t
            where["heavy_tail"] = np.flatnonzero(np.abs(t) > 4.0).tolist()
    spread = np.zeros(n)  # per-iteration variation the congestion does not amplify
    if moe:
        shape = rng.uniform(1.5, 4.0)
        g = rng.gamma(shape, 1.0, n)
        spread = rng.uniform(0.02, 0.045) * (g - np.median(g)) / np.sqrt(shape)
        where["moe"] = np.flatnonzero(spread >= np.quantile(spread, 0.95)).tolist()
    bucket = np.zeros(n)  # log level of the sequence-length bucket drawn (before thinning)
    if multimodal:
        p0 = rng.uniform(0.72, 0.9)
        levels = [rng.uniform(1.2, 1.4)]
        probs = [1.0 - p0]
        if rng.random() < 0.5:
            share = rng.uniform(0.2, 0.5)
            levels.append(rng.uniform(1.5, 2.0))
            probs = [(1.0 - p0) * (1.0 - share), (1.0 - p0) * share]
        pick = rng.choice(len(levels) + 1, size=n, p=[p0, *probs])
        bucket = np.log(np.array([1.0, *levels]))[pick]
    congestion = float(rng.uniform(1.3, 2.0)) if rng.random() < CONGESTED[category] else 1.0

    # -- fail-slows (log level) ----------------------------------------------------------------
    level = np.zeros(n)
    episodes: list[_Episode] = []
    if tops:
        least = _least_slowdown(z + spread + bucket, congestion * z + spread + bucket)
        for ep in tops:
            if ep.kind == "ramp":
                _ramp(rng, ep, least, level)
            elif ep.kind == "flapping":
                _flapping(rng, ep, least, level)
            else:
                ep.slowdown = max(_slowdown(rng, category), least)
                ep.plateau_end = ep.relief
                level[ep.onset : ep.relief] += np.log(ep.slowdown)
            if ep.kind != "ramp":
                z[ep.onset : ep.relief] *= congestion
            episodes.append(ep)
            where.setdefault(f"failslow_{ep.kind}", []).append(ep.onset)
            if ep.kind == "ramp":
                where.setdefault("ramp_starts", []).append(ep.start)
        if host >= 0:
            h = tops[host]
            lo = max(h.plateau_start, h.onset) + REFERENCE
            hi = h.plateau_end - LABEL_WINDOW
            if hi >= lo:
                c_on = int(rng.integers(lo, hi + 1))
                if rng.random() < 0.4:
                    c_rel = h.plateau_end
                else:
                    c_rel = c_on + int(np.clip(rng.lognormal(np.log(200.0), 0.8), 20, 1e9))
                    c_rel = min(c_rel, h.plateau_end)
                c = _Episode("compound", c_on, c_rel, max(float(rng.uniform(1.2, 1.8)), least))
                c.compound = True
                level[c_on:c_rel] += np.log(c.slowdown)
                episodes.append(c)
                where["failslow_compound"] = [c_on]

    # -- restarts (announced), start-up, drift -------------------------------------------------
    restarts: list[int] = []
    warm_iters: list[int] = []
    if rng.random() < SHARES["restarts"] and n > 400:
        for _ in range(int(rng.integers(1, 4))):
            warm = int(rng.integers(20, 101))
            quiet_after = max(RESTART_QUIET, warm + 120)
            for _ in range(30):
                r = int(rng.integers(200, n - 60))
                if all(abs(r - q) >= 300 for q in restarts) and not any(
                    ep.start - quiet_after <= r < ep.relief + 40 for ep in tops
                ):
                    break
            else:
                continue
            restarts.append(r)
            since = np.arange(n - r)
            level[r] += np.log(rng.uniform(3.0, 20.0))
            level[r:] += np.log1p(rng.uniform(0.2, 1.0) * np.exp(-4.0 * since / warm))
            if rng.random() < 0.6:
                level[r:] += rng.uniform(-0.05, 0.05)
            warm_iters += range(r, min(n, r + warm))
    restarts.sort()
    warm0 = int(rng.integers(30, 101))
    level += np.log1p(rng.uniform(0.2, 1.0) * np.exp(-4.0 * np.arange(n) / warm0))
    compile_steps = int(rng.integers(1, 4))
    level[:compile_steps] += np.log(rng.uniform(3.0, 20.0, compile_steps))
    drift = life_drift(rng, n, bound=0.05, per_100=0.02, step_sd=0.025)
    where["startup"] = list(range(min(n, warm0)))
    where["drift"] = np.flatnonzero(np.abs(drift) >= 0.01).tolist()
    where["restarts"] = restarts
    where["restart_warmup"] = sorted(warm_iters)
    smooth = np.log(base) + level + drift + z + spread  # the clock of wall-clock evaluations

    # -- short transients, under the cap --------------------------------------------------------
    occ = _Occupancy(n, _cap(z + spread))
    extra = np.zeros(n)
    eval_onset = next((ep.onset for ep in tops if ep.kind == "eval_onset"), None)
    eval_iters: list[int] = []
    if eval_onset is not None or rng.random() < SHARES["evals"]:
        wallclock = rng.random() < 0.5
        period = int(rng.integers(80, 801))
        anchor = eval_onset if eval_onset is not None else 40 + int(rng.integers(0, period))
        size = np.log(rng.uniform(1.3, 4.0))
        runs = _eval_schedule(
            rng,
            n,
            min(anchor, n - 1),
            wallclock=wallclock,
            period=period,
            jitter=float(rng.uniform(0.1, 0.3)),
            clock=np.exp(smooth),
            seconds=period * base,
            longest=int(rng.integers(1, 5)),
        )
        for start, length in runs:
            idx = np.arange(start, min(n, start + length))
            extra[idx] += size + rng.uniform(-0.15, 0.15)
            occ.take(idx)
            eval_iters += idx.tolist()
        where["evals_wallclock" if wallclock else "evals_jittered"] = eval_iters
    ckpt_steps: list[int] = []
    if rng.random() < SHARES["checkpoints"]:
        every = int(rng.integers(150, 2001))
        step = np.log(rng.uniform(1.5, 4.0))
        amp = rng.uniform(0.2, 0.8)
        tau = min(rng.uniform(1.0, 4.0), (occ.cap - 3) / np.log(amp / 0.04))
        tail = amp * np.exp(-np.arange(int(tau * np.log(amp / 0.01)) + 1) / tau)
        tail_log = np.log1p(tail)
        tails: list[int] = []
        for due in range(int(rng.integers(100, 100 + every)), n, every):
            for at in range(due, min(n, due + 41)):
                idx = np.arange(at, min(n, at + 1 + tail.size))
                busy = idx[np.concatenate(([True], tail >= 0.04))[: idx.size]]
                if occ.fits(busy):
                    occ.take(busy)
                    extra[at] += step
                    extra[idx[1:]] += tail_log[: idx.size - 1]
                    ckpt_steps.append(at)
                    tails += idx[1:].tolist()
                    break
        where["checkpoints"] = ckpt_steps
        where["checkpoint_tails"] = tails
    if multimodal:
        kept: list[int] = []
        for i in np.flatnonzero(bucket > 0).tolist():
            if occ.fits(np.array([i])):
                occ.take(np.array([i]))
                extra[i] += bucket[i]
                kept.append(i)
        where["multimodal"] = kept

    def transients(name: str, rate: float, lengths: tuple[int, int], sizes: tuple[float, float]):
        hit: list[int] = []
        starts = np.sort(rng.integers(0, n, int(rng.poisson(rate * n))))
        for s in starts.tolist():
            idx = np.arange(s, min(n, s + int(rng.integers(lengths[0], lengths[1] + 1))))
            size = np.log(rng.uniform(*sizes)) + rng.uniform(-0.1, 0.1, idx.size)
            busy = idx[size >= OCCUPIED]
            if occ.fits(busy):
                occ.take(busy)
                extra[idx] += size
                hit += idx.tolist()
        where[name] = hit

    if rng.random() < SHARES["loader_stalls"]:
        transients("loader_stalls", rng.uniform(0.001, 0.01), (1, 3), (1.5, 6.0))
    if rng.random() < SHARES["bursts"]:
        transients("bursts", rng.uniform(0.001, 0.005), (2, 8), (1.15, 2.5))
    if quiet:
        transients("quiet_blips", rng.uniform(0.005, 0.03), (1, 1), (1.02, 1.08))

    times = np.exp(smooth + extra)
    calls = np.full(n, int(rng.integers(3, 501)), dtype=np.int64)
    if rng.random() < SHARES["visible_calls"]:
        calls[np.array(eval_iters, dtype=np.int64)] += int(rng.integers(1, 201))
        calls[np.array(ckpt_steps, dtype=np.int64)] += int(rng.integers(1, 201))
    labels = tuple(
        FailSlow(ep.onset, ep.relief, round(ep.slowdown, 4), ep.compound)
        for ep in sorted(episodes, key=lambda e: e.onset)
    )
    return Trace(job_id or category, category, base, times, labels, where, calls)


def ordinary_corpus(n_jobs: int, seed: int = 0) -> list[Trace]:
    """``n_jobs`` traces of :func:`ordinary_trace`, 45% of each category positive."""
    traces: list[Trace] = []
    for category, count in category_counts(n_jobs):
        c = CATEGORIES.index(category)
        n_pos = round(POSITIVE_SHARE * count)
        chosen = np.random.default_rng([seed, 4700, c]).permutation(count)[:n_pos]
        positive = set(chosen.tolist())
        for i in range(count):
            rng = np.random.default_rng([seed, 4701 + c, i])
            traces.append(
                ordinary_trace(
                    category, rng, positive=i in positive, job_id=f"ordinary-{category}-{i}"
                )
            )
    return traces
