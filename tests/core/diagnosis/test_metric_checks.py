"""Real-time metric checks (byterobust 4.1): failslow.core.diagnosis.metrics."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.config import load_config
from failslow.core.diagnosis.metrics import INF, JUMP, NAN, MetricCheck, watched
from failslow.errors import ConfigError


def test_nan_and_inf_are_incidents_at_once_even_on_the_first_step() -> None:
    check = MetricCheck()
    incident = check.observe(0, {"loss": math.nan})
    assert incident is not None and (incident.kind, incident.step, incident.metric) == (
        NAN, 0, "loss",
    )  # fmt: skip
    incident = MetricCheck().observe(3, {"grad_norm": math.inf})
    assert incident is not None and incident.kind == INF
    assert "grad_norm is inf at step 3" in incident.describe()
    assert incident.to_dict()["value"] == "inf"  # JSON has no inf


def test_a_five_fold_jump_against_the_median_is_an_incident_a_fall_never_is() -> None:
    check = MetricCheck(jump=5.0, window=8, warmup=4)
    # a loss falling fast, with noise: never an incident
    for step, value in enumerate([9.0, 4.0, 2.5, 2.0, 1.9, 2.1, 1.8, 0.2, 0.01]):
        assert check.observe(step, {"train/loss": value}) is None
    check = MetricCheck(jump=5.0, window=8, warmup=4)
    for step, value in enumerate([1.0, 1.2, 0.9, 1.1, 1.0]):
        assert check.observe(step, {"loss": value}) is None
    assert check.observe(5, {"loss": 4.9}) is None  # 4.9x the median 1.0: not yet
    incident = check.observe(6, {"loss": 6.0})
    assert incident is not None and incident.kind == JUMP
    assert incident.level == pytest.approx(1.0, abs=0.11)
    assert "5." in incident.describe() or "6." in incident.describe()


def test_no_jump_before_warmup_and_a_spike_does_not_become_the_level() -> None:
    check = MetricCheck(jump=5.0, window=16, warmup=4)
    assert check.observe(0, {"loss": 1.0}) is None
    assert check.observe(1, {"loss": 100.0}) is None  # 2 values seen: no level yet
    for step in range(2, 6):
        assert check.observe(step, {"loss": 1.0}) is None
    # the median of [1, 100, 1, 1, 1, 1] is 1: one spike does not lift the level
    assert check.observe(6, {"loss": 5.0}) is not None


def test_only_losses_and_gradient_norms_are_watched() -> None:
    assert all(watched(n) for n in ("loss", "train/loss", "lm loss", "val_loss", "grad_norm",
                                     "grad-norm", "optim/gradnorm", "Grad Norm"))  # fmt: skip
    assert not any(watched(n) for n in ("loss_scale", "lr", "tokens_per_s", "mfu"))
    check = MetricCheck(warmup=1)
    assert check.observe(0, {"lr": math.nan, "loss_scale": 1.0}) is None
    assert check.observe(1, {"loss_scale": 1e9, "lr": 1e9}) is None


def test_jump_zero_checks_only_nan_and_inf() -> None:
    check = MetricCheck(jump=0, window=4, warmup=1)
    for step, value in enumerate([1.0, 1.0, 1e6]):
        assert check.observe(step, {"loss": value}) is None
    assert check.observe(3, {"loss": math.nan}) is not None


def test_the_checks_section_is_validated_in_one_line() -> None:
    assert load_config({"checks": {"jump": 3}}, environ={}).checks.jump == 3.0
    assert load_config({"checks": {"jump": 0}}, environ={}).checks.jump == 0.0
    with pytest.raises(ConfigError, match="jump 0 \\(off\\) or > 1"):
        load_config({"checks": {"jump": 0.5}}, environ={})
    with pytest.raises(ConfigError, match="warmup <= window"):
        load_config({"checks": {"warmup": 40}}, environ={})
    with pytest.raises(ConfigError, match="unknown key 'factor' in section 'checks'"):
        load_config({"checks": {"factor": 5}}, environ={})


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=80),
    jump=st.floats(1.5, 10.0),
)
def test_property_an_incident_is_exactly_a_value_at_least_jump_times_the_median_before_it(
    values: list[float], jump: float
) -> None:
    """Against a direct computation: the first value >= jump x the median of the (at most
    window) values before it, once warmup were seen; values after it are not checked."""
    import statistics

    window, warmup = 8, 3
    check = MetricCheck(jump=jump, window=window, warmup=warmup)
    seen: list[float] = []
    for step, value in enumerate(values):
        incident = check.observe(step, {"loss": value})
        recent = seen[-window:]
        expected = len(recent) >= warmup and value >= jump * statistics.median(recent)
        assert (incident is not None) == expected
        if incident is not None:
            return
        seen.append(value)


def test_the_history_a_snapshot_keeps_lets_a_restarted_rank_see_the_same_jump() -> None:
    """A rank restarted from memory takes up the recent values kept in its snapshot: a jump
    right after the restart is seen against the job's level, not missed for the warmup."""
    check = MetricCheck(jump=5.0, window=4, warmup=3)
    for step, value in enumerate([0.03, 0.029, 0.031, 0.03, 0.028]):
        assert check.observe(step, {"grad_norm": value, "lr": 1.0}) is None
    kept = check.history()
    assert kept == {"grad_norm": [0.029, 0.031, 0.03, 0.028]}  # the last window of it
    restarted = MetricCheck(jump=5.0, window=4, warmup=3)
    assert restarted.observe(5, {"grad_norm": 47.1}) is None  # from scratch: warming up
    restarted = MetricCheck(jump=5.0, window=4, warmup=3)
    restarted.load(kept)
    incident = restarted.observe(5, {"grad_norm": 47.1})
    assert incident is not None and incident.level == pytest.approx(0.0295)
