"""Odyssey step-time estimator vs measured step times of a real Megatron-core 1F1B pipeline.

Usage::

    python benchmarks/step_time_estimator.py [--save run.json] [--json] [job options]
    python benchmarks/step_time_estimator.py --from-json run.json

Launches ``benchmarks/jobs/megatron_pp_profile.py`` (Megatron-core 1F1B, PP=2, DP=1, two ranks
on gloo/CPU; see its docstring; job options such as ``--micro 2,4,8,16``, ``--max-rounds``,
``--max-run-delay`` pass through) once. That job profiles each stage in isolation - forward
and backward of one micro-batch through Megatron's own ``forward_step``/``backward_step``, the
optimizer update, and the p2p time of one activation - and times real training steps for
every micro-batch count Nm, interleaved in blocks.

From the profile alone (never from the measured step times) the step time of every Nm is
predicted with the package's odyssey formulas, :mod:`failslow.core.planner.odyssey.step_time`:

* Eq. 9 ``step_time_1f1b`` - ``(Npp + Nm - 1) * (Tf + Tb)`` with the slowest stage's times;
* Eq. 10-11 ``simulate_1f1b`` with the per-stage times and the one-way p2p time as the
  latency of every stage-to-stage edge (the paper's form);
* Eq. 10-11 ``simulate_1f1b`` with gloo's rendezvous transfers folded into the receiving
  operations (:func:`rendezvous_inputs`; measured exchange time, ``p2p_s=0``).

All three add the first stage's optimizer update (measured in isolation; the step ends with it,
the last stage's update overlaps the first stage's final backward). There is no DP all-reduce
(DP=1). Measured = median over rank 0's clean timed steps: steps in which neither rank's
compute thread waited on the run queue for more than ``--max-run-delay`` (3%) of the step - the
2 cores are shared with other jobs. Profile medians use the samples that pass the same test.
Exit status 0 iff the rendezvous simulation's mean absolute error is <= 5% (odyssey: 8.02%).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from rich.console import Console
from rich.table import Table

from failslow.core.planner.odyssey.step_time import simulate_1f1b, step_time_1f1b

sys.path.insert(0, str(Path(__file__).resolve().parent / "jobs"))
from launch import run_world

HERE = Path(__file__).resolve().parent
JOB = HERE / "jobs" / "megatron_pp_profile.py"
TARGET = 0.05


def launch(world: int, job_args: list[str], timeout: float, log: Path) -> int:
    """Start the job's ranks with ``jobs/launch.py``'s launcher, output to ``log``."""
    with open(log, "w") as out:
        return run_world(JOB, world, job_args, timeout=timeout, stdout=out)


def _pool(blocks: list[dict[str, Any]], key: str) -> list[float]:
    return [x for b in blocks for x in b[key]]


def _calm(blocks: list[dict[str, Any]], key: str, limit: float) -> list[float]:
    """Profile samples of ``key`` whose run-queue wait was <= ``limit`` (all if none is)."""
    pairs = [
        (x, d) for b in blocks for x, d in zip(b[key], b[key.replace("_s", "_delay")], strict=True)
    ]
    calm = [x for x, d in pairs if d <= limit]
    return calm or [x for x, _ in pairs]


def rendezvous_inputs(
    tf: list[float], tb: list[float], nm: int, exchange: float, oneway: float
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-micro-batch stage times with the receive folded into the receiving operation.

    A gloo send completes only once the receiver has posted its receive, and the data then
    moves (rendezvous): a transfer never overlaps compute. In Megatron's 1F1B each steady-state
    step is one batched exchange (activation one way, gradient the other) that starts when both
    stages reach it; it precedes stage 0's backward of micro-batch j and the last stage's
    forward of micro-batch j + 1. The first forward of a later stage and the first stage's last
    backward receive alone (one one-way transfer). Fed to Eq. 11 with ``p2p_s = 0`` this gives
    start = max(own previous end, dependency end) + transfer - the rendezvous.
    """
    n_pp = len(tf)
    fwd = [
        [tf[s] + (0.0 if s == 0 else (oneway if j == 0 else exchange)) for j in range(nm)]
        for s in range(n_pp)
    ]
    bwd = [
        [
            tb[s] + (0.0 if s == n_pp - 1 else (oneway if j == nm - 1 else exchange))
            for j in range(nm)
        ]
        for s in range(n_pp)
    ]
    return fwd, bwd


