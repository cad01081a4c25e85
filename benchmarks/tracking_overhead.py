"""Tracking overhead on a real 4-rank gloo DDP job, hook on and off interleaved (greyhound 7.4).

Usage::

    python benchmarks/tracking_overhead.py [--rounds R] [--steps-per-block K] [--json]

One DDP world (the MLP of ``benchmarks/jobs/ddp.py``: 512-1024-1024-512, batch 512,
``bucket_cap_mb=1``, 3 bucket all-reduces per step; gloo on 127.0.0.1, port 0) trains
``--rounds`` rounds of two blocks of ``--steps-per-block`` steps each: one block with the capture
hook installed (:func:`failslow.nccl_hook.install`) and one without
(:func:`failslow.nccl_hook.uninstall`, which destroys the ``torch.library`` registration, so the
dispatcher's own Autograd kernel runs again and a call pays nothing of failslow; measured per
call in ``--check-toggle``). All ranks switch at the same step, after a barrier issued with the
hook off; the block order alternates on/off, off/on (ABBA), so a linear drift of the machine
cancels within each pair of rounds. Meanwhile the launcher process runs the node side as
``failslow run`` hosts it: a :class:`failslow.node.publisher.NodePublisher` on its own thread,
over a :class:`failslow.core.tracking.analyzer.LocalAnalyzer` of the rings (ACF tracker + BOCD
detector), with the product's poll cadence (about one poll per iteration, never more often than
``--poll-interval`` s; :meth:`~failslow.node.publisher.NodePublisher.next_wait`), publishing
rank states to the job's TCPStore every second and reading the controller's request counter at
every poll (a node without the controller; ``--controller-here``: the node that hosts it, asked
directly, reads no counter) - the "tracking" half, competing for the same cores as the ranks, as
it would on a real node. No controller profiles here, so no group summary is made (they are
made only when asked since 2026-11-26; before, every second). During off blocks it
keeps polling, finds nothing new and backs off to 0.2 s.

Step time = wall time between optimizer steps, averaged over ranks (the ranks are in lock-step).
The overhead of round ``r`` is ``mean(on block) / mean(off block) - 1`` (adjacent blocks, so
slow machine-wide drift cancels); reported: the mean over rounds with a bootstrap 95% interval
(resampling rounds), the median, and the spread. Target: <= 0.5% on average (greyhound Fig. 18:
0.39%). On 2 shared cores step times jitter by several %, so read the interval, not the digits.

Second measure from the same run, meant to be lower-noise: each rank also reads its process CPU time
(``time.process_time_ns()``: every thread of the rank - main, gloo's, the hook's completion
callbacks) at every step boundary. The rank-CPU overhead of round ``r`` is all ranks' CPU in the
on block / in the off block - 1 (bootstrap 95% interval over rounds). It does not count time
spent waiting (for a peer, for a core, for the GIL), so scheduling noise drops out and it is
the work the capture adds to a rank - but not changes in the speed of the core itself (on a
shared VM, host contention; there it was as noisy as wall time, see benchmarks/README.md).
The main thread's CPU (``time.thread_time_ns()``) is recorded as well, to split the difference
between the training thread and the others. The analyzer's share comes from the CPU time
of the publisher's thread (``time.thread_time()``: its polls, its summaries and its loop; the
launcher's other threads are its main loop waiting for the ranks and the TCPStore server, which
every torch job's agent runs, failslow or not - the process total is printed too), per step of
each rank it serves, as a fraction of a rank's CPU per step (off blocks), three ways: *always
on* (the figure used) charges the polls that read records, with their share of the loop, to the
steps that wrote records (warm-up + on blocks) and the summaries (one per second, capture on or
off) to all steps - the empty polls of the off blocks, which a job with capture always on does
not make, to none; the *upper bound* charges the whole thread to the steps that wrote records,
the *lower bound* to all steps. "CPU total" (rank + analyzer always on) is the cost in CPU of
tracking; on a node whose cores are all busy with ranks it becomes step time, on a node with a
spare core the analyzer's share does not. The exit status is 0 iff the wall-clock target is
met.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGET = 0.005

FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""glibc's default thresholds, set explicitly: that turns off its dynamic mmap threshold, which
otherwise moves with the process's allocation history (a freed big block raises it) and with it
whether this step's tensors come from fresh mmaps - a per-process swing of up to ~10% in step
time that any toggle inside the process measures as well (``hook_install_bias.py``)."""


