"""Ski-rental planner vs the offline (hindsight) optimum (greyhound 5.1, Algorithm 1).

Usage::

    python benchmarks/ski_rental_ratio.py [--events N] [--seed S] [--restart-s SECONDS]

Fail-slow events are drawn from greyhound's characterization (section 3, Fig. 1 and Table 1):

- compute (GPU or CPU contention): lognormal duration with a 10-minute mean;
- communication, small jobs: lognormal, 24-minute mean;
- communication at scale (>= 512 GPUs): lognormal, 72-minute mean;

each with a slowdown drawn from 1.2x-3x of a 1.6 s healthy step (greyhound 7.5: 37.4 it/min).
For every event the real :class:`failslow.core.planner.ski_rental.MultiLevelPlanner` is fed
one step time at a time from the onset until the event ends; its cost is the rent it paid
(seconds lost to slow steps) plus the overheads it bought. The hindsight optimum knows the
duration and buys the single best option at the onset
(:func:`failslow.core.planner.ski_rental.hindsight_cost`). The ratio online / hindsight is the
competitive ratio of that event; the classic deterministic bound for one buy option is 2.

Two buy rules side by side on the same events: ``break-even`` (Algorithm 1 as published: buy
when the impact reaches the overhead) and ``expected`` (the planner's default,
:class:`failslow.core.planner.ski_rental.ExpectedCost`: the largest expected saving over the
expected remaining duration under the characterization's prior, never before half the overhead
in impact, S2/S3 at the latest at break-even, S4 only when the expected remaining duration pays).

Options and their effect (Table 2): S2 micro-batch rebalancing (compute only; 0.05 s to solve
and reach the next step; leaves a 10% residual of the slowdown, since integer micro-batch
counts rarely balance exactly), S3 topology swap (60 s pause and state moves, greyhound Fig.
19; leaves 40% of a compute and 15% of a communication slowdown), S4 restart without the bad
node (``--restart-s``, default 120 s from in-memory checkpoints; 0% residual).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.duration_prior import DurationPriors
from failslow.core.planner.plans import Ignore, Plan
from failslow.core.planner.ski_rental import (
    ALL_KINDS,
    COMPUTE_ONLY,
    BreakEven,
    BuyRule,
    ExpectedCost,
    MultiLevelPlanner,
    Strategy,
    hindsight_cost,
)

HEALTHY_S = 1.6
CLASSES = {  # name: (kind, mean duration in seconds, GPUs of the job)
    "compute": (Kind.COMPUTE, 600.0, 256),
    "comm (small jobs)": (Kind.COMMUNICATION, 24 * 60.0, 256),
    "comm (at scale)": (Kind.COMMUNICATION, 72 * 60.0, 1024),
}
RULES = ("break-even", "expected")
RESIDUAL = {  # share of the slowdown left after the option, by kind
    "S2": {Kind.COMPUTE: 0.10},
    "S3": {Kind.COMPUTE: 0.40, Kind.COMMUNICATION: 0.15},
    "S4": {Kind.COMPUTE: 0.0, Kind.COMMUNICATION: 0.0},
}


def options(kind: Kind, slow_s: float, restart_s: float) -> dict[str, tuple[float, float]]:
    """(overhead_s, step time after) of every option that applies to ``kind``."""
    overhead = {"S2": 0.05, "S3": 60.0, "S4": restart_s}
    out = {}
    for name, residual in RESIDUAL.items():
        if kind in residual:
            out[name] = (overhead[name], HEALTHY_S + residual[kind] * (slow_s - HEALTHY_S))
    return out


def _fixed(overhead: float, step: float) -> Callable[[Diagnosis], Plan]:
    return lambda _d: Ignore(overhead_s=overhead, step_time_s=step)


def rule_for(name: str, world_size: int) -> BuyRule:
    if name == "break-even":
        return BreakEven()
    return ExpectedCost(DurationPriors.characterization(world_size))


def online_cost(
    kind: Kind, slow_s: float, steps: int, restart_s: float, rule: BuyRule
) -> tuple[float, str]:
    opts = options(kind, slow_s, restart_s)
    strategies = [
        Strategy("S2", COMPUTE_ONLY, _fixed(*opts["S2"])) if "S2" in opts else None,
        Strategy("S3", ALL_KINDS, _fixed(*opts["S3"])),
        Strategy("S4", ALL_KINDS, _fixed(*opts["S4"]), last_resort=True, revertible=False),
    ]
    planner = MultiLevelPlanner([s for s in strategies if s is not None], rule=rule)
    diagnosis = Diagnosis(
        kind,
        (SlowRank(0, slow_s / HEALTHY_S),) if kind is Kind.COMPUTE else (),
        (SlowLink(0, 1, 2.0),) if kind is Kind.COMMUNICATION else (),
    )
    cost, step, bought = 0.0, slow_s, []
    for decision in planner.onset(diagnosis, healthy_step_s=HEALTHY_S):
        cost += decision.plan.overhead_s
        step = decision.plan.step_time_s or step
        bought.append(decision.strategy)
    for _ in range(steps):
        cost += step - HEALTHY_S
        for decision in planner.observe(step):
            cost += decision.plan.overhead_s
            step = decision.plan.step_time_s or step
            bought.append(decision.strategy)
    return cost, "+".join(bought) or "S1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=400, help="events per class")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restart-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    console = Console(width=max(Console().width, 150))
    table = Table(
        title=f"ski-rental online / hindsight cost ({args.events} events per class, "
        f"restart {args.restart_s:.0f} s, seed {args.seed}): break-even (Alg. 1) vs expected"
    )
    table.add_column("class")
    table.add_column("mean dur (min)", justify="right")
    for rule in RULES:
        for col in ("mean", "p95", "max", "lost (min/event)"):
            table.add_column(f"{rule} {col}", justify="right")
    for col in ("hindsight lost", "no-mitigation lost"):
        table.add_column(col, justify="right")
    table.add_column("most common path (break-even / expected)")
    for name, (kind, mean_s, world) in CLASSES.items():
        sigma = 1.0
        mu = math.log(mean_s) - sigma**2 / 2  # lognormal with the characterization's mean
        ratios: dict[str, list[float]] = {r: [] for r in RULES}
        lost = dict.fromkeys(RULES, 0.0)
        paths: dict[str, dict[str, int]] = {r: {} for r in RULES}
        best_sum = none_sum = 0.0
        for _ in track(range(args.events), description=name, console=console, transient=True):
            duration = float(rng.lognormal(mu, sigma))
            slow = HEALTHY_S * float(rng.uniform(1.2, 3.0))
            steps = max(1, int(duration / slow))
            best = hindsight_cost(
                steps, HEALTHY_S, slow, list(options(kind, slow, args.restart_s).values())
            )
            for rule in RULES:
                online, path = online_cost(kind, slow, steps, args.restart_s, rule_for(rule, world))
                ratios[rule].append(online / best if best > 0 else 1.0)
                lost[rule] += online
                paths[rule][path] = paths[rule].get(path, 0) + 1
            best_sum += best
            none_sum += steps * (slow - HEALTHY_S)
        n = args.events
        cells = [name, f"{mean_s / 60:.0f}"]
        for rule in RULES:
            r = np.asarray(ratios[rule])
            cells += [
                f"{r.mean():.3f}",
                f"{np.percentile(r, 95):.3f}",
                f"{r.max():.3f}",
                f"{lost[rule] / n / 60:.2f}",
            ]
        cells += [
            f"{best_sum / n / 60:.2f}",
            f"{none_sum / n / 60:.2f}",
            " / ".join(max(paths[r], key=paths[r].__getitem__) for r in RULES),
        ]
        table.add_row(*cells)
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
