"""An S2 plan's step time from the ranks' step profiles (measured_step)."""

from __future__ import annotations

from typing import Any

import pytest

from failslow.core.planner.measured_step import MeasuredSteps, ReplicaStep, ranks_to_read
from failslow.core.topology import Topology

DP4 = Topology.megatron(tp=1, dp=4, pp=1, gpus_per_host=1, micro_batches=16)
PP2 = Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=1, micro_batches=8)


def _record(calls: int, spacing: float, rest: float, rest_low: float) -> dict[str, Any]:
    profile = {"calls": calls, "spacing": spacing, "rest": rest, "rest_low": rest_low}
    return {"step": 90, "profile": profile}


def test_slow_replica_keeps_its_rest_healthy_ones_their_rest_without_the_wait() -> None:
    # rank 2 is 2.5x slower per micro-batch; rank 0 waits ~0.45 s for it at every reduction
    records = {2: _record(4, 0.25, 0.2, 0.1), 0: _record(4, 0.1, 0.65, 0.15)}
    assert ranks_to_read(DP4, [2]) == [2, 0]
    model = MeasuredSteps.from_records(DP4, (4, 4, 4, 4), records, [2])
    assert model is not None
    assert model.replicas[2] == ReplicaStep(0.25, 0.2)
    assert model.replicas[0] == model.replicas[3] == ReplicaStep(0.1, 0.15)
    assert model.step_s((4, 4, 4, 4)) == pytest.approx(0.2 + 4 * 0.25)
    assert model.step_s((5, 5, 1, 5)) == pytest.approx(0.15 + 5 * 0.1)
    assert model.step_s((4, 5, 2, 5)) == pytest.approx(max(0.2 + 2 * 0.25, 0.15 + 5 * 0.1))


def test_calls_per_micro_batch_come_from_the_counts_in_effect() -> None:
    # interleaved pipeline: two model chunks, so two forward_step calls per micro-batch; the
    # records were measured under (6, 2) (a plan in effect)
    rank_of = PP2.replica_ranks
    slow, healthy = rank_of(1)[0], rank_of(0)[0]
    records = {slow: _record(4, 0.1, 0.3, 0.3), healthy: _record(12, 0.05, 0.4, 0.2)}
    model = MeasuredSteps.from_records(PP2, (6, 2), records, [slow])
    assert model is not None
    assert model.replicas[1].per_microbatch_s == pytest.approx(0.2)
    assert model.replicas[0].per_microbatch_s == pytest.approx(0.1)
    assert model.step_s((7, 1)) == pytest.approx(max(0.2 + 0.7, 0.3 + 0.2))


def test_a_missing_or_malformed_profile_gives_no_estimate() -> None:
    good = _record(4, 0.1, 0.2, 0.1)
    assert MeasuredSteps.from_records(DP4, (4,) * 4, {2: good, 0: {"step": 3}}, [2]) is None
    assert MeasuredSteps.from_records(DP4, (4,) * 4, {2: None, 0: good}, [2]) is None
    bad = {"profile": {"calls": "x", "spacing": 0.1, "rest": 0.1, "rest_low": 0.1}}
    assert MeasuredSteps.from_records(DP4, (4,) * 4, {2: bad, 0: good}, [2]) is None


def test_every_replica_diagnosed_needs_no_healthy_record() -> None:
    records = {r: _record(4, 0.1 * (r + 1), 0.2, 0.1) for r in range(4)}
    assert ranks_to_read(DP4, range(4)) == [0, 1, 2, 3]
    model = MeasuredSteps.from_records(DP4, (4,) * 4, records, range(4))
    assert model is not None and model.step_s((7, 5, 3, 1)) == pytest.approx(0.2 + 5 * 0.2)


def test_the_slowest_optimizer_is_paid_once_after_the_reduction() -> None:
    slow = {"calls": 4, "spacing": 0.25, "rest": 0.2, "rest_low": 0.1, "post": 0.3}
    healthy = {"calls": 4, "spacing": 0.1, "rest": 0.65, "rest_low": 0.15, "post": 0.31}
    healthy["post_low"] = 0.05  # before the slowdown; now it waits for the slow optimizer
    slow["post_low"] = 0.04
    records = {2: {"profile": slow}, 0: {"profile": healthy}}
    model = MeasuredSteps.from_records(DP4, (4, 4, 4, 4), records, [2])
    assert model is not None
    assert model.replicas[2] == ReplicaStep(0.25, 0.2, 0.3)
    assert model.replicas[0] == ReplicaStep(0.1, 0.15, 0.05)
    assert model.step_s((5, 5, 1, 5)) == pytest.approx(max(0.15 + 0.5, 0.2 + 0.25) + 0.3)
