"""Downtime of a fail-stop: a rank SIGKILLed, the job back to training from memory - onto a warm
standby vs a cold restart in place vs a fresh launch from a disk checkpoint (issue 16).

Usage::

    python benchmarks/failstop_restart.py [--width 512] [--repeat 1]

The job is the DeepSpeed ZeRO-1 demo job (4 ranks, CPU/gloo, ``failslow.demo.ds_worker``) with
an in-memory snapshot (and its backup on a peer) every step. At step 15 or later - for the warm
way, once the launcher said its warm spares are ready (they start 10 s after a launch, one at a
time, ~35 s here) - rank 1's process gets SIGKILL from outside. The figure is the *downtime*:
the gap between the last step done before the kill and the first step done after it, less one
normal step (so the step in flight when the kill came, redone after the restore, counts as
downtime; ``lost`` is how many steps were done twice).

- **warm standby** (``failslow run --nproc-per-node 4 --standbys 1 --preload deepspeed``): the
  launcher sees the rank die through its pidfd, releases the survivors, moves the rank to the
  standby slot and restarts every rank from warm processes (torch and DeepSpeed imported), which
  restore from /dev/shm;
- **two nodes** (``--ways nodes``: two launchers, ``failslow run --nnodes 2 --node-rank K
  --nproc-per-node 2 --standbys 1 --store ...``, node 0 hosting the job's store and
  controller): the same job as two nodes of two ranks; node 1's second rank (the job's rank 3)
  is killed, node 1's launcher claims the launch's stop and moves it to its standby slot, node
  0's launcher stops its ranks when it reads the claim, and both relaunch from warm processes
  at node 0's new rendezvous (:mod:`failslow.node.nodes`);
- **an unexplained slowdown on two nodes** (``--ways nodes-slow``, ``--decline-every 2``): node
  1's slot 1 slows from step ``HANG_AT``; node 0's rounds of stack samples take every node's
  ranks' stacks, flag node 1's machine and both nodes relaunch;
- **a hang on two nodes** (``--ways nodes-hang``, ``--standbys 2 --hang-after 10``): node 1's
  machine hangs after step ``HANG_AT``; node 0's launcher looks across the nodes (node 1
  answers with its ranks' stacks), names node 1's machine and both nodes relaunch, node 1's
  ranks on its standbys;
- **cold restart in place** (``failslow run --max-restarts 1 -- torchrun ...``): torchrun sees
  the rank die and ends; the launcher restarts torchrun, every rank imports again and restores
  from /dev/shm (what failslow did before the node launched ranks itself);
- **fresh launch from disk** (plain ``torchrun``, :func:`hot_update.fresh`): every rank saves an
  ``engine.save_checkpoint`` to local disk, a new torchrun starts and loads it - the restart a
  job without failslow makes after a failure (its lost steps since the last disk checkpoint are
  not counted here: the figure is the restart alone, in its favour).

- **S4 restart (planned)** (the warm standby's launcher with ``--slots-as-hosts``): no kill - a
  restart plan evicting rank 1's host goes through the plan channel, as the controller sends it
  when it buys S4 for a slow rank (greyhound 5.2); every rank commits its snapshot at the plan's
  step and exits, and the launcher restarts every rank from warm processes with rank 1 on the
  standby slot, restoring from its holder's backup. Its downtime is the gap around the plan's
  step, less one normal step.

- **no standby: three ranks go on** (``--standbys 0 --min-ranks 3 --slots-as-hosts``, odyssey
  III-IV): the killed rank's slot (a host, its memory lost with it) is dropped; three ranks start
  from warm processes, gather all four old ranks' states (the lost one's from its holder's
  backup), re-cut the ZeRO-1 partitions and go on with the old global batch (16 micro-batches
  as 6, 5, 5). Its step after the loss is printed beside the one before, with what the model
  predicted from the old ranks' step profiles and what rank 0 measured (its log lines).

- **a machine hangs** (``--ways hang``; the warm standby's launcher with ``--slots-as-hosts
  --hang-after 10``): no kill - rank 1's machine hangs after step 50 (a plugin stops its
  training thread, ``FAILSLOW_DEMO_FAULT``; the others wait in their all-reduce, which gloo
  would end after 30 minutes). The launcher sees no collective on any rank for 10 s, names rank
  1 by stack aggregation (py-spy), evicts its slot onto the standby and restarts every rank from
  memory. "kill -> seen" is then the last step's end to the eviction (the 10 s, the
  aggregation's time in brackets); the downtime includes the 10 s.

- **a NaN loss** (``--ways nan``; the warm standby's launcher with ``--slots-as-hosts``): no
  kill - rank 1's model gets a NaN after step 50 (the fault plugin, first launch only); its loss
  of step 51 is NaN, ``failslow.report_metrics`` asks for a rollback, and the launcher restarts
  every rank from the newest snapshot before step 51 (the ladder's reattempt, byterobust 4.2).
  "kill -> seen" is step 50's end to the rollback request; the downtime is the gap between the
  last step done before the request and the first step done after the relaunch, less a step.

- **a silent corruption** (``--ways sdc``; the same launcher): from step 50 on, in every launch,
  rank 1's machine computes the gradient of the first layer 10,000x too large (the fault
  plugin). The gradient norm jumps at step 50; a reattempt from memory brings it back; the
  ladder replays step 50 on groups of two machines, horizontally then vertically, evicts the
  machine both name onto the standby and restarts from memory. The downtime includes the
  reattempt and the replay.

- **a faulty matmul** (``--ways matmul``; the same launcher): from step 50 on, every
  ``nn.Linear`` output of rank 1's machine is 8x too large, in every process there (the fault
  plugin, also in the stop-time checks' processes through ``$FAILSLOW_PLUGINS``). Its loss jumps
  at step 51; the ladder's first rung runs the stop-time checks on every machine (device,
  links, a reference step compared bit for bit), which name machine 1, evicted onto the
  standby; the job restarts from memory before step 51. ``--ways nan-nochecks`` is the NaN
  loss under ``failslow run --no-stop-checks``: the reattempt without the checks, for their
  cost. ``--ways nodes-nan,nodes-matmul``: the same faults on node 1 of two launchers (its
  rank 3): node 0's ladder takes every node's rungs, and the checks run on all four machines in
  one world across the nodes, node 0 judging every node's results (:mod:`failslow.node.
  incidents`, :mod:`failslow.node.stop_checks`).

- **an unexplained slowdown** (``--ways slow``, with ``--steps 120``; the same launcher with
  ``--decline-every 2 --threshold 2.0``): from step 50 on, rank 1's machine spends 0.6 s per
  step in a slow data loader (the fault plugin): every step is slower, yet the controller's
  validation round finds every rank's GEMM and links healthy. The launcher's decline watch
  takes 5 rounds of 5 stack samples 2 s apart, flags machine 1 and evicts it onto the standby;
  the job restarts from memory. "kill -> seen" is the slowdown's first step to the eviction
  (detection, validation, the rounds); the downtime is the restart's gap less one step from
  before the slowdown.

- **Megatron: reroute vs reconfigure** (``--ways reroute,reconfigure``; the GPT job,
  ``failslow.demo.megatron_worker``, TP1 x PP2 x DP2, hidden 256, 8 micro-batches of 8 per step,
  Adam; ``--standbys 0 --min-ranks 2 --slots-as-hosts``): rank 1 (stage 0 of replica 1) is
  killed; the launcher's odyssey chooses the layout from the ranks' layout notes. ``reroute``
  bounds a rank to 2 layers (``--max-stage-layers 2``), so the replica that lost a stage is
  dropped (PP2 x DP1, rank 1's pipeline partner stands by); ``reconfigure`` leaves it free, and
  odyssey moves to PP1 x DP3. Printed: the model's step before and after beside the measured
  ones (the step before and after are medians of the job's own step times), and the step's
  change after / before: measured, then on dedicated cores (times the CPU share each rank
  gains when fewer ranks share this machine's cores - odyssey's model is for dedicated
  devices), then the model's.

Also printed: kill -> detected (the launcher's record, warm only) and the ratios.
``--ways warm,shrink`` runs only those (the fresh launch from disk always runs unless
``--no-fresh``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from hot_update import TORCHRUN, fresh

from failslow.demo.worker_io import launch_env

STEPS = 80
KILL_AT = 15
HANG_AT, HANG_AFTER = 50, 10
READY = "warm spares ready"
VICTIM = 1
SETTINGS = {"checkpoint": {"every_steps": 1}, "planner": {"strategies": ["S2"]}}


def _evict(log: Path, token: str) -> int:
    """Send the S4 plan that evicts the victim's host (one slot per host); its step."""
    import socket

    from failslow.core.control.plan_channel import dispatch
    from failslow.core.control.store import open_store
    from failslow.core.planner.plans import RestartPlan

    url = re.search(r"store embedded, (tcp://\S+);", log.read_text())
    assert url is not None, "no embedded store in the launcher's log"
    plan = RestartPlan(evict=(f"{socket.gethostname()}-slot{VICTIM}",), overhead_s=0.0)
    with open_store(url.group(1)) as store:
        outcome = dispatch(store, plan, world_size=4, horizon_steps=2, token=token)
    if not outcome.committed:
        raise SystemExit(f"S4: the restart plan was not committed ({outcome.reason})")
    return int(outcome.apply_step)


