"""An S2 plan's step time from the ranks' step profiles (measured_step)."""

from __future__ import annotations

from typing import Any

import pytest

from failslow.core.planner.allocation import even_counts
from failslow.core.planner.measured_step import (
    MeasuredSteps,
    ReplicaStep,
    ranks_to_read,
    resized_step_s,
)
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


def test_expected_max_of_scattering_replicas() -> None:
    import math
    import random

    from failslow.core.planner.measured_step import expected_max

    assert expected_max([(0.3, 0.0), (0.5, 0.0), (0.4, 0.0)]) == 0.5
    # two equal normals: mu + sigma / sqrt(pi) (exact)
    assert expected_max([(1.0, 0.1), (1.0, 0.1)]) == pytest.approx(1.0 + 0.1 / math.sqrt(math.pi))
    # far apart: the larger mean, scatter or not
    assert expected_max([(1.0, 0.01), (2.0, 0.01)]) == pytest.approx(2.0)
    # four replicas, one slower and noisier: Clark's approximation against sampling
    parts = [(0.12, 0.03)] * 3 + [(0.10, 0.07)]
    rng = random.Random(0)
    n = 200_000
    sampled = sum(max(rng.gauss(m, s) for m, s in parts) for _ in range(n)) / n
    assert expected_max(parts) == pytest.approx(sampled, rel=0.02)


def test_a_balanced_plan_expects_the_slowest_of_scattering_replicas() -> None:
    slow = {"calls": 4, "spacing": 0.04, "rest": 0.04, "post": 0.04, "rest_low": 0.01}
    slow |= {"post_low": 0.01, "pre_sd": 0.08, "work_sd": 0.06}
    healthy = {"calls": 4, "spacing": 0.01, "rest": 0.17, "post": 0.04, "rest_low": 0.01}
    healthy |= {"post_low": 0.01, "pre_sd": 0.09, "work_sd": 0.006}
    topology = Topology.megatron(tp=1, dp=2, pp=1, gpus_per_host=1, micro_batches=8)
    model = MeasuredSteps.from_records(
        topology, (4, 4), {1: {"profile": slow}, 0: {"profile": healthy}}, [1]
    )
    assert model is not None
    healthy_part, slow_part = model.replicas
    assert healthy_part.rest_var == 0.0  # its spread before the optimizer is the wait
    assert slow_part.rest_var == pytest.approx(0.08**2 - 0.06**2)
    assert slow_part.until_optimizer_sd(1) == pytest.approx(
        (0.08**2 - 0.06**2 + 0.06**2 / 4) ** 0.5
    )
    means = 0.01 + 7 * 0.01, 0.04 + 0.04  # (7, 1): both replicas reach the reduction at 0.08
    assert model.step_s((7, 1)) > max(means) + 0.04 + 0.01


def test_a_job_that_lost_a_replica_expects_the_survivors_longest_share() -> None:
    """odyssey Eq. 12-13 on a data-parallel job: 16 micro-batches of four replicas on three
    (6, 5, 5): the step is the median replica's rest plus 6 of its micro-batches."""
    profiles = [
        {"calls": 4, "spacing": x, "rest": 0.3, "rest_low": 0.1, "post": 0.05, "post_low": 0.05}
        for x in (0.1, 0.11, 0.12, 0.5)  # the last one's profile is an outlier
    ]
    assert even_counts(16, 3) == (6, 5, 5) and even_counts(16, 4) == (4, 4, 4, 4)
    got = resized_step_s(profiles, [4, 4, 4, 4], even_counts(16, 3))
    assert got == pytest.approx((0.1 + 4 * 0.12 + 0.05, 0.1 + 6 * 0.12 + 0.05))
    assert resized_step_s([profiles[0], None, None, None], [4] * 4, [6, 5, 5]) is None


def _steps(*parts: tuple[float, float]) -> MeasuredSteps:
    return MeasuredSteps(tuple(ReplicaStep(per_microbatch_s=t, rest_s=r) for t, r in parts))


