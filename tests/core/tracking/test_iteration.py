"""Iteration times from RECORD_DTYPE arrays, offline and online (greyhound 4.2)."""

from __future__ import annotations

import numpy as np
import pytest

from failslow.core.events import RECORD_DTYPE, OpCode
from failslow.core.tracking import IterationTracker, iteration_times

# (op, group, nbytes, offset in seconds from the iteration start)
CALLS = [
    (OpCode.ALLGATHER, 1, 1 << 20, 0.010),
    (OpCode.ALLREDUCE, 1, 4096, 0.050),
    (OpCode.ALLREDUCE, 1, 4096, 0.090),
    (OpCode.ALLREDUCE, 1, 4096, 0.130),
    (OpCode.REDUCE_SCATTER, 2, 1 << 24, 0.200),
    (OpCode.ALLREDUCE, 2, 8, 0.240),
]


def make_records(
    n_iter: int,
    *,
    seed: int = 0,
    offset_jitter: float = 0.0,
    topology_change_at: int | None = None,
    markers: tuple[int, ...] = (),
    calls: list[tuple[OpCode, int, int, float]] = CALLS,
) -> tuple[np.ndarray, np.ndarray]:
    """Records of one rank and the true iteration durations (s); with ``markers``, each
    iteration ends with a step marker of each of these keys (an optimizer step each)."""
    rng = np.random.default_rng(seed)
    rows: list[tuple[float, int, int, int]] = []
    t = 0.0
    for k in range(5):  # start-up: parameter broadcast and barriers
        rows.append((t, int(OpCode.BROADCAST), 9, 1000 + k))
        rows.append((t + 0.001, int(OpCode.BARRIER), 9, 0))
        t += 0.01
    durations = []
    for i in range(n_iter):
        shift = 100 if topology_change_at is not None and i >= topology_change_at else 0
        d = 0.3 * float(np.exp(rng.normal(0, 0.03)))
        for op, group, nbytes, off in calls:
            off += offset_jitter * float(rng.normal())
            rows.append((t + off, int(op), group + shift, nbytes))
        if i % 10 == 9:  # logging all-reduce every 10 steps
            rows.append((t + 0.27, int(OpCode.ALLREDUCE), 3, 4))
        if i % 100 == 99:  # eval burst every 100 steps, which also takes time
            for j in range(5):
                rows.append((t + 0.28 + 0.01 * j, int(OpCode.ALLREDUCE), 4, 16 + j % 2))
            d += 0.2
        for k, key in enumerate(markers):
            rows.append((t + d - 1e-4 * (len(markers) - k), int(OpCode.STEP), key, 0))
        durations.append(d)
        t += d
    rec = np.zeros(len(rows), dtype=RECORD_DTYPE)
    times = np.array([r[0] for r in rows])
    rec["t_start_ns"] = np.round(times * 1e9).astype(np.int64)
    rec["t_end_ns"] = rec["t_start_ns"] + 1000
    rec["op"] = [r[1] for r in rows]
    rec["group_key"] = [r[2] for r in rows]
    rec["nbytes"] = [r[3] for r in rows]
    rec["commit"] = np.arange(1, len(rows) + 1)
    return rec, np.array(durations)


def test_offline_matches_ground_truth() -> None:
    rec, truth = make_records(400)
    result = iteration_times(rec)
    assert result.period_calls == len(CALLS)
    assert len(result) == truth.size - 1
    np.testing.assert_allclose(result.seconds, truth[:-1], rtol=1e-6)
    assert np.all(np.diff(result.end_ns) > 0)


def test_offset_jitter_keeps_error_small() -> None:
    rec, truth = make_records(400, offset_jitter=0.002, seed=2)
    result = iteration_times(rec[np.argsort(rec["t_start_ns"])])
    err = np.abs(result.seconds / truth[: len(result)] - 1)
    assert np.median(err) < 0.012  # greyhound 7.2 reports < 1.2%


def test_unsorted_records_are_ordered_by_start_time() -> None:
    rec, truth = make_records(200)
    shuffled = rec[np.random.default_rng(0).permutation(rec.size)]
    np.testing.assert_allclose(iteration_times(shuffled).seconds, truth[:-1], rtol=1e-6)


