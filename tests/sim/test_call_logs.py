"""The call-log corpus (issue 47's event logs) and the iteration tracker on it."""

from __future__ import annotations

import numpy as np
import pytest

from failslow.core.tracking import iteration_times
from failslow.core.tracking.iteration import TokenCoder
from failslow.sim.call_logs import FRAMEWORKS, call_log_corpus


@pytest.fixture(scope="module")
def logs():
    return call_log_corpus(24, seed=5)


def test_logs_are_in_issue_order_and_hold_every_step(logs) -> None:
    for log in logs:
        starts = log.records["t_start_ns"]
        assert (np.diff(starts) >= 0).all()
        steps = log.trace.times.size
        assert log.records.size >= log.startup_calls + steps * log.period
    assert {log.framework for log in logs} == set(FRAMEWORKS)
    variants = {v for log in logs for v in log.variant.split(", ")}
    assert {"homogeneous", "reordered", "periodic start-up"} <= variants


def test_homogeneous_layers_make_no_call_once_per_step(logs) -> None:
    for log in (x for x in logs if "homogeneous" in x.variant):
        tokens = TokenCoder().encode(log.records)
        _, counts = np.unique(tokens, return_counts=True)
        assert not (np.abs(counts - log.trace.times.size) <= 2).any()


def test_the_tracker_finds_every_log_s_period_and_iterations(logs) -> None:
    for log in logs:
        result = iteration_times(log.records)
        truth = log.trace.times.size
        assert result.period_calls == log.period, (log.job_id, log.variant)
        assert abs(len(result) - truth) <= 0.03 * truth, (log.job_id, log.variant)
