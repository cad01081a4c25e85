"""ACF period detection on synthetic token sequences (greyhound 4.2)."""

from __future__ import annotations

import numpy as np
import pytest

from failslow.core.tracking import acf, dominant_pattern, find_period

ITERATION = [1, 2, 3, 2, 3, 4, 5]  # repeated tokens inside one iteration, as in real traces


def training_tokens(
    n_iter: int, *, startup: int = 0, log_every: int = 0, eval_every: int = 0, swaps: float = 0.0,
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