def feed_in_random_chunks(tracker: IterationTracker, rec: np.ndarray, seed: int) -> np.ndarray:
    """Every iteration time the tracker gives for ``rec`` fed in chunks of 1-399 records."""
    rng = np.random.default_rng(seed)
    parts, i = [], 0
    while i < rec.size:
        step = int(rng.integers(1, 400))
        parts.append(tracker.feed(rec[i : i + step]))
        i += step
    parts.append(tracker.flush())
    return np.concatenate(parts)


@pytest.mark.parametrize("seed", [0, 1])
def test_online_equals_offline(seed: int) -> None:
    rec, _ = make_records(600, seed=seed)
    offline = iteration_times(rec)
    tracker = IterationTracker()
    online = feed_in_random_chunks(tracker, rec, seed)
    np.testing.assert_array_equal(online, offline.seconds)
    assert tracker.period_calls == offline.period_calls


def test_redetects_after_topology_change() -> None:
    rec, truth = make_records(1200, topology_change_at=600)
    tracker = IterationTracker(window=2048)
    online = np.concatenate([tracker.feed(rec[i : i + 97]) for i in range(0, rec.size, 97)])
    assert tracker.period_calls == len(CALLS)
    assert online.size > 1100  # only the iterations around the change are lost
    assert np.median(np.abs(online / np.median(truth) - 1)) < 0.05
    assert online.max() < 2 * truth.max()


def test_memory_is_bounded() -> None:
    rec, _ = make_records(3000)
    tracker = IterationTracker(window=512, min_tokens=128, retry=128, recheck=512)
    for i in range(0, rec.size, 50):
        tracker.feed(rec[i : i + 50])
        assert tracker._len <= 2 * 512
    assert tracker.period_calls == len(CALLS)


def test_bad_records() -> None:
    with pytest.raises(ValueError, match="RECORD_DTYPE"):
        iteration_times(np.zeros(10))
    tracker = IterationTracker(min_tokens=64, retry=64)
    rec, _ = make_records(200)
    out = [tracker.feed(rec[:600]), tracker.feed(rec[700:]), tracker.feed(rec[600:700])]
    assert np.all(np.concatenate(out) > 0)  # late, older records never give negative times


def test_step_markers_measure_the_step_end() -> None:
    """Where the hook marked each optimizer step's end, iterations are the gaps between the
    markers: exact while the anchor call wanders within the step (it does not, by 3%)."""
    rec, truth = make_records(400, offset_jitter=0.01, seed=3, markers=(77,))
    result = iteration_times(rec)
    assert result.period_calls == len(CALLS)
    np.testing.assert_allclose(result.seconds, truth[1:], rtol=1e-6)
    calls_only = iteration_times(rec[rec["op"] != int(OpCode.STEP)])
    err = np.abs(calls_only.seconds / truth[: len(calls_only)] - 1)
    assert np.median(err) > 0.01  # what the markers are for


@pytest.mark.parametrize("seed", [0, 1])
def test_markers_online_equals_offline_in_one_epoch(seed: int) -> None:
    rec, truth = make_records(600, seed=seed, markers=(77,))
    tracker = IterationTracker()
    np.testing.assert_allclose(feed_in_random_chunks(tracker, rec, seed), truth[1:], rtol=1e-6)
    assert tracker.marked and tracker.period_calls == len(CALLS)
    assert tracker.epoch == 0, "finding the period later changes nothing that was measured"


def test_markers_keep_measuring_across_a_topology_change_in_a_new_epoch() -> None:
    rec, truth = make_records(1200, topology_change_at=600, markers=(77,))
    tracker = IterationTracker(window=2048)
    online = np.concatenate([tracker.feed(rec[i : i + 97]) for i in range(0, rec.size, 97)])
    np.testing.assert_allclose(online, truth[1:], rtol=1e-6)  # nothing lost
    assert tracker.epoch == 1 and tracker.period_calls == len(CALLS)


