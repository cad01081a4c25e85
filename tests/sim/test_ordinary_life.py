"""The ordinary-life corpus (:mod:`failslow.sim.ordinary_life`, issue 47): deterministic,
labels honest on the trace itself, healthy behaviour below the label definition, every
behaviour present, restarts announced and kept away from onsets, and too hard for a naive
sliding-median detector."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from failslow.sim.ordinary_life import (
    EARLIEST_ONSET,
    LENGTHS,
    RESTART_QUIET,
    ordinary_corpus,
    ordinary_trace,
)
from failslow.sim.traces import CATEGORIES, Trace, category_counts, score_job

WINDOW, RATIO, REF = 20, 1.1, 100  # the label definition (module docstring)

HEALTHY = (
    "startup",
    "drift",
    "heavy_tail",
    "quiet_blips",
    "multimodal",
    "moe",
    "bursts",
    "checkpoints",
    "checkpoint_tails",
    "loader_stalls",
    "evals_jittered",
    "evals_wallclock",
    "restarts",
    "restart_warmup",
)
KINDS = ("clean", "ramp", "flapping", "eval_onset", "short", "compound")


@pytest.fixture(scope="module")
def corpus() -> list[Trace]:
    return ordinary_corpus(400, 0)


def _medians(x: np.ndarray, w: int) -> np.ndarray:
    """``out[s]`` = median of ``x[s : s + w]``."""
    return np.median(sliding_window_view(x, w), axis=1)


def _starts(trace: Trace) -> dict[int, int]:
    """Labeled onset -> first iteration its fail-slow changes (a ramp's start)."""
    ramps = zip(
        trace.distractors.get("failslow_ramp", []),
        trace.distractors.get("ramp_starts", []),
        strict=True,
    )
    starts = {f.onset: f.onset for f in trace.failslows}
    starts.update(dict(ramps))
    return starts


def _violations(trace: Trace) -> np.ndarray:
    """Window starts ``s`` whose 20-iteration median is >= 1.1x the median of the 100
    iterations before, outside announced restarts (``s`` in ``[r - 19, r + 150)``) and
    labeled fail-slows (``s`` in ``[start - 19, relief)``)."""
    t = trace.times
    s = np.arange(REF, t.size - WINDOW + 1)
    ratio = _medians(t, WINDOW)[s] / _medians(t, REF)[s - REF]
    out = np.zeros(s.size, dtype=bool)
    for r in trace.distractors["restarts"]:
        out |= (s >= r - WINDOW + 1) & (s < r + RESTART_QUIET)
    starts = _starts(trace)
    for f in trace.failslows:
        out |= (s >= starts[f.onset] - WINDOW + 1) & (s < f.relief)
    return s[(ratio >= RATIO) & ~out]


def test_same_seed_same_corpus_other_seed_another():
    a, b, c = ordinary_corpus(30, 3), ordinary_corpus(30, 3), ordinary_corpus(30, 4)
    for x, y in zip(a, b, strict=True):
        assert x.job_id == y.job_id and x.category == y.category and x.base_s == y.base_s
        assert np.array_equal(x.times, y.times) and np.array_equal(x.calls, y.calls)
        assert x.failslows == y.failslows and x.distractors == y.distractors
    assert any(
        x.times.size != z.times.size or not np.array_equal(x.times, z.times)
        for x, z in zip(a, c, strict=True)
    )
    one = ordinary_trace("4-node", np.random.default_rng(9), positive=True)
    two = ordinary_trace("4-node", np.random.default_rng(9), positive=True)
    assert np.array_equal(one.times, two.times) and one.failslows == two.failslows
    with pytest.raises(ValueError, match="unknown job category"):
        ordinary_trace("2-node", np.random.default_rng(0), positive=False)


def test_sizes_shares_and_label_shape(corpus):
    assert [(c, sum(t.category == c for t in corpus)) for c in CATEGORIES] == category_counts(400)
    lengths = np.array([t.times.size for t in corpus])
    assert lengths.min() >= LENGTHS[0] and lengths.max() <= LENGTHS[1]
    assert np.mean((lengths >= 1000) & (lengths <= 4000)) >= 0.6  # skewed: most 1,000-4,000
    assert lengths.max() >= 6000
    assert 0.43 <= np.mean([t.positive for t in corpus]) <= 0.47
    durations, slowdowns = [], []
    for t in corpus:
        assert t.times.dtype == np.float64 and np.all(t.times > 0) and np.isfinite(t.times).all()
        if not t.positive:
            continue
        assert 1 <= len(t.failslows) <= 3
        assert [f.onset for f in t.failslows] == sorted(f.onset for f in t.failslows)
        for f in t.failslows:
            assert f.onset >= EARLIEST_ONSET and f.relief - f.onset >= WINDOW
            assert f.relief <= t.times.size - 100 and f.slowdown >= RATIO
            durations.append(f.relief - f.onset)
            slowdowns.append(f.slowdown)
    durations_a, slowdowns_a = np.array(durations), np.array(slowdowns)
    assert (durations_a <= 60).sum() >= 10 and (durations_a >= 1000).sum() >= 10
    assert np.mean(slowdowns_a <= 2.0) >= 0.75 and slowdowns_a.max() >= 2.5
    assert np.mean(slowdowns_a <= 1.35) >= 0.35  # greyhound Table 1: typical 12-35%


def test_every_label_meets_the_definition_on_the_trace(corpus):
    """Per labeled fail-slow: the median of 20 iterations inside it is >= 1.1x the median of
    the 100 iterations before the onset, for at least min(20, windows) of its windows."""
    checked = 0
    for t in corpus:
        for f in t.failslows:
            ref = np.median(t.times[f.onset - REF : f.onset])
            inside = _medians(t.times[f.onset : f.relief], WINDOW)
            passing = int((inside >= RATIO * ref).sum())
            assert passing >= min(WINDOW, inside.size), (t.job_id, f, passing, inside.size)
            checked += 1
    assert checked >= 150


def test_healthy_life_stays_under_the_definition(corpus):
    """Stated rate: zero. No negative job has a 20-iteration stretch whose median is >= 1.1x
    the median of the 100 iterations before it, outside announced restarts; nor does a
    positive job outside its labeled fail-slows."""
    bad = {t.job_id: _violations(t)[:3].tolist() for t in corpus}
    assert {k: v for k, v in bad.items() if v} == {}


def test_compound_steps_sit_on_a_plateau(corpus):
    compounds = 0
    for t in corpus:
        for c in (f for f in t.failslows if f.compound):
            hosts = [f for f in t.failslows if not f.compound and f.onset < c.onset < f.relief]
            assert len(hosts) == 1, (t.job_id, c)
            assert c.onset >= hosts[0].onset + REF and c.relief <= hosts[0].relief
            assert c.slowdown >= 1.2
            compounds += 1
    assert compounds >= 10


def test_restarts_are_recorded_and_no_onset_follows_within_150(corpus):
    with_restart = Counter()
    for t in corpus:
        restarts = t.distractors["restarts"]
        assert restarts == sorted(restarts) and all(isinstance(r, int) for r in restarts)
        with_restart[t.positive] += bool(restarts)
        starts = _starts(t)
        for r in restarts:
            assert 0 < r < t.times.size
            assert t.times[r] >= 3.0 * t.base_s  # the compile step
            for f in t.failslows:
                assert not 0 <= f.onset - r < RESTART_QUIET, (t.job_id, r, f)
                assert not starts[f.onset] <= r < f.relief, (t.job_id, r, f)  # not inside
    positives = sum(t.positive for t in corpus)
    assert with_restart[True] / positives >= 0.15
    assert with_restart[False] / (len(corpus) - positives) >= 0.15


def test_every_behaviour_is_in_the_corpus(corpus):
    jobs = Counter(k for t in corpus for k, v in t.distractors.items() if v)
    print("jobs per behaviour:", dict(sorted(jobs.items())))
    for name in HEALTHY:
        assert jobs[name] >= 20, (name, jobs[name])
    for kind in KINDS:
        assert jobs[f"failslow_{kind}"] >= 10, (kind, jobs[f"failslow_{kind}"])
    assert all(t.times[0] >= 3.0 * np.median(t.times[100:200]) for t in corpus)  # compile


def test_kinds_are_what_they_say(corpus):
    for t in corpus:
        d = t.distractors
        evals = set(d.get("evals_jittered", [])) | set(d.get("evals_wallclock", []))
        for onset in d.get("failslow_eval_onset", []):
            assert onset in evals and onset - 1 not in evals  # starts on an eval's first step
        for onset, start in zip(d.get("failslow_ramp", []), d.get("ramp_starts", []), strict=True):
            assert 0 <= onset - start <= 50 and start >= 150
        for f in t.failslows:
            if f.onset in d.get("failslow_short", []):
                assert WINDOW <= f.relief - f.onset <= 60


def _eval_starts(iters: list[int]) -> np.ndarray:
    s = set(iters)
    return np.array(sorted(i for i in s if i - 1 not in s))


def test_wallclock_evals_follow_the_step_time_and_jittered_ones_jitter(corpus):
    shrunk, seen = 0, 0
    for t in corpus:
        jittered = _eval_starts(t.distractors.get("evals_jittered", []))
        if jittered.size >= 4:
            gaps = np.diff(jittered)
            assert gaps.max() / gaps.min() <= 1.3 / 0.7 + 0.05 and gaps.max() > gaps.min()
        wall = _eval_starts(t.distractors.get("evals_wallclock", []))
        for f in t.failslows:
            if f.compound or f.onset in t.distractors.get("failslow_flapping", []):
                continue
            inside = [b - a for a, b in itertools.pairwise(wall) if f.onset <= a and b < f.relief]
            outside = [b - a for a, b in itertools.pairwise(wall) if b < f.onset and a > 200]
            if f.slowdown >= 1.3 and inside and len(outside) >= 2:
                seen += 1
                shrunk += np.median(inside) < np.median(outside) / (1 + (f.slowdown - 1) / 2)
    assert seen >= 3 and shrunk / seen >= 0.8


def test_calls_change_only_on_evals_and_checkpoints(corpus):
    visible, eligible = 0, 0
    for t in corpus:
        assert t.calls is not None and t.calls.dtype == np.int64 and t.calls.shape == t.times.shape
        usual = int(np.bincount(t.calls).argmax())
        assert 3 <= usual <= 500
        d = t.distractors
        special = set(d.get("evals_jittered", []) + d.get("evals_wallclock", []))
        special |= set(d.get("checkpoints", []))
        assert set(np.flatnonzero(t.calls != usual).tolist()) <= special
        if special:
            eligible += 1
            visible += bool((t.calls != usual).any())
    assert 0.35 <= visible / eligible <= 0.65


@dataclass(frozen=True)
class _Event:
    type: str
    iteration: int
    detected_at: int


def _naive(times: np.ndarray) -> list[_Event]:
    """Median of the last 20 iterations over the median of the 200 before them: > 1.3 is an
    onset, back under 1.15 (of the level before the onset) a relief."""
    if times.size < 220:
        return []
    last, before = _medians(times, 20), _medians(times, 200)
    events: list[_Event] = []
    level = 0.0
    for t in range(219, times.size):
        now = last[t - 19]
        if not level and now > 1.3 * before[t - 219]:
            level = before[t - 219]
            events.append(_Event("onset", t - 19, t))
        elif level and now < 1.15 * level:
            level = 0.0
            events.append(_Event("relief", t - 19, t))
    return events


def test_a_naive_sliding_median_detector_falls_short():
    corpus = ordinary_corpus(200, 1)
    scores = [score_job(t, _naive(t.times)) for t in corpus]
    negatives = [s for s in scores if not s.positive]
    latencies = [x for s in scores if s.positive for x in s.latencies]
    accuracy = float(np.mean([s.correct for s in scores]))
    fpr = 1.0 - float(np.mean([s.correct for s in negatives]))
    recall = float(np.mean([x is not None for x in latencies]))
    print(f"naive: accuracy {accuracy:.1%}, FPR {fpr:.1%}, event recall {recall:.1%}")
    assert accuracy < 0.9