def estimate(run: dict[str, Any], *, clean_only: bool = True) -> list[dict[str, Any]]:
    """Per Nm: measured median step and the estimates, from the isolated profile only.

    Measured: rank 0's (first stage's) timed steps, only the clean ones (no rank's compute
    thread waited on the run queue for more than ``max_run_delay`` of the step) unless
    ``clean_only`` is false or none is clean. Profile: the Nm's blocks, samples with run-queue
    wait <= ``max_run_delay`` (medians).
    """
    ranks = run["ranks"]
    limit = run["config"]["max_run_delay"] if clean_only else float("inf")
    n_pp = len(ranks)
    rows = []
    for nm in run["config"]["micro"]:
        per_rank = [[b for b in r["blocks"] if b["nm"] == nm] for r in ranks]
        tf = [median(_calm(bl, "forward_s", limit)) for bl in per_rank]
        tb = [median(_calm(bl, "backward_s", limit)) for bl in per_rank]
        upd = [median(_pool(bl, "update_s")) for bl in per_rank]
        exchange = median(_pool(per_rank[0], "exchange_s") + _pool(per_rank[-1], "exchange_s"))
        oneway = median(_pool(per_rank[0], "oneway_s"))
        all_steps = _pool(per_rank[0], "step_s")
        clean = [x for x, c in zip(all_steps, _pool(per_rank[0], "step_clean"), strict=True) if c]
        steps = clean if clean_only and clean else all_steps
        measured = median(steps)
        # Eq. 9 assumes equal stages: the slowest stage's times (the pipeline's bottleneck).
        eq9 = step_time_1f1b(n_pp, nm, max(tf), max(tb)) + upd[0]
        # Eq. 11 as in the paper: p2p as a latency on every stage-to-stage edge.
        sim = simulate_1f1b([[t] * nm for t in tf], [[t] * nm for t in tb], p2p_s=oneway) + upd[0]
        # Eq. 11 with gloo's rendezvous transfers folded into the receiving operations.
        fwd, bwd = rendezvous_inputs(tf, tb, nm, exchange, oneway)
        rdv = simulate_1f1b(fwd, bwd, p2p_s=0.0) + upd[0]
        inside_f = [median(_pool([b["in_pipeline"] for b in bl], "forward_s")) for bl in per_rank]
        inside_b = [median(_pool([b["in_pipeline"] for b in bl], "backward_s")) for bl in per_rank]
        rows.append(
            {
                "nm": nm,
                "clean_steps": len(clean),
                "total_steps": len(all_steps),
                "n_steps": len(steps),
                "measured_s": measured,
                "forward_s": tf,
                "backward_s": tb,
                "update_s": upd,
                "exchange_s": exchange,
                "oneway_s": oneway,
                "in_pipeline_forward_s": inside_f,
                "in_pipeline_backward_s": inside_b,
                "eq9_s": eq9,
                "eq9_err": (eq9 - measured) / measured,
                "sim_s": sim,
                "sim_err": (sim - measured) / measured,
                "rdv_s": rdv,
                "rdv_err": (rdv - measured) / measured,
            }
        )
    return rows


def _mae(rows: list[dict[str, Any]], key: str) -> float:
    return sum(abs(r[key]) for r in rows) / len(rows)


def _ms(values: list[float], fmt: str = ".1f") -> str:
    return "/".join(f"{1e3 * v:{fmt}}" for v in values)