# -- worker (one rank) -------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import failslow.nccl_hook as hook
    from failslow.core.ring import RingReader

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    capture = hook.install(args.ring_dir)  # before init, as a job would
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from jobs._job import benchmark_mlp  # benchmarks/ is the script's directory

    model = DDP(benchmark_mlp(), bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 512)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(args.warmup):  # capture on: the tracker learns the period meanwhile
        step()
    assert capture.ring_path is not None
    ring = RingReader(capture.ring_path, from_start=False)
    blocks: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for mode in order:
            hook.uninstall()
            dist.barrier()  # align the switch on every rank; never recorded
            before = ring.write_index
            if mode == "on":
                hook.install(args.ring_dir)
            # CPU time of the whole rank process (every thread: main, gloo's, the hook's
            # completion callbacks), read together with the wall clock at each step boundary
            cpu, marks = [time.process_time_ns()], [time.monotonic_ns()]
            main = [time.thread_time_ns()]  # the training thread alone
            for _ in range(args.steps_per_block):
                step()
                marks.append(time.monotonic_ns())
                cpu.append(time.process_time_ns())
                main.append(time.thread_time_ns())
            blocks.append({"round": r, "mode": mode, "start_index": before,
                           "step_s": [(b - a) / 1e9 for a, b in itertools.pairwise(marks)],
                           "cpu_s": [(b - a) / 1e9 for a, b in itertools.pairwise(cpu)],
                           "cpu_main_s": [(b - a) / 1e9 for a, b in itertools.pairwise(main)]})
    hook.uninstall()
    dist.barrier()
    time.sleep(0.05)  # let the last completion callbacks land
    for i, block in enumerate(blocks):  # records written during each block (incl. late ones)
        end = blocks[i + 1]["start_index"] if i + 1 < len(blocks) else ring.write_index
        block["records"] = end - block.pop("start_index")
    ring.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "blocks": blocks, "native": capture.native is not None}))
    dist.barrier()
    dist.destroy_process_group()
    hook.uninstall()


