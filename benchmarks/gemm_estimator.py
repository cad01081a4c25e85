"""GEMM validation under load: which estimator of a rank's GEMM time names the right ranks
(issue 49; greyhound 4.3 "Computation validation").

    .venv/bin/python benchmarks/gemm_estimator.py [--rounds 40] [--hog 2] [--ranks 4]

``--ranks`` processes (one intra-op thread each) time the same float32 GEMM at once in every
round, as the ranks of a validation round do (``--serial``: one after another, as the CPU
demos' ranks do, ``gemm_serial``) (``repetitions`` runs after a warm-up,
:func:`failslow.core.localize.validation.gemm.gemm_times`), beside ``--hog`` busy processes.
Two scenarios, each ``--rounds`` rounds: every rank healthy, and rank 2 duty-cycled from outside
(SIGSTOP 75% of every 20 ms, the demo's slow GPU). From the same raw times, each estimator of a
rank's time is judged by the controller's rule (:func:`slow_ranks`: slower than ``threshold`` x
the median of its peers) at the controller's default threshold (1.1) and the CPU demos' (2.0):

* ``median``: the median of the repetitions (failslow before this);
* ``min``: the fastest repetition - preemption only ever adds time, so the fastest run is the
  one least disturbed, and a sustained slowdown (longer than the GEMM's duty period) slows
  every run alike;
* ``min of two rounds``: the fastest of two rounds' repetitions (rounds 2k and 2k+1 - a GEMM
  task timed twice in one validation round, apart in time), counted per pair;
* ``repeat before blame``: what the GEMM task does with ``confirm`` (failslow's default): the
  fastest run of round 2k, and only when that names a rank, the fastest of rounds 2k and 2k+1
  (the second timing costs a validation pause only when someone would be blamed).

Printed per scenario and estimator: rounds in which a healthy rank was named (false blame) and
rounds in which the slow rank was not (missed).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

SLOW = 2


def _worker(
    rank: int, ranks: int, barrier: Any, results: Any, rounds: int, repetitions: int, serial: bool
) -> None:
    import torch

    from failslow.core.localize.validation.gemm import gemm_times

    torch.set_num_threads(1)
    for _ in range(rounds):
        barrier.wait()
        for turn in range(ranks if serial else 1):  # serial: the ranks take turns
            if not serial or turn == rank:
                times = gemm_times(dtypes=("float32",), repetitions=repetitions, device="cpu")
                results.put((rank, times["float32"]))
            if serial:
                barrier.wait()


def _scenario(args: argparse.Namespace, throttled: bool) -> list[dict[int, list[float]]]:
    from failslow.faults import DutyCycleThrottle

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.ranks + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, args.ranks, barrier, results, args.rounds, args.repetitions, args.serial),
        )
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    throttle = None
    if throttled:
        throttle = DutyCycleThrottle(procs[SLOW].pid, 0.75, 0.02)
        throttle.start()
    rounds = []
    try:
        for _ in range(args.rounds):
            barrier.wait()
            for _ in range(args.ranks if args.serial else 0):
                barrier.wait()
            got = dict(results.get(timeout=300) for _ in range(args.ranks))
            rounds.append(got)
    finally:
        if throttle is not None:
            throttle.stop()
        for p in procs:
            p.join(timeout=30)
    return rounds


def _named(times: dict[int, float], threshold: float) -> set[int]:
    from failslow.core.localize.validation.gemm import slow_ranks

    return set(slow_ranks(times, threshold=threshold))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--hog", type=int, default=2, help="busy processes beside the ranks")
    ap.add_argument(
        "--serial", action="store_true", help="the ranks take turns (gemm_serial, CPU jobs)"
    )
    args = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    try:
        data = {"healthy": _scenario(args, False), "rank 2 slowed": _scenario(args, True)}
    finally:
        for h in hogs:
            h.send_signal(signal.SIGKILL)
            h.wait()
    estimators = {
        "median": statistics.median,
        "min": min,
        "min of two rounds": min,
        "repeat before blame": min,
    }
    table = Table(
        title=f"GEMM validation{' (serial)' if args.serial else ''}, {args.ranks} ranks + "
        f"{args.hog} busy processes on "
        f"{os.cpu_count()} CPUs, {args.rounds} rounds each"
    )
    for col in ("scenario", "estimator", "threshold", "false blame", "missed", "slowdown seen"):
        table.add_column(col, justify="left" if col in ("scenario", "estimator") else "right")
    for scenario, rounds in data.items():
        for name, fn in estimators.items():
            pairs = list(zip(data[scenario][::2], data[scenario][1::2], strict=False))
            if name == "min of two rounds":  # each rank's runs of rounds 2k and 2k+1 together
                rounds = [{r: a[r] + b[r] for r in a} for a, b in pairs]
            for threshold in (1.1, 2.0):
                false = missed = 0
                seen = []
                judged = pairs if name == "repeat before blame" else rounds
                for got in judged:
                    if name == "repeat before blame":
                        first, second = got
                        times = {r: fn(ts) for r, ts in first.items()}
                        if _named(times, threshold):  # timed again: the fastest of both
                            times = {r: fn(first[r] + second[r]) for r in first}
                    else:
                        times = {r: fn(ts) for r, ts in got.items()}
                    named = _named(times, threshold)
                    false += bool(named - {SLOW} if scenario != "healthy" else named)
                    if scenario != "healthy":
                        missed += SLOW not in named
                        peers = statistics.median(t for r, t in times.items() if r != SLOW)
                        seen.append(times[SLOW] / peers)
                table.add_row(
                    scenario,
                    name,
                    f"{threshold}",
                    f"{false}/{len(judged)}",
                    "-" if scenario == "healthy" else f"{missed}/{len(judged)}",
                    f"{statistics.median(seen):.2f}x" if seen else "-",
                )
    Console(width=110).print(table)


if __name__ == "__main__":
    main()