def test_best_counts_are_sized_from_what_each_replica_measured() -> None:
    """The issue-44 job: the GEMM said 2.4x, the rank's training ran 4x slower; sized from its
    measured time per micro-batch, it gets one micro-batch, not two."""
    healthy, slow = (0.025, 0.01), (0.1, 0.04)
    model = _steps(healthy, healthy, slow, healthy)
    assert model.best_counts(16) == (5, 5, 1, 5)
    # equal replicas: the even split; a fixed part counts (the slow replica's rest is long)
    assert _steps(healthy, healthy).best_counts(8) == (4, 4)
    assert _steps((0.02, 0.0), (0.02, 0.1)).best_counts(12) == (8, 4)
    # among equally fast splits, the one closest to even (moving work costs on shared cores)
    assert _steps((0.03, 0.0), (0.03, 0.0), (0.05, 0.0), (0.03, 0.0)).best_counts(16) == (
        5, 4, 3, 4,
    )  # fmt: skip


def test_best_counts_keep_pipeline_multiples_and_minimums() -> None:
    model = _steps((0.01, 0.0), (0.08, 0.0))
    assert model.best_counts(8, multiple_of=2, minimum=2) == (6, 2)
    with pytest.raises(ValueError, match="multiples of 2"):
        model.best_counts(7, multiple_of=2)


def test_best_counts_is_the_exact_min_max() -> None:
    import itertools
    import random

    rng = random.Random(4)
    for _ in range(200):
        d, total = rng.randint(2, 4), rng.randint(4, 12)
        parts = [(rng.choice([0.01, 0.02, 0.03, 0.05, 0.1]), rng.choice([0.0, 0.01, 0.05]))
                 for _ in range(d)]  # fmt: skip
        if total < d:
            continue
        got = _steps(*parts).best_counts(total)
        assert sum(got) == total and min(got) >= 1

        def slowest(counts: tuple[int, ...], parts: list[tuple[float, float]] = parts) -> float:
            return max(r + m * t for (t, r), m in zip(parts, counts, strict=True))

        best = min(
            slowest(c) for c in itertools.product(range(1, total + 1), repeat=d) if sum(c) == total
        )
        assert slowest(got) == pytest.approx(best, abs=1e-12), (parts, total, got)


def test_a_waiting_replica_is_read_from_its_newest_block_before_the_slowdown() -> None:
    """With the job's healthy step known, the healthy replica's parts are the medians of its
    newest block whose step was healthy (within 10%): its typical rest and optimizer, not the
    low quantiles; where the slowed replica is one rank, its time per micro-batch too, per
    unit of the count it ran then (on a shared CPU its recent micro-batches ran faster while
    it waited, and under a plan every rank is busy again; a pipeline's other stage idles with
    the slowed one under a plan as now: the recent one). Without the healthy step, or without
    such a block, the low quantiles and the recent spacing stay."""
    healthy_step = 4 * 0.1 + 0.15 + 0.05
    blocks = [
        [16, 4, 0.1, 0.15, 0.05, healthy_step, 4],
        [16, 4, 0.1, 0.16, 0.05, healthy_step * 1.05, 4],  # the newest within 10%
        [16, 4, 0.07, 0.8, 0.05, 1.2, 4],  # waiting for the slowed replica
    ]
    waiting = {
        "calls": 4, "spacing": 0.07, "rest": 0.8, "rest_low": 0.1, "post": 0.05,
        "post_low": 0.03, "blocks": blocks, "units": 4,
    }  # fmt: skip
    records = {2: _record(4, 0.25, 0.2, 0.1), 0: {"profile": waiting}}
    model = MeasuredSteps.from_records(DP4, (4,) * 4, records, [2], healthy_step_s=healthy_step)
    assert model is not None and model.calibrated
    assert model.replicas[0] == ReplicaStep(0.1, 0.16, 0.05)
    assert model.replicas[2] == ReplicaStep(0.25, 0.2)
    old = MeasuredSteps.from_records(DP4, (4,) * 4, records, [2])
    assert old is not None and old.replicas[0] == ReplicaStep(0.07, 0.1, 0.03)
    # under a plan (5 micro-batches now): the block's time per micro-batch is still its own
    records[0] = {"profile": {**waiting, "calls": 5, "units": 5}}
    planned = MeasuredSteps.from_records(
        DP4, (5, 5, 2, 4), records, [2], healthy_step_s=healthy_step
    )
    assert planned is not None and planned.replicas[0] == ReplicaStep(0.1, 0.16, 0.05)
    # a slowed replica of two ranks (a pipeline): under a plan its other stage idles with it,
    # as it does now - the waiting replica's recent time per micro-batch, its block's rest
    slow, rep = PP2.replica_ranks(1)[0], PP2.replica_ranks(0)[0]
    pipeline = {slow: _record(4, 0.25, 0.2, 0.1), rep: {"profile": waiting}}
    staged = MeasuredSteps.from_records(PP2, (4, 4), pipeline, [slow], healthy_step_s=healthy_step)
    assert staged is not None and staged.replicas[0] == ReplicaStep(0.07, 0.16, 0.05)
    # no block of healthy steps (the slowdown began before the long window), or no count kept
    for kept in ([blocks[2]], [[16, 4, 0.1, 0.15, 0.05, healthy_step, None]]):
        records[0] = {"profile": {**waiting, "blocks": kept}}
        fallback = MeasuredSteps.from_records(
            DP4, (4,) * 4, records, [2], healthy_step_s=healthy_step
        )
        assert fallback is not None and fallback.replicas[0] == ReplicaStep(0.07, 0.1, 0.03)


