"""Collective-call logs of ordinary jobs: what the iteration tracker reads (issue 47).

greyhound section 4.2 derives iteration times from a rank's collective calls: the ACF finds the
calls' recurring period, and an iteration is the time between a call and its occurrence in the
next period. :mod:`.ordinary_life` scores the detector on iteration times; this module turns the
same labeled iteration-time traces into the call logs a rank would write, so that the whole
offline path (``failslow analyze`` on an event log: tracker, then detector) is scored on them.

Each log is one rank's calls, in issue order, of one of four step patterns - the ones the
project's jobs make (``benchmarks/jobs``) and the issue's hold-out names:

- ``ddp`` - DDP's bucketed gradient all-reduces in backward: a small first bucket (DDP's 1 MiB),
  2-8 full buckets of one size, a remainder; a loss all-reduce every 10-100 steps (logging).
  Evaluation makes no calls (DDP's forward has none).
- ``megatron`` - Megatron-core 1F1B on one pipeline stage: point-to-point sends and receives of
  the activations and their gradients for each of 4-16 micro-batches (warm-up, steady 1F1B,
  cool-down), then the distributed optimizer's gradient reduce-scatter and parameter
  all-gather per bucket, and the grad-norm and loss all-reduces. Evaluation: forward sends.
- ``fsdp`` - FSDP2 over 4-24 layers: an all-gather per layer in forward, in backward an
  all-gather (the next layer's, prefetched) and a reduce-scatter per layer. *Homogeneous*
  variants (half of them) have identical layers, no parameters on the root and no loss
  all-reduce: no call occurs once per step. Evaluation: forward all-gathers.
- ``zero3`` - DeepSpeed ZeRO-3 over 4-16 layers of 3 modules each (distinct sizes, repeated per
  layer), with the embedding and head: parameter all-gathers in forward, all-gathers and
  gradient reduce-scatters in backward, the grad-norm all-reduce. Prefetching issues the next
  module's all-gather around the current one's reduce-scatter: in *reordered* variants (half of
  them) each adjacent pair swaps with probability 0.05-0.3 in every step, so no two steps need
  to issue their calls in the same order.

Start-up calls (every log): parameter broadcasts, and in *periodic start-up* variants (a third
of them) a warm-up loop of 20-200 identical small all-reduces (a communication warm-up, a
sanity check over the data) and an evaluation of 10-50 batches before the first step - calls
that repeat regularly before training does.

Times: iteration ``i`` of the trace runs from its step start ``T_i`` for ``times[i]`` seconds;
its calls lie at fixed fractions of the step (forward in the first third, backward to 90%,
the optimizer after), jittered by 0.3% of the step. An evaluation iteration (the trace's eval
distractors) adds its eval calls in the step's last tenth. Truth per log: the calls of a
regular training step (``period``), the number of training iterations, and the trace's labels.
Jobs with restarts are left out (a restart is a new process and a new log).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from failslow.core.events import RECORD_DTYPE, OpCode
from failslow.sim.ordinary_life import ordinary_corpus
from failslow.sim.traces import Trace

FRAMEWORKS = ("ddp", "megatron", "fsdp", "zero3")
MAX_CALLS = 400_000
"""Calls per log at most: a trace that would make more is cut to fit (its labels kept)."""

_DP, _PP, _WORLD = 11, 12, 13  # group keys
MiB = 1 << 20


@dataclass(frozen=True)
class Call:
    op: int
    group: int
    nbytes: int
    at: float  # fraction of the step at which it is issued


@dataclass(frozen=True)
class Pattern:
    step: tuple[Call, ...]
    eval_calls: tuple[Call, ...]
    startup: tuple[Call, ...]
    extra_every: int  # a light logging call every this many steps (0: none)
    swap: float  # probability that two adjacent calls swap (prefetch reordering)


@dataclass(frozen=True)
class CallLog:
    job_id: str
    framework: str
    variant: str
    trace: Trace  # the iteration times and labels (cut to the iterations logged)
    records: np.ndarray  # one rank's calls, RECORD_DTYPE, in issue order
    period: int  # calls of a regular training step
    startup_calls: int


def _spread(calls: Sequence[tuple[int, int, int]], lo: float, hi: float) -> list[Call]:
    n = len(calls)
    return [
        Call(op, g, b, lo + (hi - lo) * (k + 0.5) / max(n, 1)) for k, (op, g, b) in enumerate(calls)
    ]


def _ddp(rng: np.random.Generator) -> tuple[Pattern, str]:
    full = int(rng.choice([25, 50])) * MiB
    buckets = [MiB] + [full] * int(rng.integers(2, 9)) + [int(rng.integers(1, 24)) * MiB]
    step = _spread([(OpCode.ALLREDUCE, _DP, b) for b in buckets], 0.4, 0.9)
    startup = _spread([(OpCode.BROADCAST, _DP, 250 * MiB)] * int(rng.integers(1, 4)), 0, 1)
    return Pattern(tuple(step), (), tuple(startup), int(rng.integers(10, 101)), 0.0), "buckets"


def _megatron(rng: np.random.Generator) -> tuple[Pattern, str]:
    m, stages = int(rng.integers(4, 17)), int(rng.choice([2, 4, 8]))
    stage = int(rng.integers(0, stages))
    act = int(rng.choice([4, 8, 16])) * MiB
    first, last = stage == 0, stage == stages - 1
    fwd = [] if first else [(OpCode.RECV, _PP, act)]
    fwd += [] if last else [(OpCode.SEND, _PP, act)]
    bwd = [] if last else [(OpCode.RECV, _PP, act)]
    bwd += [] if first else [(OpCode.SEND, _PP, act)]
    warm = min(m, stages - stage - 1)
    seq = fwd * warm
    for _ in range(m - warm):
        seq += fwd + bwd
    seq += bwd * warm
    buckets = [int(rng.integers(20, 120)) * MiB for _ in range(int(rng.integers(1, 4)))]
    opt = [(OpCode.REDUCE_SCATTER, _DP, b) for b in buckets]
    opt += [(OpCode.ALLREDUCE, _WORLD, 4), (OpCode.ALLREDUCE, _DP, 4)]  # grad norm, loss
    opt += [(OpCode.ALLGATHER, _DP, b) for b in buckets]
    step = _spread(seq, 0.0, 0.85) + _spread(opt, 0.86, 0.99)
    evals = _spread(fwd * m, 0.9, 0.99)
    startup = [(OpCode.BROADCAST, _WORLD, 64), (OpCode.ALLREDUCE, _PP, act // 8)]
    return Pattern(tuple(step), tuple(evals), tuple(_spread(startup, 0, 1)), 0, 0.0), f"pp{stages}"


def _fsdp(rng: np.random.Generator) -> tuple[Pattern, str]:
    layers = int(rng.integers(4, 25))
    size = int(rng.choice([8, 16, 32, 64])) * MiB
    homogeneous = rng.random() < 0.5
    ag, rs = (OpCode.ALLGATHER, _DP, size), (OpCode.REDUCE_SCATTER, _DP, size // 2)
    fwd = [ag] * layers
    bwd = [ag]  # the last layer's all-gather; then each layer's reduce-scatter after the
    for _ in range(layers - 1):  # next (earlier) layer's prefetched all-gather
        bwd += [ag, rs]
    bwd += [rs]
    extra: list[tuple[int, int, int]] = []
    if not homogeneous:
        root = (OpCode.ALLGATHER, _DP, 3 * size)
        fwd, bwd = [root, *fwd], [*bwd, (OpCode.REDUCE_SCATTER, _DP, 3 * size // 2)]
        extra = [(OpCode.ALLREDUCE, _DP, 4)]  # the loss, every step
    step = _spread(fwd, 0.0, 0.33) + _spread(bwd, 0.34, 0.9) + _spread(extra, 0.95, 0.96)
    evals = _spread(fwd, 0.9, 0.99)
    startup = _spread([(OpCode.BROADCAST, _DP, size)] * layers, 0, 1)
    variant = "homogeneous" if homogeneous else "root"
    return Pattern(tuple(step), tuple(evals), tuple(startup), 0, 0.0), variant


def _zero3(rng: np.random.Generator) -> tuple[Pattern, str]:
    layers = int(rng.integers(4, 17))
    sizes = [int(rng.integers(2, 40)) * MiB for _ in range(3)]
    emb = int(rng.integers(50, 200)) * MiB
    reordered = rng.random() < 0.5
    fwd = [(OpCode.ALLGATHER, _DP, emb)]
    fwd += [(OpCode.ALLGATHER, _DP, s) for _ in range(layers) for s in sizes]
    bwd = []
    for s in reversed(sizes * layers):
        bwd += [(OpCode.ALLGATHER, _DP, s), (OpCode.REDUCE_SCATTER, _DP, s)]
    bwd += [(OpCode.ALLGATHER, _DP, emb), (OpCode.REDUCE_SCATTER, _DP, emb)]
    opt = [(OpCode.ALLREDUCE, _DP, 4)]
    step = _spread(fwd, 0.0, 0.33) + _spread(bwd, 0.34, 0.9) + _spread(opt, 0.92, 0.93)
    evals = _spread(fwd, 0.9, 0.99)
    startup = _spread([(OpCode.BROADCAST, _DP, s) for s in [emb, *sizes]], 0, 1)
    swap = float(rng.uniform(0.05, 0.3)) if reordered else 0.0
    variant = "reordered" if reordered else "in order"
    return Pattern(tuple(step), tuple(evals), tuple(startup), 0, swap), variant


BUILDERS = {"ddp": _ddp, "megatron": _megatron, "fsdp": _fsdp, "zero3": _zero3}


def _periodic_startup(rng: np.random.Generator, pattern: Pattern) -> list[Call]:
    """A warm-up loop of identical small all-reduces and an evaluation before training."""
    warm = [(OpCode.ALLREDUCE, _WORLD, int(rng.choice([4, 1024, 4096])))] * int(
        rng.integers(20, 201)
    )
    calls = _spread(warm, 0, 1)
    if pattern.eval_calls:
        batches = int(rng.integers(10, 51))
        calls += [c for _ in range(batches) for c in pattern.eval_calls]
    return calls


def call_log(trace: Trace, framework: str, rng: np.random.Generator) -> CallLog:
    """One rank's call log for ``trace`` in ``framework``'s step pattern."""
    pattern, variant = BUILDERS[framework](rng)
    startup = list(pattern.startup)
    if rng.random() < 1 / 3:
        startup += _periodic_startup(rng, pattern)
        variant += ", periodic start-up"
    period = len(pattern.step)
    n = min(trace.times.size, MAX_CALLS // max(period, 1))
    times = trace.times[:n]
    evals = np.zeros(n, dtype=bool)
    for key in ("evals_jittered", "evals_wallclock"):
        hit = [i for i in trace.distractors.get(key, ()) if i < n]
        evals[hit] = True
    # start-up: one call every 2-20 ms before the first step
    gap = rng.uniform(0.002, 0.02, size=len(startup))
    t0 = np.cumsum(gap)
    starts = np.concatenate(([0.0], np.cumsum(times)[:-1])) + (t0[-1] if len(t0) else 0.0) + 0.05
    step_at = np.array([c.at for c in pattern.step])
    rows: list[tuple[float, int, int, int]] = [
        (t, c.op, c.group, c.nbytes) for t, c in zip(t0, startup, strict=True)
    ]
    jitter = rng.normal(0.0, 0.003, size=(n, period))
    eval_at = np.array([c.at for c in pattern.eval_calls])
    for i in range(n):
        order = np.arange(period)
        if pattern.swap:
            for k in np.flatnonzero(rng.random(period - 1) < pattern.swap):
                if order[k] == k and order[k + 1] == k + 1:  # each call moves once at most
                    order[k], order[k + 1] = k + 1, k
        frac = np.maximum.accumulate(np.clip(step_at + jitter[i], 0.0, 0.999))  # in order
        for k in range(period):
            c = pattern.step[order[k]]
            rows.append((starts[i] + times[i] * frac[k], c.op, c.group, c.nbytes))
        if evals[i]:
            for c, at in zip(pattern.eval_calls, eval_at, strict=True):
                rows.append((starts[i] + times[i] * at, c.op, c.group, c.nbytes))
        if pattern.extra_every and i % pattern.extra_every == pattern.extra_every - 1:
            rows.append((starts[i] + times[i] * 0.95, OpCode.ALLREDUCE, _DP, 4))
    rec = np.zeros(len(rows), dtype=RECORD_DTYPE)
    t = np.array([r[0] for r in rows])
    order = np.argsort(t, kind="stable")
    t_ns = (t[order] * 1e9).astype(np.int64) + 1_000_000_000
    rec["t_start_ns"] = t_ns
    rec["t_end_ns"] = t_ns + 100_000
    rec["op"] = np.array([r[1] for r in rows], dtype=np.uint16)[order]
    rec["group_key"] = np.array([r[2] for r in rows], dtype=np.uint64)[order]
    rec["nbytes"] = np.array([r[3] for r in rows], dtype=np.uint64)[order]
    rec["call_index"] = np.arange(len(rows), dtype=np.uint64)
    cut = Trace(
        trace.job_id,
        trace.category,
        trace.base_s,
        times,
        tuple(f for f in trace.failslows if f.relief <= n),
        trace.distractors,
        None if trace.calls is None else trace.calls[:n],
    )
    return CallLog(trace.job_id, framework, variant, cut, rec, period, len(startup))


def call_log_corpus(n_logs: int, seed: int = 0) -> list[CallLog]:
    """``n_logs`` call logs, the frameworks in turn, from :func:`ordinary_corpus` jobs of the
    same seed that have no restart."""
    traces = [
        t for t in ordinary_corpus(max(4 * n_logs, 40), seed) if not t.distractors.get("restarts")
    ]
    rng = np.random.default_rng([seed, 4711])
    picked = rng.permutation(len(traces))[:n_logs]
    return [
        call_log(
            traces[int(j)], FRAMEWORKS[k % len(FRAMEWORKS)], np.random.default_rng([seed, 4712, k])
        )
        for k, j in enumerate(picked)
    ]
