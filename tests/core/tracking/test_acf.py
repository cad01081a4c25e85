"""ACF period detection on synthetic token sequences (greyhound 4.2)."""

from __future__ import annotations

import numpy as np
import pytest

from failslow.core.tracking import acf, dominant_pattern, find_period

ITERATION = [1, 2, 3, 2, 3, 4, 5]  # repeated tokens inside one iteration, as in real traces


def training_tokens(
    n_iter: int,
    *,
    startup: int = 0,
    log_every: int = 0,
    eval_every: int = 0,
    swaps: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    seq = list(range(100, 100 + startup))  # broadcast, barriers, ... before training
    for i in range(n_iter):
        it = list(ITERATION)
        if swaps and rng.random() < swaps:  # two async calls completing out of order
            k = int(rng.integers(0, len(it) - 1))
            it[k], it[k + 1] = it[k + 1], it[k]
        seq += it
        if log_every and i % log_every == log_every - 1:
            seq.append(50)  # a logging all-reduce
        if eval_every and i % eval_every == eval_every - 1:
            seq += [60, 61, 62, 60, 61, 62, 63]  # an eval burst
    return np.array(seq, dtype=np.int64)


def test_exact_period() -> None:
    assert find_period(training_tokens(200)) == len(ITERATION)


def test_acf_scores_one_at_the_period_and_low_at_sub_periods() -> None:
    values = acf(training_tokens(200), 14)
    assert values[len(ITERATION) - 1] == pytest.approx(1.0)
    assert values[2 * len(ITERATION) - 1] == pytest.approx(1.0)
    assert values[: len(ITERATION) - 1].max() < 0.5


def test_startup_logging_and_eval_bursts() -> None:
    tokens = training_tokens(600, startup=12, log_every=10, eval_every=100)
    assert find_period(tokens) == len(ITERATION)
    pattern = dominant_pattern(tokens)
    assert pattern is not None
    assert set(pattern.kept.tolist()) == set(ITERATION)
    assert pattern.anchor in (1, 4, 5)  # occurs exactly once per iteration


def test_jittered_call_order() -> None:
    tokens = training_tokens(500, startup=5, log_every=10, swaps=0.02, seed=3)
    assert find_period(tokens) == len(ITERATION)


def test_no_period_in_random_tokens() -> None:
    rng = np.random.default_rng(1)
    assert find_period(rng.integers(0, 50, 3000)) is None


def test_single_token_and_short_input() -> None:
    assert find_period(np.zeros(50, dtype=np.int64)) == 1
    assert find_period(np.array([1, 2], dtype=np.int64)) is None


@pytest.mark.parametrize("bad", [np.zeros((3, 3), dtype=np.int64), np.array([0.5, 1.5, 2.5, 3.5])])
def test_bad_tokens(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="tokens"):
        find_period(bad)


def test_bad_threshold() -> None:
    with pytest.raises(ValueError, match=r"1\.5"):
        find_period(training_tokens(10), threshold=1.5)


# -- what the call-log hold-out missed (issue 47): tokens with sizes, as the tracker sees them --


def _with_sizes(steps: list[list[tuple[int, int]]], prefix: list[tuple[int, int]] = ()):  # type: ignore[assignment]
    calls = [*prefix, *(c for step in steps for c in step)]
    tokens = np.array([tok for tok, _ in calls], dtype=np.int64)
    nbytes = np.array([b for _, b in calls], dtype=np.float64)
    return tokens, nbytes


def test_identical_layers_are_anchored_by_a_sequence_of_calls() -> None:
    """FSDP over identical layers, no loss all-reduce: an all-gather per layer forward, an
    all-gather and a reduce-scatter per layer backward - no call occurs once per step, so the
    anchor is the step's last reduce-scatter followed by its next all-gathers."""
    ag, rs, layers = (1, 8 << 20), (2, 4 << 20), 6
    step = [ag] * layers + [ag] + [ag, rs] * (layers - 1) + [rs]
    tokens, nbytes = _with_sizes([step] * 200)
    pattern = dominant_pattern(tokens, nbytes=nbytes)
    assert pattern is not None and pattern.period == len(step)
    assert pattern.context  # a sequence, not one call
    gram = [*pattern.context, pattern.anchor]
    kinds = [tok for tok, _ in step * 2]
    hits = [i for i in range(len(step)) if kinds[i : i + len(gram)] == gram]
    assert len(hits) == 1  # once per step


def test_reordered_prefetches_are_found_by_a_call_once_per_step() -> None:
    """ZeRO-3 prefetching: adjacent calls swap in most steps, so no lag's ACF reaches 0.95;
    the embedding's reduce-scatter still recurs once per step, one step's calls apart."""
    rng = np.random.default_rng(4)
    modules = [(10 + k, (3 + k) << 20) for k in range(3)]
    fwd = [(1, 90 << 20)] + [(t, b) for _ in range(6) for t, b in modules]
    bwd = [c for t, b in reversed(modules * 6) for c in ((t, b), (t + 10, b))] + [(2, 90 << 20)]
    steps = []
    for _ in range(150):
        step = fwd + bwd + [(3, 4)]
        for k in np.flatnonzero(rng.random(len(step) - 1) < 0.3):
            step[k], step[k + 1] = step[k + 1], step[k]
        steps.append(step)
    tokens, nbytes = _with_sizes(steps)
    period = len(fwd + bwd) + 1
    assert acf(tokens, 2 * period).max() < 0.95  # no lag's ACF reaches the threshold
    pattern = dominant_pattern(tokens, nbytes=nbytes)
    assert pattern is not None and pattern.period == period
    assert find_period(tokens) == period  # sizes unknown: the same


def test_a_pipeline_step_is_closed_by_its_gradient_reduce_scatter_after_a_warm_up() -> None:
    """The last stage of a 1F1B pipeline: receive, send for each of 16 micro-batches, then
    small gradient buckets (under a tenth of the step's bytes) once per step; before the first
    step, a warm-up loop of small all-reduces and an evaluation of 40 batches (its receives
    look like the micro-batches). The step, not the micro-batch, is the period."""
    recv, send = (1, 16 << 20), (2, 16 << 20)
    step = [recv, send] * 16 + [(3, 20 << 20), (4, 4), (5, 4), (6, 20 << 20)]
    prefix = [(7, 1024)] * 150 + [recv] * 16 * 40
    tokens, nbytes = _with_sizes([step] * 200, prefix)
    pattern = dominant_pattern(tokens[:8192], nbytes=nbytes[:8192])
    assert pattern is not None and pattern.period == len(step)
