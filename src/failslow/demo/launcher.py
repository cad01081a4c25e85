"""``failslow demo``: a real 4-rank gloo training job, a real injected slowdown, live detection.

The launcher starts a TCPStore (127.0.0.1, port 0) and the worker processes, each with the
collective hook writing its event ring. A :class:`LocalAnalyzer` derives every rank's iteration
times from the rings alone (greyhound 4.2: ACF period, then BOCD + verification) and reports
onset and relief. Partway through, a :class:`DutyCycleThrottle` SIGSTOP/SIGCONT-cycles one
rank from outside - the way CPU contention steals its time (greyhound 3.2) - and later lets go.
Results: a live view, a summary table, and in the run directory ``iteration_times.csv``
(readable by ``failslow analyze``), ``events.jsonl``, ``summary.json`` and ``iteration_times.png``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np

from failslow.core.tracking.analyzer import LocalAnalyzer
from failslow.demo.run_dir import new_run_dir
from failslow.errors import FailslowError
from failslow.faults import DutyCycleThrottle


@dataclass
class DemoOptions:
    world_size: int = 4
    iterations: int = 200
    slow_rank: int = 2
    slow_start: int = 70
    slow_end: int = 140
    stopped_fraction: float = 0.7
    out_dir: Path | None = None
    live: bool = True
    startup_timeout_s: float = 120.0

    def validate(self) -> None:
        if self.world_size < 2:
            raise FailslowError(f"demo: --world-size must be >= 2, got {self.world_size}")
        if not 0 <= self.slow_rank < self.world_size:
            raise FailslowError(
                f"demo: --slow-rank must be in [0, {self.world_size}), got {self.slow_rank}"
            )
        if not 0 < self.slow_start < self.slow_end < self.iterations:
            raise FailslowError(
                "demo: need 0 < --slow-start < --slow-end < --iterations, got "
                f"{self.slow_start}, {self.slow_end}, {self.iterations}"
            )
        if not 0 < self.stopped_fraction < 1:
            raise FailslowError(
                f"demo: --stopped-fraction must be in (0, 1), got {self.stopped_fraction}"
            )


@dataclass
class DetectedEvent:
    type: str
    iteration: int  # in rank-0 tracked iterations
    ranks: list[int]
    change: float
    reported_at: int  # iteration at which the first rank reported it
    before_s: float
    after_s: float


@dataclass
class DemoState:
    """Everything the live view and the summary show."""

    options: DemoOptions
    iteration: int = 0  # job iterations derived so far (slowest rank's count)
    last_times: dict[int, float] = field(default_factory=dict)
    baseline: dict[int, float] = field(default_factory=dict)  # frozen at an onset
    recent: dict[int, float] = field(default_factory=dict)  # median of the last 20 iterations
    slow: dict[int, bool] = field(default_factory=dict)
    injected: str = "not yet"
    inject_start_ns: int | None = None
    inject_end_ns: int | None = None
    inject_start_iter: int | None = None
    inject_end_iter: int | None = None
    detected: list[DetectedEvent] = field(default_factory=list)
    pending: dict[tuple[str, int], tuple] = field(default_factory=dict)  # (kind, rank) -> vote
    rank_events: list[dict] = field(default_factory=list)  # every rank's own reports, in order


def _free_store() -> tuple[object, int]:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    return store, int(store.port)


def _ring_root() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="failslow-demo-", dir=base))


def _spawn_workers(
    opts: DemoOptions, ring_dir: Path, out: Path, port: int
) -> list[subprocess.Popen]:
    procs = []
    for rank in range(opts.world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(opts.world_size),
            FAILSLOW_STORE_PORT=str(port), FAILSLOW_RING_DIR=str(ring_dir),
            FAILSLOW_DEMO_STEPS=str(opts.iterations), FAILSLOW_DEMO_OUT=str(out),
            OMP_NUM_THREADS="1",
        )
        log = open(out / f"worker-{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "failslow.demo.worker"], env=env, stdout=log, stderr=log
            )
        )
        log.close()
    return procs


QUORUM_WINDOW = 20  # iterations within which rank reports count as one job event


def _merge_event(state: DemoState, rank: int, event, at_iteration: int, reported_at: int) -> None:
    """Job-level events from per-rank reports, as a controller would aggregate them.

    A synchronous job slows down on every rank at once, so a job onset (while healthy) or relief
    (while slow) opens when at least half of the ranks report it within ``QUORUM_WINDOW``
    iterations; one rank's noise alone never does. Later reports of the same kind join it. An
    onset from a rank that already reported the open one is a *compound* onset (the detector's
    further >= 10% step while slow): a quorum of those is a job onset of its own, the job got
    slower still (a CI run's machine slowed every rank 20 iterations before the injection began,
    and the injected step up came on top of it).
    """
    state.rank_events.append({
        "rank": rank, "type": event.type, "iteration": at_iteration, "reported_at": reported_at,
        "before_s": float(event.before_s), "after_s": float(event.after_s),
    })
    current = state.detected[-1] if state.detected else None
    expected = "relief" if current is not None and current.type == "onset" else "onset"
    compound = (current is not None and current.type == "onset" == event.type
                and rank in current.ranks and reported_at > current.reported_at)
    if event.type != expected and not compound:
        if current is not None and current.type == event.type and rank not in current.ranks:
            current.ranks.append(rank)  # a late rank joins the open event
        return
    pending = state.pending
    pending[(event.type, rank)] = (at_iteration, reported_at, float(event.change), event)
    for key in [k for k, v in pending.items() if reported_at - v[1] > QUORUM_WINDOW]:
        del pending[key]
    votes = {r: v for (kind, r), v in pending.items() if kind == event.type}
    if 2 * len(votes) < state.options.world_size:
        return
    iterations = sorted(v[0] for v in votes.values())
    first = min(votes.values(), key=lambda v: v[0])[3]
    state.detected.append(
        DetectedEvent(
            event.type, iterations[len(iterations) // 2], sorted(votes),
            float(np.median([v[2] for v in votes.values()])), reported_at,
            float(first.before_s), float(first.after_s),
        )
    )
    pending.clear()  # a job event opened: the votes before it are moot


def run_demo(opts: DemoOptions) -> int:
    from failslow.demo.report import render_live, write_results

    opts.validate()
    out = new_run_dir(opts.out_dir, "torch")
    ring_dir = _ring_root()
    store, port = _free_store()
    state = DemoState(opts)
    procs = _spawn_workers(opts, ring_dir, out, port)
    throttle: DutyCycleThrottle | None = None
    analyzer = LocalAnalyzer(ring_dir)
    started = time.monotonic()
    try:
        with render_live(state, enabled=opts.live) as refresh:
            while True:
                for update in analyzer.poll():
                    if len(update.new_times):
                        state.last_times[update.rank] = float(update.new_times[-1])
                    for event, seen in zip(update.events, update.reported_at, strict=True):
                        at = event.iteration
                        _merge_event(state, update.rank, event, at, seen)
                        if not opts.live:
                            print(f"detected {event.type} on rank {update.rank} at iteration {at} "
                                  f"({event.change:+.1%})", flush=True)
                for rank, rs in analyzer.ranks.items():
                    state.slow[rank] = rs.detector.slow
                    base = rs.detector.baseline_s
                    if base and rs.detector.slow:
                        state.baseline[rank] = float(base)
                    else:
                        state.baseline.pop(rank, None)
                    if rs.iteration_times:
                        state.recent[rank] = float(np.median(rs.iteration_times[-20:]))
                counts = [rs.iterations for rs in analyzer.ranks.values()]
                state.iteration = min(counts) if len(counts) == opts.world_size else 0
                # Inject and release on the job's tracked iteration count.
                if throttle is None and state.iteration >= opts.slow_start:
                    throttle = DutyCycleThrottle(procs[opts.slow_rank].pid, opts.stopped_fraction)
                    throttle.start()
                    state.inject_start_ns = throttle.started_ns
                    state.inject_start_iter = state.iteration
                    state.injected = f"rank {opts.slow_rank} stopped {opts.stopped_fraction:.0%}"
                if throttle is not None and throttle.active and state.iteration >= opts.slow_end:
                    throttle.stop()
                    state.inject_end_ns = throttle.stopped_ns
                    state.inject_end_iter = state.iteration
                    state.injected = "released"
                refresh()
                if all(p.poll() is not None for p in procs):
                    break
                if any(p.poll() not in (None, 0) for p in procs):
                    bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                    raise FailslowError(
                        f"demo: worker rank(s) {bad} failed; see {out}/worker-<rank>.log"
                    )
                if state.iteration == 0 and time.monotonic() - started > opts.startup_timeout_s:
                    raise FailslowError(
                        f"demo: no iteration derived from the rings after "
                        f"{opts.startup_timeout_s:.0f} s; see {out}/worker-<rank>.log"
                    )
                time.sleep(0.1)
            for update in analyzer.poll():  # the tail
                for event, seen in zip(update.events, update.reported_at, strict=True):
                    _merge_event(state, update.rank, event, event.iteration, seen)
            refresh()
    finally:
        if throttle is not None:
            throttle.stop()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        del store
    try:
        return write_results(state, analyzer, ring_dir, out)
    finally:
        analyzer.close()
        shutil.rmtree(ring_dir, ignore_errors=True)
