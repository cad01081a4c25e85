"""What observability costs: per training step on a rank, per step in the controller, per scrape.

``python benchmarks/observe_cost.py [--steps 20000] [--ranks 8] [--scrapes 200]`` prints one
table, all rows measured in this one run (ratios, since the machine is shared):

- **rank, per step**: ``failslow_on_step`` through a real plugin manager with the built-in
  plugins (log, TensorBoard and W&B notifiers, both off as by default) against a manager with
  only the log notifier - what the two new built-ins add to every step when unused; and with
  the TensorBoard notifier on (rank 0 writes one scalar per step);
- **controller, per step**: :class:`~failslow.observe.metrics.ControlMetrics` taking one
  ``steps`` event of one step (the mitigator's 10 Hz tick sees about one new step at a time) -
  work in the launcher, not in any rank;
- **per scrape**: one ``GET /metrics`` over loopback of an endpoint with the controller's series
  and a node's ``--ranks`` local ranks plus their snapshots (read from real snapshot files).

Nothing here runs in the training step except the first row: the metrics exporter reads what
the control plane already has, at the pace the scraper asks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table


def per_call(fn, n: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``fn(i)``."""
    results = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        results.append((time.perf_counter() - t0) / n)
    return statistics.median(results)


def rank_rows(steps: int, tb_dir: Path) -> list[tuple[str, float]]:
    import pluggy

    from failslow import hookspecs
    from failslow.builtin import log_notifier
    from failslow.config import load_config
    from failslow.plugins import plugin_manager

    only_log = pluggy.PluginManager("failslow")
    only_log.add_hookspecs(hookspecs)
    only_log.register(log_notifier)
    builtins = plugin_manager(autoload=False)
    off = load_config({}, environ={})
    builtins.hook.failslow_session_start(config=off, rank=0, world_size=1)
    base = per_call(lambda i: only_log.hook.failslow_on_step(step=i, step_time_s=0.1), steps)
    new = per_call(lambda i: builtins.hook.failslow_on_step(step=i, step_time_s=0.1), steps)
    builtins.hook.failslow_session_end(rank=0)
    on = load_config({"observe": {"tensorboard_dir": str(tb_dir)}}, environ={})
    builtins.hook.failslow_session_start(config=on, rank=0, world_size=1)
    tb = per_call(lambda i: builtins.hook.failslow_on_step(step=i, step_time_s=0.1), steps // 4)
    builtins.hook.failslow_session_end(rank=0)
    return [
        ("rank: on_step, log notifier only (before)", base),
        ("rank: on_step, + TensorBoard and W&B notifiers, off", new),
        ("rank: on_step, TensorBoard notifier on (rank 0)", tb),
    ]


def controller_row(steps: int) -> tuple[str, float]:
    from failslow.core.control.journal import event
    from failslow.observe.metrics import ControlMetrics, new_registry

    metrics = ControlMetrics(new_registry())
    return (
        "controller: one step event into the metrics",
        per_call(lambda i: metrics(event("steps", steps=[[i, 0.1]])), steps),
    )


def scrape_row(ranks: int, scrapes: int, snap_dir: Path) -> tuple[str, float, int]:
    import torch

    from failslow.core.checkpoint.snapshot import Snapshotter
    from failslow.core.control.journal import event
    from failslow.observe.metrics import ControlMetrics, MetricsServer, NodeCollector, new_registry

    registry = new_registry()
    metrics = ControlMetrics(registry)
    metrics(event("steps", steps=[[i, 0.1] for i in range(100)]))
    states = {
        r: {"rank": r, "iterations": 100, "last_s": 0.1, "median_s": 0.1, "slow": False,
            "wall": 0.0}
        for r in range(ranks)
    }  # fmt: skip
    snaps = [Snapshotter(snap_dir, rank=r) for r in range(ranks)]
    for snap in snaps:
        snap.start({"w": torch.zeros(1024)}, 5)
        snap.wait_sealed(10.0)
    registry.register(NodeCollector(rank_states=lambda: states, snapshot_dir=snap_dir))
    server = MetricsServer(registry, port=0).start()
    size = 0

    def scrape(_: int) -> None:
        nonlocal size
        with urllib.request.urlopen(server.url, timeout=10) as response:
            size = len(response.read())

    try:
        seconds = per_call(scrape, scrapes, repeats=3)
    finally:
        server.stop()
        for snap in snaps:
            snap.close()
    return f"scrape: GET /metrics, controller + {ranks} local ranks", seconds, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = rank_rows(args.steps, Path(tmp) / "tb")
        rows.append(controller_row(args.steps))
        label, seconds, size = scrape_row(args.ranks, args.scrapes, Path(tmp) / "snaps")
    table = Table(title="observability cost (median of repeats, this machine, one run)")
    table.add_column("what")
    table.add_column("per call", justify="right")
    for name, seconds_per in rows:
        table.add_row(name, f"{seconds_per * 1e6:.1f} us")
    table.add_row(f"{label} ({size} bytes)", f"{seconds * 1e3:.2f} ms")
    Console().print(table)
    added = rows[1][1] - rows[0][1]
    Console().print(
        f"the off notifiers add {added * 1e6:.1f} us to a step; at a 100 ms step that is "
        f"{added / 0.1:.4%}"
    )


if __name__ == "__main__":
    main()
