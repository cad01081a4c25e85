"""Bookkeeping calls (light and infrequent) leave the pattern; heavy infrequent calls stay."""

from __future__ import annotations

import numpy as np

from failslow.core.events import RECORD_DTYPE, OpCode
from failslow.core.tracking import IterationTracker, iteration_times
from failslow.core.tracking.acf import bookkeeping_mask


def _records(rows: list[tuple[float, int, int, int]]) -> np.ndarray:
    rec = np.zeros(len(rows), dtype=RECORD_DTYPE)
    rec["t_start_ns"] = [int(r[0] * 1e9) for r in rows]
    rec["t_end_ns"] = rec["t_start_ns"] + 1000
    rec["op"] = [r[1] for r in rows]
    rec["group_key"] = [r[2] for r in rows]
    rec["nbytes"] = [r[3] for r in rows]
    return rec


def ddp_two_buckets(n_iter: int, step_s: float = 0.2) -> list[tuple[float, int, int, int]]:
    """DDP with two gradient buckets per step and a 4-byte loss all-reduce every 10 steps."""
    rows = [(0.0, int(OpCode.BROADCAST), 0, 1_289_984), (0.01, int(OpCode.BARRIER), 0, 0)]
    t = 0.1
    for i in range(n_iter):
        rows.append((t + 0.10, int(OpCode.ALLREDUCE), 0, 1_093_376))
        rows.append((t + 0.15, int(OpCode.ALLREDUCE), 0, 196_608))
        if i % 10 == 0:
            rows.append((t + 0.19, int(OpCode.ALLREDUCE), 0, 4))
        t += step_s
    return rows


def test_short_pattern_with_logging_every_10_steps() -> None:
    """The real demo trace shape: without the bookkeeping filter the period came out as 21."""
    result = iteration_times(_records(ddp_two_buckets(150)))
    assert result.period_calls == 2
    assert len(result) >= 145
    np.testing.assert_allclose(result.seconds, 0.2, rtol=1e-6)


def test_tracker_finds_a_short_pattern_early() -> None:
    tracker = IterationTracker()
    rows = ddp_two_buckets(200)
    rec = _records(rows)
    first_seen = None
    for i in range(0, len(rec), 8):
        if len(tracker.feed(rec[i : i + 8])) and first_seen is None:
            first_seen = i
    assert first_seen is not None and first_seen <= 80  # within ~40 iterations, not 128


def pipeline_steps(n_steps: int, *, grad_norm: bool) -> list[tuple[float, int, int, int]]:
    """16 micro-batches of light p2p per step, then the heavy DP gradient all-reduce."""
    rows = []
    t = 0.0
    for _ in range(n_steps):
        for m in range(16):
            rows.append((t + 0.01 * m, int(OpCode.SEND), 5, 8192))
            rows.append((t + 0.01 * m + 0.005, int(OpCode.RECV), 5, 8192))
        rows.append((t + 0.17, int(OpCode.ALLREDUCE), 6, 4 << 20))
        if grad_norm:  # grad-norm / loss: light, but every step
            rows.append((t + 0.18, int(OpCode.ALLREDUCE), 7, 4))
        t += 0.25
    return rows


def test_pipeline_gradient_allreduce_stays_in_the_iteration() -> None:
    """The step, not the micro-batch, is the iteration."""
    result = iteration_times(_records(pipeline_steps(60, grad_norm=True)))
    assert result.period_calls == 34
    np.testing.assert_allclose(result.seconds, 0.25, rtol=1e-6)


def test_bookkeeping_mask_marks_only_light_infrequent_calls() -> None:
    rec = _records(ddp_two_buckets(50))
    tokens = rec["nbytes"].astype(np.int64)  # nbytes identifies the token here
    mask = bookkeeping_mask(tokens, rec["nbytes"])
    # the 4-byte logging call and the one-off start-up barrier; never the gradient buckets
    assert set(rec["nbytes"][mask].tolist()) == {0, 4}


def test_online_tracker_widens_to_the_step_and_bumps_epoch() -> None:
    """Online, the first attempt (64 calls) sees the micro-batch; a recheck widens it."""
    rec = _records(pipeline_steps(60, grad_norm=False))
    tracker = IterationTracker()
    out = [tracker.feed(rec[i : i + 16]) for i in range(0, len(rec), 16)]
    assert tracker.period_calls == 33 and tracker.epoch >= 2
    np.testing.assert_allclose(out[-1], 0.25, rtol=1e-6)