def test_the_size_form_measures_the_part_per_call_from_two_counts() -> None:
    """S2 by size: the loop runs its 4 micro-batches whatever the plan, and a micro-batch of a
    quarter of the samples does not take a quarter of the time. Here a call costs 0.03 s plus
    0.02 s per unit, on top of a 0.1 s rest: at 4 units a step is 0.1 + 4 * (0.03 + 0.02) =
    0.3 s, and the linear first guess (0.3 - 0.1) / 4 = 0.05 s per unit predicts 0.15 s at one
    unit, where the replica takes 0.1 + 0.12 + 0.02 = 0.24 s. Until a second count is measured
    the model says it is a guess (a plan from it is a probe); with the probe's count measured
    (2 units: 4 calls of 0.04 s), per unit and the fixed part come out exactly."""
    slow = {"calls": 4, "spacing_now": 0.05, "rest_now": 0.1, "spacing": 0.05, "rest": 0.1,
            "units": 4, "by_size": 8, "blocks": [[16, 4, 0.05, 0.1, 0.0, 0.3, 4]]}  # fmt: skip
    healthy = {"calls": 4, "spacing": 0.02, "rest": 0.5, "rest_low": 0.05, "units": 4}
    records = {2: {"profile": slow}, 0: {"profile": healthy}}
    guess = MeasuredSteps.from_records(DP4, (4,) * 4, records, [2])
    assert guess is not None and not guess.calibrated
    assert guess.replicas[2].until_optimizer_s(1) == pytest.approx(0.15)
    # the probe: 2 units for replica 2; its last steps took 4 calls of 0.04 s, and its rest
    # held 0.03 s of waiting for the others (it is no longer the slowest): the fixed part takes
    # the rest measured where it waited for no one, at 4 units
    probe = {**slow, "spacing_now": 0.04, "rest_now": 0.13, "units": 2}
    probe["blocks"] = [*slow["blocks"], [4, 4, 0.04, 0.1, 0.0, 0.26, 2]]  # its own count: skipped
    records[2] = {"profile": probe}
    fitted = MeasuredSteps.from_records(DP4, (5, 5, 2, 4), records, [2])
    assert fitted is not None and fitted.calibrated
    assert fitted.replicas[2].per_microbatch_s == pytest.approx(0.02)
    assert fitted.replicas[2].rest_s == pytest.approx(0.1 + 4 * 0.03)
    assert fitted.replicas[2].until_optimizer_s(1) == pytest.approx(0.24)
    # the count form (no by_size) reads the same profile as micro-batches: no fit, no guess
    records[2] = {"profile": {**probe, "by_size": None}}
    counted = MeasuredSteps.from_records(DP4, (5, 5, 2, 4), records, [2])
    assert counted is not None and counted.calibrated
    # two counts that do not fit a rising line: the guess stays
    records[2] = {"profile": {**probe, "spacing_now": 0.06}}
    falling = MeasuredSteps.from_records(DP4, (5, 5, 2, 4), records, [2])
    assert falling is not None and not falling.calibrated