def _kill_and_measure(
    tmp: Path,
    name: str,
    width: int,
    launcher: list[str],
    steps: int = STEPS,
    planned: bool = False,
    job_env: dict[str, str] | None = None,
    fault: str | None = None,
    fault_at: int = HANG_AT,
    nodes: int = 1,
) -> dict[str, Any]:
    """``planned``: an S4 restart plan evicts the victim's host instead of a kill;
    ``job_env``: the worker's settings over the DeepSpeed job's; ``fault``: no kill - after
    step ``HANG_AT`` the victim's machine hangs (``hang``: the launcher finds it), or its model
    gets a NaN (``nan``: the job rolls back), through the fault plugin; ``nodes``: that many
    launchers (``--nnodes``, the job's store hosted by node 0's), the victim the last node's
    local rank ``VICTIM``."""
    hang_at = fault_at if fault is not None else None
    out = tmp / name
    out.mkdir()
    settings = {
        "FAILSLOW_DEMO_WIDTH": str(width), "FAILSLOW_DEMO_MICRO_BATCH_SIZE": "32",
        "FAILSLOW_DEMO_CONFIG": json.dumps(SETTINGS), **(job_env or {}),
    }  # fmt: skip
    if fault is not None:
        spec = {"kind": fault, "slot": VICTIM, "step": hang_at}
        settings["FAILSLOW_DEMO_FAULT"] = json.dumps(spec)
        settings["FAILSLOW_PLUGINS"] = "failslow.demo.fault_plugin"  # the stop-time checks' too
    env = launch_env(out, steps, **settings)
    shm = Path(tempfile.mkdtemp(prefix="failslow-fsbench-", dir="/dev/shm"))
    token = "failstop-restart-benchmark"
    port = _free_port() if nodes > 1 else 0
    procs, logs = [], []
    for node in range(nodes):  # node 0 hosts the controller (and the job's store)
        tag = "" if node == 0 else f"-node{node}"
        several = [] if nodes == 1 else [
            "--nnodes", str(nodes), "--node-rank", str(node),
            "--store", f"tcp://127.0.0.1:{port}" + ("?master=1" if node == 0 else ""),
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "failslow.cli", "run",
               *(["--controller", "4"] if node == 0 else []), "--no-shim",
               "--ring-dir", str(tmp / f"{name}-rings{tag}"),
               "--state-dir", str(tmp / f"{name}-state{tag}"),
               "--snapshot-dir", str(shm / f"node{node}"), "--job-token", token,
               "--max-restarts", "1", *several, *launcher]  # fmt: skip
        logs.append(tmp / f"{name}{tag}.log")
        node_env = env if nodes == 1 else {**env, "FAILSLOW_HOST": f"node{node}"}
        if node != nodes - 1:  # the fault is the last node's machine's
            node_env = {k: v for k, v in node_env.items() if k != "FAILSLOW_DEMO_FAULT"}
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=logs[-1].open("w"),
                                      stderr=subprocess.STDOUT))  # fmt: skip
    victim = (nodes - 1) * 4 // nodes + VICTIM  # the job has 4 ranks
    rings = tmp / f"{name}-rings{'' if nodes == 1 else f'-node{nodes - 1}'}"
    state = tmp / f"{name}-state{'' if nodes == 1 else f'-node{nodes - 1}'}"
    plan: concurrent.futures.Future[int] | None = None
    progress = out / "progress-rank0.json"
    seen: dict[int, float] = {}
    try:
        warm = launcher[0] == "--nproc-per-node"  # (torchrun has the flag too)

        def due() -> bool:  # warm: once every launcher said its spares are ready
            if max(seen, default=-1) < KILL_AT:
                return False
            return not warm or all(READY in log.read_text() for log in logs)

        def poll() -> None:  # when each step was first seen done
            try:
                steps = json.loads(progress.read_text())["steps"]
            except (OSError, ValueError, KeyError):
                steps = []
            now = time.time()
            for step, _ in steps:
                seen.setdefault(int(step), now)
            time.sleep(0.02)

        while hang_at is None and not due():
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"{name}: the job ended early ({[p.poll() for p in procs]})")
            poll()
        killed_at = time.time()
        if hang_at is not None:
            pass  # the machine hangs, or the model goes NaN, by itself
        elif planned:  # sent from a thread: the steps go on being timed while it is agreed
            pool = concurrent.futures.ThreadPoolExecutor(1)
            plan = pool.submit(_evict, tmp / f"{name}.log", token)
            pool.shutdown(wait=False)
        else:
            ring = max(rings.glob(f"rank{victim:05d}-pid*.ring"), key=lambda p: p.stat().st_mtime)
            pid = int(re.search(r"pid(\d+)", ring.name).group(1))  # type: ignore[union-attr]
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 600
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            poll()  # a planned restart comes a few steps after the plan
        if any(p.wait(timeout=1) != 0 for p in procs):
            raise SystemExit(f"{name}: the job failed; see {', '.join(map(str, logs))}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(shm, ignore_errors=True)
    records = [json.loads(p.read_text()) for p in out.glob("steps-rank0*.json")]
    record = max(records, key=lambda r: r["first_step"])  # the launch after the restart
    extra: dict[str, Any] = {}
    if plan is not None:  # every rank stopped at the plan's step
        last = plan.result() - 1
    elif fault == "hang":  # the steps through hang_at ended, the next never did
        last = hang_at
        killed_at = seen[last]
    elif fault in ("nan", "sdc", "matmul"):  # rank 0 may have ended the bad step
        ladder = tmp / f"{name}-state" / "incidents.jsonl"  # node 0's: it takes the rungs
        rungs = [json.loads(line) for line in ladder.read_text().splitlines()]
        # nan, matmul: the fault comes when step 50 ends; sdc: the corrupt step 50 starts
        # after step 49
        killed_at = seen[hang_at] if fault != "sdc" else seen[hang_at - 1]
        last = max(s for s, t in seen.items() if t <= rungs[0]["wall"])
        extra = {
            "detected_s": rungs[0]["wall"] - killed_at,
            "rung": " -> ".join(r["rung"] for r in rungs if "result" not in r["rung"]),
        }
        checks = [r["checks"] for r in rungs if "checks" in r]
        if checks:
            extra["checks_s"] = sum(c["seconds"] for c in checks)
            if checks[-1]["suspects"]:
                extra["rung"] += f" {checks[-1]['suspects']}"
        replays = [r["replay"] for r in rungs if "replay" in r]
        if replays:
            extra["replay_s"] = replays[-1]["seconds"]
            extra["rung"] += f" {replays[-1]['suspects']}"
    elif fault == "slow":  # every step from fault_at on is slower, until the eviction
        if not (state / "failstops.jsonl").exists():
            raise SystemExit(f"{name}: nothing was evicted; see {tmp / (name + '.log')}")
        stop = json.loads((state / "failstops.jsonl").read_text().splitlines()[0])
        declines = tmp / f"{name}-state" / "declines.jsonl"  # node 0 takes the rounds
        rounds = [json.loads(line) for line in declines.read_text().splitlines()]
        killed_at, last = seen[hang_at], max(s for s, t in seen.items() if t <= stop["wall"])
        extra = {"decline_rounds": len(rounds), "evicted": stop["rank"],
                 "dumps_s": sum(r["aggregation_s"] for r in rounds)}  # fmt: skip
    else:
        last = max(s for s, t in seen.items() if t <= killed_at)
    first_done_after = record["step_end"][1]
    # the normal step: before the slowdown when there is one
    before = sorted(s for s in seen if s <= (hang_at if fault == "slow" else last))[-11:]
    step_s = statistics.median(seen[b] - seen[a] for a, b in itertools.pairwise(before))
    after = record["step_end"][-11:]
    gap = first_done_after - seen[last]
    result = {
        "step_s": step_s, "gap_s": gap, "downtime": gap - step_s,
        "lost": last + 1 - record["first_step"], "resumed": record["first_step"],
        "step_after_s": statistics.median(b - a for a, b in itertools.pairwise(after)),
        **extra,
    }  # fmt: skip
    text = (tmp / f"{name}.log").read_text()
    chosen = re.search(
        r"odyssey (\w+): (\S+) -> (\S+) on (\d+) ranks.*against ([\d.]+) s before", text
    )
    if chosen:
        result["odyssey"] = f"{chosen.group(1)}: {chosen.group(2)} -> {chosen.group(3)}"
        result["estimated_before_s"] = float(chosen.group(5))
        # the model is for dedicated devices; here fewer ranks share the same cores
        result["share_gain"] = _core_share(int(chosen.group(4))) / _core_share(4)
    estimated = re.search(r"step estimated ([\d.]+) s", text)
    measured = re.search(r"the step measured ([\d.]+) s against", text)
    if estimated:
        result["estimated_s"] = float(estimated.group(1))
    if measured:
        result["measured_s"] = float(measured.group(1))
    hangs = tmp / f"{name}-state" / "hangs.jsonl"  # node 0 looks at a hang
    if hangs.exists():  # the look that named the hung rank
        looks = [json.loads(line) for line in hangs.read_text().splitlines()]
        named = [look for look in looks if look["suspects"] is not None]
        if named:
            result["aggregation_s"] = named[0]["aggregation_s"]
    stops = state / "failstops.jsonl"
    if stops.exists() and not planned and fault not in ("nan", "sdc", "matmul"):
        result["detected_s"] = json.loads(stops.read_text().splitlines()[0])["wall"] - killed_at
    return result


FAULTS = {
    # a way that injects a fault: the fault plugin's kind
    "hang": "hang", "nodes-hang": "hang", "nan": "nan", "nan-nochecks": "nan", "nodes-nan": "nan",
    "sdc": "sdc", "matmul": "matmul", "nodes-matmul": "matmul", "slow": "slow",
    "nodes-slow": "slow",
}  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _core_share(ranks: int) -> float:
    """The cores one rank gets when ``ranks`` share this machine's."""
    return min(1.0, len(os.sched_getaffinity(0)) / ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--ways",
        default="warm,nodes,cold,s4,shrink,hang,nodes-hang,nan,nan-nochecks,sdc,matmul,reroute,reconfigure",
        help="comma-separated",
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of each job")
    parser.add_argument(
        "--fault-at", type=int, default=HANG_AT,
        help=f"the injected faults' step (default {HANG_AT}; later, e.g. 110 with --steps 140, "
        "when the stop-time checks' warm processes should be ready: they start after the "
        "job's spares)",
    )  # fmt: skip
    parser.add_argument("--no-fresh", action="store_true", help="skip the fresh launch")
    args = parser.parse_args()
    console = Console(width=200)
    table = Table(title="a rank SIGKILLed in a 4-rank job (CPU/gloo): downtime and the step after")
    for col in ("run", "way", "kill -> seen", "resumed at", "lost steps", "normal step",
                "gap", "downtime", "x warm", "odyssey", "model's step before", "step after",
                "model's step after", "rank 0 measured", "measured / model",
                "after / before: measured, on dedicated cores", "model"):  # fmt: skip
        table.add_column(col)
    megatron = [
        "--nproc-per-node", "4", "--standbys", "0", "--min-ranks", "2", "--preload",
        "megatron.core", "--slots-as-hosts", "--spare-delay", "2", "--",
        "-m", "failslow.demo.megatron_worker",
    ]  # fmt: skip
    gpt = {"FAILSLOW_DEMO_MICRO_BATCH_SIZE": "8", "FAILSLOW_DEMO_WIDTH": "256"}
    ways = {
        "warm": ("warm standby (memory)", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--", "-m", "failslow.demo.ds_worker",
        ]),
        "nodes": ("2 nodes x 2 ranks: both relaunch, the standby on node 1", [
            "--nproc-per-node", "2", "--standbys", "1", "--preload", "deepspeed",
            "--", "-m", "failslow.demo.ds_worker",
        ]),
        "cold": ("cold restart in place (memory)", ["--", *TORCHRUN]),
        "s4": ("S4 restart onto the standby (planned)", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--slots-as-hosts", "--spare-delay", "2", "--", "-m", "failslow.demo.ds_worker",
        ]),
        "shrink": ("no standby: 3 ranks go on (memory)", [
            "--nproc-per-node", "4", "--standbys", "0", "--min-ranks", "3",
            "--preload", "deepspeed", "--slots-as-hosts", "--spare-delay", "2",
            "--", "-m", "failslow.demo.ds_worker",
        ]),
        "nodes-hang": ("2 nodes x 2 ranks: node 1 hangs, found across the nodes", [
            "--nproc-per-node", "2", "--standbys", "2", "--preload", "deepspeed",
            "--spare-delay", "2", "--hang-after", str(HANG_AFTER),
            "--", "-m", "failslow.demo.ds_worker",
        ]),
        "hang": ("a machine hangs: found by its stack, onto the standby", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--slots-as-hosts", "--spare-delay", "2", "--hang-after", str(HANG_AFTER),
            "--", "-m", "failslow.demo.ds_worker",
        ]),
        "nodes-slow": ("2 nodes x 2 ranks: node 1 slows, rounds across the nodes", [
            "--nproc-per-node", "2", "--standbys", "2", "--preload", "deepspeed",
            "--spare-delay", "2", "--decline-every", "2", "--threshold", "2.0",
            "--", "-m", "failslow.demo.ds_worker",
        ], {"FAILSLOW__VALIDATION__GEMM_SERIAL": "true"}),
        "nodes-nan": ("2 nodes x 2 ranks: node 1's NaN loss, one ladder across the nodes", [
            "--nproc-per-node", "2", "--standbys", "1", "--preload", "deepspeed",
            "--spare-delay", "2", "--", "-m", "failslow.demo.ds_worker",
        ]),
        "nodes-matmul": ("2 nodes x 2 ranks: node 1's faulty matmul, checks across the nodes", [
            "--nproc-per-node", "2", "--standbys", "1", "--preload", "deepspeed",
            "--spare-delay", "2", "--", "-m", "failslow.demo.ds_worker",
        ]),
        "nan": ("a NaN loss: every rank rolled back (memory)", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--slots-as-hosts", "--spare-delay", "2", "--", "-m", "failslow.demo.ds_worker",
        ]),
        "nan-nochecks": ("a NaN loss, --no-stop-checks: rolled back", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--slots-as-hosts", "--spare-delay", "2", "--no-stop-checks",
            "--", "-m", "failslow.demo.ds_worker",
        ]),
        "sdc": ("a silent corruption: replay names it, onto the standby", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--slots-as-hosts", "--spare-delay", "2", "--", "-m", "failslow.demo.ds_worker",
        ]),
        "matmul": ("a faulty matmul: the stop-time checks name it, onto the standby", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--slots-as-hosts", "--spare-delay", "2", "--", "-m", "failslow.demo.ds_worker",
        ]),
        "slow": ("an unexplained slowdown: rounds of stacks, onto the standby", [
            "--nproc-per-node", "4", "--standbys", "1", "--preload", "deepspeed",
            "--slots-as-hosts", "--spare-delay", "2", "--decline-every", "2",
            # link timings on 2 shared cores vary by 1.2x: the default threshold (1.1) then
            # reads noise as a slow link, a diagnosis that (rightly) cancels the rounds
            "--threshold", "2.0", "--", "-m", "failslow.demo.ds_worker",
        ], {"FAILSLOW__VALIDATION__GEMM_SERIAL": "true"}),
        "reroute": ("Megatron PP2xDP2, no standby: reroute", [
            "--max-stage-layers", "2", *megatron
        ], gpt),
        "reconfigure": ("Megatron PP2xDP2, no standby: reconfigure", megatron, gpt),
    }  # fmt: skip
    chosen = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = sorted(set(chosen) - set(ways))
    if unknown or not chosen:
        raise SystemExit(f"--ways: choose from {', '.join(ways)}, got {args.ways!r}")
    for i in range(args.repeat):
        results = {}
        for key in chosen:
            name, launcher, *job_env = ways[key]
            with tempfile.TemporaryDirectory(prefix="failslow-fsbench-", dir="/tmp") as t:
                console.print(f"run {i + 1}: {name} ...")
                results[name] = _kill_and_measure(
                    Path(t), "job", args.width, launcher, args.steps, planned=key == "s4",
                    fault_at=args.fault_at, nodes=2 if key.startswith("nodes") else 1,
                    job_env=job_env[0] if job_env else None,
                    fault=FAULTS.get(key, key) if key in FAULTS or key in FAULTS.values()
                    else None,
                )  # fmt: skip
        if not args.no_fresh:
            with tempfile.TemporaryDirectory(prefix="failslow-fsbench-", dir="/tmp") as t:
                console.print(f"run {i + 1}: fresh launch from disk ...")
                f = fresh(Path(t), args.width)
                results["fresh launch (disk)"] = {**f, "lost": 0, "resumed": f["step"]}
        warm = results.get("warm standby (memory)", {}).get("downtime")

        def seconds(r: dict[str, float], key: str, digits: int = 3) -> str:
            return f"{r[key]:.{digits}f} s" if key in r else "-"

        for name, r in results.items():
            seen = f"{r['detected_s'] * 1000:.0f} ms" if "detected_s" in r else "-"
            if "aggregation_s" in r:  # a hang is seen --hang-after later, by its stacks
                seen = f"{r['detected_s']:.1f} s (stacks {r['aggregation_s'] * 1000:.0f} ms)"
            if "decline_rounds" in r:  # a slowdown: from its first step to the eviction
                seen = (f"{r['detected_s']:.1f} s ({r['decline_rounds']} rounds, dumps "
                        f"{r['dumps_s']:.1f} s -> evict [{r['evicted']}])")  # fmt: skip
            if "rung" in r:  # a NaN or SDC: from the bad step's end to the first request
                seen = f"{r['detected_s'] * 1000:.0f} ms ({r['rung']})"
                if "checks_s" in r:
                    seen += f", checks {r['checks_s']:.1f} s"
                if "replay_s" in r:
                    seen += f", replay {r['replay_s']:.1f} s"
            table.add_row(
                str(i + 1), name, seen, str(r["resumed"]), str(r["lost"]),
                f"{r['step_s']:.2f} s", f"{r['gap_s']:.1f} s", f"{r['downtime']:.1f} s",
                f"{r['downtime'] / warm:.2f}x" if warm else "-", r.get("odyssey", "-"),
                seconds(r, "estimated_before_s"), seconds(r, "step_after_s"),
                seconds(r, "estimated_s"), seconds(r, "measured_s"),
                f"{r['measured_s'] / r['estimated_s']:.2f}x"
                if "measured_s" in r and "estimated_s" in r else "-",
                f"{r['step_after_s'] / r['step_s']:.2f}x, "
                f"{r['step_after_s'] * r['share_gain'] / r['step_s']:.2f}x"
                if "share_gain" in r else "-",
                f"{r['estimated_s'] / r['estimated_before_s']:.2f}x"
                if "estimated_before_s" in r else "-",
            )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