def test_megatron_1f1b_stage_with_light_once_per_step_calls() -> None:
    """The real Megatron PP=2 x DP=2 stage-0 pattern (12 calls): 1F1B p2p, then DP syncs.

    The only calls that occur once per step are light; they must stay (they are the anchors).
    """
    step = [(int(OpCode.SEND), 9, 1 << 20), (int(OpCode.SEND), 9, 1 << 20),
            (int(OpCode.RECV), 10, 1 << 20), (int(OpCode.SEND), 9, 1 << 20),
            (int(OpCode.RECV), 10, 1 << 20), (int(OpCode.SEND), 9, 1 << 20),
            (int(OpCode.RECV), 10, 1 << 20), (int(OpCode.RECV), 10, 1 << 20),
            (int(OpCode.ALLREDUCE), 1, 2 << 20), (int(OpCode.ALLREDUCE), 1, 4096),
            (int(OpCode.ALLREDUCE), 1, 2 << 20), (int(OpCode.ALLREDUCE), 2, 2048)]
    rows = []
    t = 0.0
    for _ in range(40):
        rows += [(t + 0.01 * k, op, g, b) for k, (op, g, b) in enumerate(step)]
        t += 0.4
    result = iteration_times(_records(rows))
    assert result.period_calls == 12
    np.testing.assert_allclose(result.seconds, 0.4, rtol=1e-6)


def sharded_steps(
    n_steps: int, layer_bytes: list[int], *, step_s: float = 0.3, log_every: int = 0
) -> list[tuple[float, int, int, int]]:
    """An FSDP / ZeRO-3 step: an all-gather per layer in forward, an all-gather and a
    reduce-scatter per layer in backward, then a 4-byte all-reduce (loss / grad-norm), and
    optionally a 4-byte logging all-reduce every ``log_every`` steps."""
    ag, rs, ar = int(OpCode.ALLGATHER), int(OpCode.REDUCE_SCATTER), int(OpCode.ALLREDUCE)
    rows = [(0.0, int(OpCode.BROADCAST), 3, 123_456)]
    t = 0.05
    for i in range(n_steps):
        k = 0
        for size in layer_bytes:
            rows.append((t + 0.004 * k, ag, 3, size))
            k += 1
        for size in reversed(layer_bytes):
            rows.append((t + 0.004 * k, ag, 3, size))
            rows.append((t + 0.004 * k + 0.002, rs, 3, size))
            k += 1
        rows.append((t + 0.004 * k, ar, 3, 4))
        if log_every and i % log_every == 0:
            rows.append((t + 0.004 * k + 0.002, ar, 4, 4))
        t += step_s
    return rows


def test_identical_layers_are_anchored_by_the_once_per_step_light_call() -> None:
    """Eight identical blocks: no heavy call occurs once per step, the 4-byte all-reduce does.

    Without it the pattern has a period (24 calls) and no anchor, and no iteration at all was
    found; the light per-step call is part of every iteration and anchors it.
    """
    result = iteration_times(_records(sharded_steps(60, [1 << 20] * 8, log_every=10)))
    assert result.period_calls == 8 + 2 * 8 + 1
    assert len(result) >= 57
    np.testing.assert_allclose(result.seconds, 0.3, rtol=1e-6)


def test_online_tracker_on_identical_layers() -> None:
    rec = _records(sharded_steps(80, [1 << 20] * 8))
    tracker = IterationTracker()
    out = np.concatenate([tracker.feed(rec[i : i + 10]) for i in range(0, len(rec), 10)])
    assert tracker.period_calls == 25
    assert out.size >= 70
    np.testing.assert_allclose(out, 0.3, rtol=1e-6)


def test_period_calls_counts_the_once_per_step_light_call() -> None:
    """ZeRO-3: an embedding and twelve identical blocks. The embedding's reduce-scatter
    anchors the step; the 4-byte all-reduce of every step is light and 12x rarer than the
    blocks' calls, yet belongs to the iteration and is counted (the logging one every 10 steps
    is not). It used to be left out: 39 calls."""
    sizes = [5 << 20] + [1 << 20] * 12
    result = iteration_times(_records(sharded_steps(60, sizes, log_every=10)))
    assert result.period_calls == 13 + 2 * 13 + 1
    np.testing.assert_allclose(result.seconds, 0.3, rtol=1e-6)