def test_between_markers_the_acf_is_fed_in_batches_and_sees_a_new_pattern_soon() -> None:
    """Fed one step at a time (a poll per iteration), the calls reach the ACF every
    ``ACF_EVERY`` markers: the times are the same, and the topology change starts the new
    epoch at most ``ACF_EVERY`` iterations after a tracker fed at every marker sees it."""
    rec, truth = make_records(1200, topology_change_at=600, markers=(77,))
    ends = np.flatnonzero(rec["op"] == int(OpCode.STEP)) + 1
    seen = {}
    for every in (1, IterationTracker.ACF_EVERY):
        tracker = IterationTracker(window=2048)
        tracker.ACF_EVERY = every
        times, epoch_at = [], None
        for step, chunk in enumerate(np.split(rec, ends)):
            times.append(tracker.feed(chunk))
            if epoch_at is None and tracker.epoch:
                epoch_at = step
        np.testing.assert_allclose(np.concatenate(times), truth[1:], rtol=1e-6)
        assert tracker.epoch == 1 and tracker.period_calls == len(CALLS)
        seen[every] = epoch_at
    later = seen[IterationTracker.ACF_EVERY]
    assert seen[1] is not None and 600 < seen[1] <= later < seen[1] + IterationTracker.ACF_EVERY


def test_markers_measure_a_step_without_a_once_per_step_call() -> None:
    """Identical layers and no light call: no call occurs once per step. The ACF anchors on
    a sequence (the last reduce-scatter, then the first all-gather); the markers give every
    iteration exactly and the calls between them the period."""
    layers = [(OpCode.ALLGATHER, 1, 1 << 20, 0.01 + 0.02 * k) for k in range(8)]
    layers += [(OpCode.REDUCE_SCATTER, 1, 1 << 22, 0.17 + 0.01 * k) for k in range(8)]
    plain, truth = make_records(300, calls=layers)
    shim_only = iteration_times(plain[plain["op"] != int(OpCode.BROADCAST)])
    assert shim_only.period_calls == len(layers) and len(shim_only) >= 297
    # from one step's first all-gather to the next one's: each step after the first, exactly
    np.testing.assert_allclose(shim_only.seconds, truth[1 : 1 + len(shim_only)], rtol=1e-6)
    rec, truth = make_records(300, calls=layers, markers=(5,))
    result = iteration_times(rec)
    np.testing.assert_allclose(result.seconds, truth[1:], rtol=1e-6)
    # the extras of steps 9, 19, ... (a logging all-reduce) are not the period
    assert result.period_calls == len(layers)


def test_chained_optimizers_are_measured_on_one_key() -> None:
    rec, truth = make_records(300, markers=(5, 6))
    np.testing.assert_allclose(iteration_times(rec).seconds, truth[1:], rtol=1e-6)


def test_a_rebuilt_optimizer_over_other_parameters_is_followed_in_a_new_epoch() -> None:
    first, truth_a = make_records(200, markers=(5,))
    second, truth_b = make_records(200, seed=1, markers=(6,))
    second["t_start_ns"] += int(first["t_start_ns"].max()) + 10**9
    second["t_end_ns"] += int(first["t_start_ns"].max()) + 10**9
    tracker = IterationTracker()
    got = np.concatenate([tracker.feed(first), tracker.feed(second), tracker.flush()])
    assert tracker.epoch == 1
    np.testing.assert_allclose(got[: truth_a.size - 1], truth_a[1:], rtol=1e-6)
    # key 6 is followed from its third marker on
    np.testing.assert_allclose(got[truth_a.size - 1 :], truth_b[3:], rtol=1e-6)


@pytest.mark.parametrize("max_tokens", [10, 1 << 16])
@pytest.mark.parametrize("batch", [1, 7, 64, 65, 500])
def test_token_ids_do_not_depend_on_how_records_are_batched(batch: int, max_tokens: int) -> None:
    """A poll's few records are coded one by one in Python, bigger batches with np.unique:
    both give every key the same id (new keys numbered in key order), so the ACF - and its
    tie-breaks between anchors - sees the same tokens online as offline."""
    from failslow.core.tracking.iteration import TokenCoder

    rng = np.random.default_rng(batch)
    recs = np.zeros(500, dtype=RECORD_DTYPE)
    recs["op"] = rng.integers(0, 5, recs.size)
    recs["group_key"] = rng.integers(0, 3, recs.size).astype(np.uint64) * np.uint64(2**61)
    recs["nbytes"] = rng.integers(0, 4, recs.size) * 1000
    online = TokenCoder(max_tokens)
    ids = np.concatenate([online.encode(recs[i : i + batch]) for i in range(0, 500, batch)])
    vectorized = TokenCoder(max_tokens)
    vectorized.SMALL = 0  # every batch through np.unique
    expected = np.concatenate(
        [vectorized.encode(recs[i : i + batch]) for i in range(0, 500, batch)]
    )
    assert ids.tolist() == expected.tolist()
