"""Iteration tracking and detection on collective-call logs of ordinary jobs (issue 47).

Usage::

    python benchmarks/call_log_accuracy.py [--seed S] [--logs N] [--json]

Each log of :func:`failslow.sim.call_logs.call_log_corpus` is one rank's calls - DDP buckets,
Megatron 1F1B stages, FSDP2 (half of them with identical layers and no call once per step),
ZeRO-3 (half of them with prefetch reordering), a third with start-up calls that repeat (a
warm-up loop, an evaluation before the first step) - written from a labeled trace of
:mod:`failslow.sim.ordinary_life`. Every log goes through what ``failslow analyze`` does with
an event log: the iteration tracker (:func:`failslow.core.tracking.iteration_times`), then the
detector on the iteration times with each iteration's call count. Beside it, greyhound 4.2 as
written: the first lag whose ACF over the raw calls reaches 0.95 (the first 8192 calls), an
anchor call that occurs once per period, iterations between its occurrences.

Per log: the *period* is exact when it equals the calls of a regular training step; the
*count* is right when the iterations found are within 3% of the training iterations; the job
is *flagged right* when :func:`failslow.sim.traces.score_job` scores it correct (every labeled
onset matched within 60 iterations, no false alarm; the tracker's iterations are aligned with
the trace's at the end, as ``failslow analyze`` aligns ranks); *onsets found* is the share of
labeled onsets matched, *<= 15 it* of those reported within 15 iterations (the detector's
own target, scored on iteration times by ``detection_accuracy.py``). Targets (issue 47's
event-log hold-out): 95% each of period, count, flagged and onsets found. Exit status 0 iff
every target is met by the tracker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from failslow.core.tracking import FailSlowDetector, acf, detect, iteration_times
from failslow.core.tracking.iteration import TokenCoder
from failslow.sim.call_logs import CallLog, call_log_corpus
from failslow.sim.traces import score_job

TARGET = 0.95
WINDOW = 8192


def greyhound(records: np.ndarray) -> tuple[int | None, np.ndarray, None]:
    """greyhound 4.2 as written: the first lag with ACF >= 0.95 over the raw calls, and the
    times between consecutive occurrences of a call that occurs once per period."""
    tokens = TokenCoder().encode(records)
    head = tokens[:WINDOW]
    values = acf(head, head.size // 3)
    hits = np.flatnonzero(values >= 0.95)
    if not hits.size:
        return None, np.empty(0), None
    period = int(hits[0]) + 1
    kinds, counts = np.unique(head, return_counts=True)
    once = kinds[np.abs(counts - head.size / period) <= 0.2 * head.size / period]
    best, regular = None, -1.0
    for v in once:
        gaps = np.diff(np.flatnonzero(head == v))
        share = float(np.mean(gaps == period)) if gaps.size else 0.0
        if share > regular:
            best, regular = int(v), share
    if best is None:
        return period, np.empty(0), None
    at = records["t_start_ns"][tokens == best].astype(np.float64)
    return period, np.diff(at) / 1e9, None


def tracker(records: np.ndarray) -> tuple[int | None, np.ndarray, np.ndarray | None]:
    result = iteration_times(records)
    return result.period_calls, result.seconds, result.calls


METHODS: dict[str, Callable[[np.ndarray], tuple[int | None, np.ndarray, np.ndarray | None]]] = {
    "greyhound 4.2": greyhound,
    "failslow": tracker,
}


def score(log: CallLog, method: str) -> dict[str, Any]:
    period, seconds, calls = METHODS[method](log.records)
    truth = log.trace.times.size
    found = int(seconds.size)
    off = truth - found
    events = detect(seconds, FailSlowDetector(), calls) if found else []
    events = [
        dataclasses.replace(e, iteration=e.iteration + off, detected_at=e.detected_at + off)
        for e in events
        if 0 <= e.detected_at + off < truth
    ]
    job = score_job(log.trace, events)
    return {
        "period": period == log.period,
        "count": abs(found - truth) <= 0.03 * truth,
        "flagged": bool(job.correct),
        "onsets": len(job.latencies),
        "matched": sum(1 for x in job.latencies if x is not None),
        "within_15": sum(1 for x in job.latencies if x is not None and x <= 15),
        "found": found,
        "truth": truth,
        "found_period": period,
        "true_period": log.period,
    }


def run(seed: int, n_logs: int) -> dict[str, Any]:
    start = time.perf_counter()
    logs = call_log_corpus(n_logs, seed)
    out: dict[str, Any] = {
        "seed": seed,
        "logs": len(logs),
        "calls": int(sum(log.records.size for log in logs)),
        "build_s": round(time.perf_counter() - start, 1),
        "methods": {},
    }
    with Progress(transient=True) as progress:
        task = progress.add_task("call logs", total=len(logs) * len(METHODS))
        for method in METHODS:
            per_log = []
            for log in logs:
                row = score(log, method)
                row.update(job=log.job_id, framework=log.framework, variant=log.variant)
                per_log.append(row)
                progress.advance(task)
            out["methods"][method] = per_log
    return out


def group(log: dict[str, Any]) -> str:
    variant = log["variant"].split(",")[0]
    if log["framework"] == "megatron":
        variant = "1F1B"
    return f"{log['framework']} {variant}"


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    onsets = sum(r["onsets"] for r in rows)
    return {
        "logs": len(rows),
        "period": sum(r["period"] for r in rows) / len(rows),
        "count": sum(r["count"] for r in rows) / len(rows),
        "flagged": sum(r["flagged"] for r in rows) / len(rows),
        "onsets": onsets,
        "matched": sum(r["matched"] for r in rows) / onsets if onsets else float("nan"),
        "within_15": sum(r["within_15"] for r in rows) / onsets if onsets else float("nan"),
    }


def targets(result: dict[str, Any]) -> dict[str, bool]:
    s = summarize(result["methods"]["failslow"])
    return {k: s[k] >= TARGET for k in ("period", "count", "flagged", "matched")}


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"call logs, seed {result['seed']}: {result['logs']} logs, {result['calls']:,} calls"
    )
    for col in (
        "method",
        "logs",
        "group",
        "period exact",
        "iterations +-3%",
        "flagged right",
        "onsets found",
        "<= 15 it",
    ):
        table.add_column(col, no_wrap=True)
    for method, rows in result["methods"].items():
        groups = sorted({group(r) for r in rows})
        for name in [*groups, "all"]:
            part = rows if name == "all" else [r for r in rows if group(r) == name]
            s = summarize(part)
            onsets = f"{s['matched']:.0%} of {s['onsets']}" if s["onsets"] else "-"
            prompt = f"{s['within_15']:.0%}" if s["onsets"] else "-"
            style = "bold" if name == "all" else None
            table.add_row(
                method,
                str(s["logs"]),
                name,
                f"{s['period']:.0%}",
                f"{s['count']:.0%}",
                f"{s['flagged']:.0%}",
                onsets,
                prompt,
                style=style,
            )
        table.add_section()
    console.print(table)
    missed = [
        r
        for r in result["methods"]["failslow"]
        if not (r["period"] and r["count"] and r["flagged"])
    ]
    for r in missed:
        console.print(
            f"  {r['job']} ({r['framework']}, {r['variant']}): period {r['found_period']}"
            f" of {r['true_period']}, {r['found']} of {r['truth']} iterations, "
            f"flagged {'right' if r['flagged'] else 'wrong'}"
        )
    met = targets(result)
    console.print(
        "targets (failslow): "
        + ", ".join(f"{k} >= {TARGET:.0%}: {'met' if v else 'NOT met'}" for k, v in met.items())
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=int, default=80)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.logs < 1:
        parser.error(f"--logs must be at least 1, got {args.logs}")
    result = run(args.seed, args.logs)
    if args.json:
        print(json.dumps(result))
    else:
        render(result, Console(width=max(Console().width, 120)))
    return 0 if all(targets(result).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