# -- launcher ----------------------------------------------------------------------------------
def _bootstrap_mean(values: list[float], n: int = 5000, seed: int = 0) -> tuple[float, float]:
    import numpy as np

    rng = np.random.default_rng(seed)
    arr = np.asarray(values)
    means = arr[rng.integers(0, arr.size, size=(n, arr.size))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from failslow.core.control.store import open_store
    from failslow.core.tracking.analyzer import LocalAnalyzer
    from failslow.node.publisher import NodePublisher

    per_call = json.loads(subprocess.run(  # before the world starts: nothing competes
        [sys.executable, __file__, "--check-toggle", "--json"], check=True, capture_output=True,
        text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **kernel_env(args.kernel))).stdout)
    work = Path(tempfile.mkdtemp(prefix="failslow-overhead-"))
    ring_dir, out = work / "rings", work / "out"
    ring_dir.mkdir()
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, args.world, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               WORLD_SIZE=str(args.world), OMP_NUM_THREADS="1")
    if args.malloc == "fixed":
        env.update(FIXED_MALLOC)
    env.update(kernel_env(args.kernel))
    cmd = [sys.executable, __file__, "--worker", "--ring-dir", str(ring_dir), "--out", str(out),
           "--rounds", str(args.rounds), "--steps-per-block", str(args.steps_per_block),
           "--warmup", str(args.warmup), "--batch", str(args.batch)]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(args.world)]
    launcher_cpu0 = time.process_time()  # the whole launcher process, all its threads
    # The node side as `failslow run` hosts it: a NodePublisher on its own thread, with the
    # product's poll cadence, publishing to the job's store.
    publisher = NodePublisher(LocalAnalyzer(ring_dir, keep_history=False),
                              open_store(f"tcp://127.0.0.1:{store.port}"))
    publisher.asked_here = args.controller_here
    analyzer = publisher.analyzer
    node = {"thread_cpu": 0.0, "poll_cpu": 0.0, "polls": 0, "iterations": 0,
            "poll_cpu_records": 0.0, "polls_records": 0, "summaries_cpu": 0.0, "summaries": 0}
    poll, summaries = analyzer.poll, publisher.publish_summaries

    def timed_poll() -> list[Any]:  # runs on the publisher's thread: its CPU time
        c = time.thread_time()
        updates = poll()
        spent = time.thread_time() - c
        node["poll_cpu"] += spent
        node["polls"] += 1
        if analyzer.records_seen:  # the work that records cause (an always-on job's polls)
            node["poll_cpu_records"] += spent
            node["polls_records"] += 1
        node["iterations"] += sum(len(u.new_times) for u in updates)
        return updates

    def timed_summaries() -> None:
        c = time.thread_time()
        summaries()
        node["summaries_cpu"] += time.thread_time() - c
        node["summaries"] += 1

    analyzer.poll = timed_poll  # type: ignore[method-assign]
    publisher.publish_summaries = timed_summaries  # type: ignore[method-assign]
    done = threading.Event()

    def serve() -> None:
        c = time.thread_time()  # this thread only: the publisher's polls, summaries and loop
        try:
            publisher.run(done.is_set, poll_s=args.poll_interval)
        finally:
            node["thread_cpu"] = time.thread_time() - c

    thread = threading.Thread(target=serve, name="failslow-node", daemon=True)
    if not args.no_analyzer:
        thread.start()
    lost = 0
    t0 = time.monotonic()
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
            if time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"timeout after {args.timeout:.0f}s")
            time.sleep(0.1)
        done.set()
        if thread.is_alive():
            thread.join()
        lost = analyzer.dropped()
        launcher_cpu = time.process_time() - launcher_cpu0
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if thread.is_alive():
            thread.join()
        analyzer.close()
        publisher.store.close()
    wall = time.monotonic() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        shutil.copytree(work, Path(args.keep), dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return summarize(per_rank, args, {
        "analyzer_polls": node["polls"], "analyzer_cpu_s": node["poll_cpu"], "wall_s": wall,
        "analyzer_polls_with_records": node["polls_records"],
        "analyzer_cpu_records_s": node["poll_cpu_records"],
        "summaries_published": node["summaries"], "summaries_cpu_s": node["summaries_cpu"],
        "launcher_cpu_s": launcher_cpu, "analyzer_loop_cpu_s": node["thread_cpu"],
        "iterations_tracked": node["iterations"], "analyzer_records_lost": lost,
        "per_call_us": per_call, "cores": os.cpu_count() or 1,
    })


def summarize(per_rank: list[dict[str, Any]], args: argparse.Namespace,
              extra: dict[str, Any]) -> dict[str, Any]:
    n_blocks = len(per_rank[0]["blocks"])
    blocks = []
    for i in range(n_blocks):
        bs = [pr["blocks"][i] for pr in per_rank]
        per_step = zip(*(b["step_s"] for b in bs), strict=True)
        steps = [statistics.fmean(s) for s in per_step]  # mean over ranks
        cpu_by_rank = [sum(b["cpu_s"]) for b in bs]  # each rank's CPU over the block
        blocks.append({"round": bs[0]["round"], "mode": bs[0]["mode"], "step_s": steps,
                       "mean_s": statistics.fmean(steps), "cpu_by_rank_s": cpu_by_rank,
                       "cpu_per_rank_step_s": sum(cpu_by_rank) / len(bs) / len(steps),
                       "cpu_main_per_rank_step_s": (sum(sum(b["cpu_main_s"]) for b in bs)
                                                    / len(bs) / len(steps)),
                       "records_per_step": sum(b["records"] for b in bs) / len(bs) / len(steps)})
    ratios, median_ratios, steady_ratios = [], [], []
    cpu_ratios: list[float] = []
    cpu_rank_ratios: list[list[float]] = [[] for _ in per_rank]
    for r in range(args.rounds):
        on = next(b for b in blocks if b["round"] == r and b["mode"] == "on")
        off = next(b for b in blocks if b["round"] == r and b["mode"] == "off")
        ratios.append(on["mean_s"] / off["mean_s"] - 1.0)
        # CPU: all ranks' CPU in the on block / in the off block (same number of steps)
        cpu_ratios.append(on["cpu_per_rank_step_s"] / off["cpu_per_rank_step_s"] - 1.0)
        for k, (c_on, c_off) in enumerate(zip(on["cpu_by_rank_s"], off["cpu_by_rank_s"],
                                              strict=True)):
            cpu_rank_ratios[k].append(c_on / c_off - 1.0)
        median_ratios.append(statistics.median(on["step_s"]) / statistics.median(off["step_s"])
                             - 1.0)
        if len(on["step_s"]) > 1:  # leave out the first step after each switch
            steady_ratios.append(statistics.fmean(on["step_s"][1:])
                                 / statistics.fmean(off["step_s"][1:]) - 1.0)
    on_steps = [s for b in blocks if b["mode"] == "on" for s in b["step_s"]]
    off_steps = [s for b in blocks if b["mode"] == "off" for s in b["step_s"]]
    lo, hi = _bootstrap_mean(ratios)
    mean = statistics.fmean(ratios)
    records_on = statistics.fmean(b["records_per_step"] for b in blocks if b["mode"] == "on")
    mean_off = statistics.fmean(off_steps)
    # bottom-up: the extra per-call cost of the hook times the calls per step, plus the
    # analyzer's CPU as a share of the machine's cores (what it takes from the ranks)
    call_cost = max(extra["per_call_us"]["installed"] - extra["per_call_us"]["uninstalled"], 0)
    hook_share = call_cost * 1e-6 * records_on / mean_off
    analyzer_share = extra["analyzer_cpu_s"] / (extra["wall_s"] * extra["cores"])
    # CPU measures: a rank's CPU per step on vs off, and the launcher's (LocalAnalyzer)
    # CPU per step of each rank it serves, as a share of a rank's CPU per step (off). The
    # launcher's CPU is divided by the steps that wrote records (warm-up + on blocks) although
    # it also polled through the off blocks, so the share is an upper bound of the cost with
    # capture always on.
    cpu_mean = statistics.fmean(cpu_ratios)
    cpu_lo, cpu_hi = _bootstrap_mean(cpu_ratios)
    cpu_step_off = statistics.fmean(b["cpu_per_rank_step_s"] for b in blocks if b["mode"] == "off")
    cpu_step_on = statistics.fmean(b["cpu_per_rank_step_s"] for b in blocks if b["mode"] == "on")
    main_on = statistics.fmean(b["cpu_main_per_rank_step_s"] for b in blocks if b["mode"] == "on")
    main_off = statistics.fmean(b["cpu_main_per_rank_step_s"] for b in blocks
                                if b["mode"] == "off")
    steps_recorded = args.warmup + args.rounds * args.steps_per_block
    steps_all = args.warmup + 2 * args.rounds * args.steps_per_block
    world = len(per_rank)
    analyzer_cpu_share = extra["analyzer_loop_cpu_s"] / (steps_recorded * world) / cpu_step_off
    # Always on (what a job pays): each piece of the thread's work charged to what it scales
    # with - the polls that read records (and their share of the loop: wake-up, sleep) to the
    # steps that wrote them, the summaries (one per second, capture on or off) to all steps;
    # the empty polls of the off blocks, which an always-on job would not make, to none.
    polls = max(extra["analyzer_polls"], 1)
    loop = max(0.0, extra["analyzer_loop_cpu_s"] - extra["analyzer_cpu_s"]
               - extra["summaries_cpu_s"])
    records_work = (extra["analyzer_cpu_records_s"]
                    + loop * extra["analyzer_polls_with_records"] / polls)
    analyzer_always_on = (records_work / (steps_recorded * world)
                          + extra["summaries_cpu_s"] / (steps_all * world)) / cpu_step_off
    cpu_total = cpu_mean + analyzer_always_on
    return {
        "world": args.world, "rounds": args.rounds, "steps_per_block": args.steps_per_block,
        "warmup": args.warmup, "batch": args.batch, "poll_interval_s": args.poll_interval,
        "controller_here": args.controller_here,
        "analyzer": not args.no_analyzer, "malloc": args.malloc,
        "kernel": "native" if all(p.get("native") for p in per_rank) else "python",
        "mean_step_on_s": statistics.fmean(on_steps), "mean_step_off_s": mean_off,
        "median_step_on_s": statistics.median(on_steps),
        "median_step_off_s": statistics.median(off_steps),
        "ratio_of_means": statistics.fmean(on_steps) / statistics.fmean(off_steps) - 1.0,
        "overhead_mean": mean, "overhead_ci95": [lo, hi],
        "overhead_median": statistics.median(ratios),
        "overhead_stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
        "per_round": ratios,
        "overhead_block_medians_mean": statistics.fmean(median_ratios),
        "overhead_block_medians_ci95": list(_bootstrap_mean(median_ratios)),
        "overhead_steady_mean": statistics.fmean(steady_ratios) if steady_ratios else None,
        "overhead_steady_ci95": list(_bootstrap_mean(steady_ratios)) if steady_ratios else None,
        "bottom_up_hook": hook_share, "bottom_up_analyzer": analyzer_share,
        "records_per_step_on": records_on,
        "records_per_step_off": statistics.fmean(b["records_per_step"] for b in blocks
                                                 if b["mode"] == "off"),
        "target": TARGET, "target_met": mean <= TARGET,
        "target_within_ci": lo <= TARGET,
        "cpu_per_rank_step_on_s": cpu_step_on, "cpu_per_rank_step_off_s": cpu_step_off,
        "cpu_main_per_rank_step_on_s": main_on, "cpu_main_per_rank_step_off_s": main_off,
        "cpu_overhead_mean": cpu_mean, "cpu_overhead_ci95": [cpu_lo, cpu_hi],
        "cpu_overhead_median": statistics.median(cpu_ratios),
        "cpu_overhead_stdev": statistics.stdev(cpu_ratios) if len(cpu_ratios) > 1 else 0.0,
        "cpu_per_round": cpu_ratios,
        "cpu_overhead_per_rank": [statistics.fmean(v) for v in cpu_rank_ratios],
        "analyzer_cpu_share": analyzer_cpu_share,
        "analyzer_cpu_share_always_on": analyzer_always_on,
        "cpu_total_upper": cpu_mean + analyzer_cpu_share,
        "analyzer_cpu_share_all_steps": (extra["analyzer_loop_cpu_s"] / (steps_all * world)
                                         / cpu_step_off),
        "launcher_process_cpu_share": (extra["launcher_cpu_s"] / (steps_recorded * world)
                                       / cpu_step_off),
        "analyzer_poll_cpu_share": (extra["analyzer_cpu_s"] / (steps_recorded * world)
                                    / cpu_step_off),
        "cpu_total": cpu_total, "cpu_total_ci95": [cpu_lo + analyzer_always_on,
                                                   cpu_hi + analyzer_always_on],
        "cpu_target_met": cpu_total <= TARGET,
        "rank_cpu_target_met": cpu_mean <= TARGET,
        "analyzer_cpu_target_met": analyzer_always_on <= TARGET,
        **extra,
    }


def render(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    table = Table(title=(f"Tracking overhead: {res['world']}-rank gloo DDP, {res['rounds']} rounds "
                         f"x 2 blocks x {res['steps_per_block']} steps, hook on/off interleaved; "
                         f"{res['kernel']} kernel, malloc {res['malloc']}"))
    for col in ("capture", "mean step (ms)", "median step (ms)", "rank CPU/step (ms)",
                "records/step"):
        table.add_column(col, justify="left" if col == "capture" else "right")
    table.add_row("off (uninstalled)", f"{1e3 * res['mean_step_off_s']:.1f}",
                  f"{1e3 * res['median_step_off_s']:.1f}",
                  f"{1e3 * res['cpu_per_rank_step_off_s']:.2f}",
                  f"{res['records_per_step_off']:.2f}")
    table.add_row("on + LocalAnalyzer", f"{1e3 * res['mean_step_on_s']:.1f}",
                  f"{1e3 * res['median_step_on_s']:.1f}",
                  f"{1e3 * res['cpu_per_rank_step_on_s']:.2f}",
                  f"{res['records_per_step_on']:.2f}")
    console.print(table)

    def yes(flag: bool) -> str:
        return "[green]yes[/]" if flag else "[red]no[/]"

    over = Table(title=f"Overhead (target <= {TARGET:.1%} of step time; greyhound Fig. 18: "
                       "0.39%)")
    for col in ("measure", "mean", "bootstrap 95% CI", "median", "stdev over rounds",
                f"<= {TARGET:.1%}"):
        over.add_column(col, justify="left" if col == "measure" else "right")
    lo, hi = res["overhead_ci95"]
    over.add_row("wall-clock step time, on/off - 1", f"{res['overhead_mean']:+.2%}",
                 f"{lo:+.2%} .. {hi:+.2%}", f"{res['overhead_median']:+.2%}",
                 f"{res['overhead_stdev']:.2%}", yes(res["target_met"]))
    clo, chi = res["cpu_overhead_ci95"]
    over.add_row("rank CPU per step, on/off - 1", f"{res['cpu_overhead_mean']:+.2%}",
                 f"{clo:+.2%} .. {chi:+.2%}", f"{res['cpu_overhead_median']:+.2%}",
                 f"{res['cpu_overhead_stdev']:.2%}", yes(res["rank_cpu_target_met"]))
    over.add_row("node analyzer CPU per rank-step / rank CPU per step (always on)",
                 f"{res['analyzer_cpu_share_always_on']:+.2%}",
                 f"{res['analyzer_cpu_share_all_steps']:.2%} .. {res['analyzer_cpu_share']:.2%}",
                 "-", "-", yes(res["analyzer_cpu_target_met"]))
    tlo, thi = res["cpu_total_ci95"]
    over.add_row("CPU total (rank + analyzer always on)", f"{res['cpu_total']:+.2%}",
                 f"{tlo:+.2%} .. {thi:+.2%}", "-", "-", yes(res["cpu_target_met"]))
    console.print(over)
    d_main = res["cpu_main_per_rank_step_on_s"] - res["cpu_main_per_rank_step_off_s"]
    d_all = res["cpu_per_rank_step_on_s"] - res["cpu_per_rank_step_off_s"]
    console.print(
        "rank CPU overhead per rank: " + ", ".join(
            f"r{k} {v:+.2%}" for k, v in enumerate(res["cpu_overhead_per_rank"]))
        + f"; on - off per rank-step: main thread {1e3 * d_main:+.2f} ms, other threads (gloo, "
        f"hook callbacks) {1e3 * (d_all - d_main):+.2f} ms; node publisher thread CPU "
        f"{res['analyzer_loop_cpu_s']:.2f} s over {res['wall_s']:.0f} s: polls "
        f"{res['analyzer_cpu_s']:.2f} s ({res['analyzer_polls']}; those that read records "
        f"{res['analyzer_cpu_records_s']:.2f} s, {res['analyzer_polls_with_records']}), summaries "
        f"{res['summaries_cpu_s']:.2f} s ({res['summaries_published']}); always on "
        f"{res['analyzer_cpu_share_always_on']:.2%} of a rank's CPU, the whole thread charged to "
        f"the {res['warmup'] + res['rounds'] * res['steps_per_block']} steps x {res['world']} "
        f"ranks that wrote records {res['analyzer_cpu_share']:.2%} (upper bound; CPU total "
        f"{res['cpu_total_upper']:+.2%}), to all steps {res['analyzer_cpu_share_all_steps']:.2%};"
        f" the whole launcher process (with the TCPStore server the ranks use): "
        f"{res['launcher_cpu_s']:.2f} s, {res['launcher_process_cpu_share']:.2%}")
    lo, hi = res["overhead_ci95"]
    ok = "[green]met[/]" if res["target_met"] else "[red]NOT met[/]"
    console.print(
        f"overhead per round (on/off - 1, adjacent blocks): mean {res['overhead_mean']:+.2%} "
        f"(bootstrap 95% CI {lo:+.2%} .. {hi:+.2%}), median {res['overhead_median']:+.2%}, "
        f"stdev {res['overhead_stdev']:.2%}; ratio of all means {res['ratio_of_means']:+.2%}")
    blo, bhi = res["overhead_block_medians_ci95"]
    console.print(f"same with block medians (robust to single slow steps): mean "
                  f"{res['overhead_block_medians_mean']:+.2%} (95% CI {blo:+.2%} .. {bhi:+.2%})")
    if res["overhead_steady_mean"] is not None:
        slo, shi = res["overhead_steady_ci95"]
        console.print(f"same without the first step after each switch: mean "
                      f"{res['overhead_steady_mean']:+.2%} (95% CI {slo:+.2%} .. {shi:+.2%})")
    console.print(
        f"bottom-up: hook {res['per_call_us']['installed'] - res['per_call_us']['uninstalled']:.0f}"
        f" us/call extra (installed {res['per_call_us']['installed']:.0f}, uninstalled "
        f"{res['per_call_us']['uninstalled']:.0f}, never installed "
        f"{res['per_call_us']['never installed']:.0f}) x {res['records_per_step_on']:.1f} calls/"
        f"step = {res['bottom_up_hook']:.3%} of a step; LocalAnalyzer CPU "
        f"{res['bottom_up_analyzer']:.3%} of {res['cores']} cores; total "
        f"{res['bottom_up_hook'] + res['bottom_up_analyzer']:.2%}")
    console.print(f"target mean <= {TARGET:.1%} (greyhound Fig. 18: 0.39%), wall-clock: {ok}"
                  + ("" if res["target_met"] or not res["target_within_ci"]
                     else " (but the target lies inside the 95% interval)")
                  + "; CPU (rank + analyzer): "
                  + ("[green]met[/]" if res["cpu_target_met"] else "[red]NOT met[/]"))
    console.print(
        f"LocalAnalyzer: {res['analyzer_polls']} polls, {res['analyzer_cpu_s']:.2f} s CPU over "
        f"{res['wall_s']:.0f} s, {res['iterations_tracked']} iterations tracked, "
        f"{res['analyzer_records_lost']} records lost")


def kernel_env(kernel: str) -> dict[str, str]:
    """``$FAILSLOW_NATIVE_HOOK`` for ``--kernel`` (native: built now if it is not yet)."""
    from failslow import envvars

    return {envvars.NATIVE_HOOK: "1" if kernel == "native" else "0"}


def check_toggle(n: int = 3000) -> dict[str, float]:
    """Per-call cost of a small all-reduce (world 1): never installed, installed, uninstalled."""
    import torch
    import torch.distributed as dist

    import failslow.nccl_hook as hook

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    t = torch.ones(16)

    def per_call() -> float:
        for _ in range(200):
            dist.all_reduce(t)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            dist.all_reduce(t)
        return (time.perf_counter_ns() - t0) / n / 1e3

    res: dict[str, list[float]] = {"never installed": [], "installed": [], "uninstalled": []}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(3):
            res["never installed"].append(per_call())
        for _ in range(3):
            hook.install(d)
            res["installed"].append(per_call())
            hook.uninstall()
            res["uninstalled"].append(per_call())
    dist.destroy_process_group()
    return {k: statistics.median(v) for k, v in res.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=36)
    ap.add_argument("--steps-per-block", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=4, help="steps before the first block")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--poll-interval", type=float, default=0.05,
                    help="the node publisher's poll_s (s; the product's default)")
    ap.add_argument("--malloc", choices=("fixed", "dynamic"), default="fixed",
                    help="glibc's mmap threshold in the ranks: fixed (default) or dynamic")
    ap.add_argument("--kernel", choices=("native", "python"), default="native",
                    help="the hook's kernel in the ranks: native (C++, default) or python")
    ap.add_argument("--controller-here", action="store_true",
                    help="the node hosts the controller: no request counter read per poll")
    ap.add_argument("--keep", metavar="DIR", help="keep the rings and per-rank block times")
    ap.add_argument("--no-analyzer", action="store_true",
                    help="do not run the node publisher (isolates the hook's own cost)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--check-toggle", action="store_true",
                    help="only measure the per-call cost never-installed/installed/uninstalled")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ring-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.check_toggle:
        res = check_toggle()
        print(json.dumps(res, indent=2) if args.json else "\n".join(
            f"{k:>16}: {v:6.1f} us per all_reduce call" for k, v in res.items()))
        return 0
    if args.rounds < 2 or args.steps_per_block < 1:
        ap.error("--rounds must be >= 2 and --steps-per-block >= 1")
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        render(res)
    return 0 if res["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
