"""DurationPrior (greyhound 3's characterization as a lognormal): closed forms against samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from failslow.core.diagnosis.record import Kind
from failslow.core.planner.duration_prior import DurationPrior, DurationPriors
from failslow.errors import ConfigError


@pytest.mark.parametrize("t", [0.0, 60.0, 300.0, 900.0, 2400.0])
def test_survival_and_mean_residual_match_a_million_samples(t):
    prior = DurationPrior(600.0, 1.0)
    samples = np.random.default_rng(0).lognormal(prior.mu, prior.sigma, 1_000_000)
    assert samples.mean() == pytest.approx(600.0, rel=0.01)
    left = samples[samples > t]
    assert prior.survival(t) == pytest.approx(left.size / samples.size, abs=2e-3)
    # sampling error of a heavy tail's conditional mean: a few percent at the far end
    assert prior.mean_residual(t) == pytest.approx((left - t).mean(), rel=0.03)


def test_a_fail_slow_that_has_lasted_long_is_expected_to_last_longer():
    prior = DurationPrior(600.0, 1.0)
    times = [300.0, 600.0, 1200.0, 3600.0, 36_000.0]
    residuals = [prior.mean_residual(t) for t in times]
    assert residuals == sorted(residuals) and residuals[-1] > 10 * prior.mean_s


def test_the_far_tail_switches_to_the_asymptote_without_a_jump():
    prior = DurationPrior(600.0, 1.0)
    t = math.exp(prior.mu + 32.0 * prior.sigma)  # P(D > t) ~ 1e-225: still the exact form
    exact = prior.mean_residual(t)
    asymptote = t * prior.sigma**2 / (math.log(t) - prior.mu - prior.sigma**2)
    assert exact == pytest.approx(asymptote, rel=0.01)
    beyond = prior.mean_residual(t * 1e6)  # the tail underflows: the asymptote itself
    assert math.isfinite(beyond) and beyond > exact


def test_characterization_picks_the_communication_mean_by_job_size():
    small, large = DurationPriors.characterization(256), DurationPriors.characterization(512)
    assert small.of(Kind.COMPUTE).mean_s == large.of(Kind.COMPUTE).mean_s == 600.0
    assert small.of(Kind.COMMUNICATION).mean_s == 24 * 60.0
    assert large.of(Kind.COMMUNICATION).mean_s == 72 * 60.0
    assert large.of(Kind.BOTH) is large.communication


@pytest.mark.parametrize(
    ("mean", "sigma", "message"),
    [(0.0, 1.0, "mean must be > 0"), (60.0, -1.0, "sigma must be > 0"), (math.inf, 1.0, "mean")],
)
def test_bad_priors_are_one_line_errors(mean, sigma, message):
    with pytest.raises(ConfigError, match=message):
        DurationPrior(mean, sigma)