def show(
    run: dict[str, Any],
    rows: list[dict[str, Any]],
    all_rows: list[dict[str, Any]],
    console: Console,
) -> None:
    c = run["config"]
    console.print(
        f"Megatron-core 1F1B PP=2 DP=1, gloo/CPU, 1 thread/rank: {c['layers_per_stage']} "
        f"transformer layer(s)/stage, hidden {c['hidden']}, seq {c['seq']}, mbs {c['mbs']}, "
        f"activation {c['activation_bytes'] / 2**20:.2f} MiB; {c['rounds']} rounds, per block "
        f"{c['reps']} profiled F/B pairs, {c['p2p_reps']} exchanges + ping-pongs, "
        f"{c['warmup']} warm-up + {c['steps']} timed steps; clean = run-queue wait <= "
        f"{100 * c['max_run_delay']:.0f}%; job {run['wall_s']:.0f} s"
    )
    p = Table(title="Isolated profile (estimator input; stage 0/stage 1, medians)")
    for col in (
        "Nm",
        "clean steps",
        "Tf (ms)",
        "Tb (ms)",
        "update (ms)",
        "exchange (ms)",
        "one-way (ms)",
    ):
        p.add_column(col, justify="right")
    for r in rows:
        p.add_row(
            str(r["nm"]),
            f"{r['clean_steps']}/{r['total_steps']}",
            _ms(r["forward_s"]),
            _ms(r["backward_s"]),
            _ms(r["update_s"], ".2f"),
            f"{1e3 * r['exchange_s']:.2f}",
            f"{1e3 * r['oneway_s']:.2f}",
        )
    console.print(p)
    t = Table(title="Odyssey step-time estimator vs measured 1F1B step (clean steps)")
    for col in (
        "Nm",
        "measured median step (ms)",
        "Eq. 9 (ms)",
        "error",
        "Eq. 11 DP sim, p2p latency (ms)",
        "error",
        "Eq. 11 DP sim, rendezvous (ms)",
        "error",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["nm"]),
            f"{1e3 * r['measured_s']:.1f}",
            f"{1e3 * r['eq9_s']:.1f}",
            f"{100 * r['eq9_err']:+.1f}%",
            f"{1e3 * r['sim_s']:.1f}",
            f"{100 * r['sim_err']:+.1f}%",
            f"{1e3 * r['rdv_s']:.1f}",
            f"{100 * r['rdv_err']:+.1f}%",
        )
    t.add_row(
        "mean |error|",
        "",
        "",
        f"{100 * _mae(rows, 'eq9_err'):.1f}%",
        "",
        f"{100 * _mae(rows, 'sim_err'):.1f}%",
        "",
        f"{100 * _mae(rows, 'rdv_err'):.1f}%",
        style="bold",
    )
    console.print(t)
    console.print(
        "Inside the running pipeline (diagnostic, not an input): Tf "
        + ", ".join(f"Nm={r['nm']}: {_ms(r['in_pipeline_forward_s'])}" for r in rows)
        + " ms; Tb "
        + ", ".join(f"Nm={r['nm']}: {_ms(r['in_pipeline_backward_s'])}" for r in rows)
        + " ms."
    )
    console.print(
        "Every step and profile sample, contended ones included: mean |error| Eq. 9 "
        f"{100 * _mae(all_rows, 'eq9_err'):.1f}%, DP sim {100 * _mae(all_rows, 'sim_err'):.1f}%, "
        f"rendezvous {100 * _mae(all_rows, 'rdv_err'):.1f}% (rendezvous per Nm: "
        + ", ".join(f"{r['nm']}: {100 * r['rdv_err']:+.1f}%" for r in all_rows)
        + ")."
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Other options go to the job (see its --help)."
    )
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--from-json", help="re-evaluate a saved job output instead of running")
    ap.add_argument("--save", help="keep the job output (JSON) here")
    ap.add_argument("--json", action="store_true")
    args, job_args = ap.parse_known_args()
    console = Console(width=120)
    if args.from_json:
        run = json.loads(Path(args.from_json).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="failslow-steptime-") as tmp:
            out = Path(args.save) if args.save else Path(tmp) / "profile.json"
            log = Path(tmp) / "job.log"
            rc = launch(2, ["--out", str(out), *job_args], args.timeout, log)
            if rc:
                console.print(log.read_text()[-4000:])
                sys.exit(f"job failed (rc={rc})")
            run = json.loads(out.read_text())
    rows, all_rows = estimate(run), estimate(run, clean_only=False)
    if args.json:
        print(json.dumps({"config": run["config"], "rows": rows, "all_blocks": all_rows}, indent=1))
    else:
        show(run, rows, all_rows, console)
    enough = all(r["clean_steps"] for r in rows)
    sys.exit(0 if enough and _mae(rows, "rdv_err") <= TARGET else 1)


if __name__ == "__main__":
    main()
