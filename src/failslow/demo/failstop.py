"""``failslow demo --framework deepspeed --fault kill``: ranks SIGKILLed while the job trains,
the job back from memory on warm standbys, the model unchanged (issue 16; byterobust 6.2-6.3).

The 4-rank DeepSpeed ZeRO-1 demo job (:mod:`failslow.demo.ds_worker`, an in-memory snapshot
and its backup on a peer every step) runs under what users run::

    failslow run --controller 4 --nproc-per-node 4 --standbys 1 --preload deepspeed \\
        --spare-delay 2 --slots-as-hosts --max-restarts K -- -m failslow.demo.ds_worker

From outside, this demo SIGKILLs the process of one rank at each step of ``kill_steps`` (once
the launcher said its warm spares are ready, so the restart is the one a long job gets). The
launcher sees each death at once, releases the survivors, moves the first victim's rank to the
standby slot and restarts every rank from warm processes; every rank resumes from the snapshots.
One machine stands for five (``--slots-as-hosts``): each slot has its own memory, the evicted
slot's goes with it, and the rank on the standby slot pulls its state from its holder's backup.
Then the same job runs once more without kills, and the final parameters of both are compared
(bitwise: a restart from a bitwise snapshot runs the same math).

The live view shows the step, the launch and each kill, fail-stop and resume; ``summary.json``
has ``lost_steps`` and ``downtime_s`` (per restart and in total), the action taken per
fail-stop and the parameter comparison.

``--fault hang`` (DeepSpeed) kills nothing: the machine of ``--slow-rank``'s slot hangs at 2/7
of the run (a fault plugin stops its rank's training thread; the others wait in their
all-reduce). The launcher (``--hang-after 10``) sees no collective on any rank, names the rank by
stack aggregation, evicts its slot onto the standby and restarts every rank from memory;
``summary.json`` adds ``incident``, ``rungs``, ``suspects`` and the launcher's looks.

``--fault nan`` (DeepSpeed) kills nothing either: the model of ``--slow-rank``'s rank gets a NaN
at 2/7 of the run, in the first launch only (a transient fault, through a plugin). Its loss goes
NaN, ``failslow.report_metrics`` in the worker's loop asks for a rollback, and the launcher
climbs the stop-time ladder: every rank restarts from the newest snapshot before the bad step
(byterobust 4.1-4.2); ``summary.json`` adds the incident and the rungs (``incidents.jsonl``).

``--fault sdc`` (DeepSpeed): from 2/7 of the run on, ``--slow-rank``'s machine computes one
gradient 10,000x too large, in every launch (a faulty GPU). The gradient norm every rank reports
jumps; a reattempt from memory does not clear it, there is no code update to roll back, so the
launcher replays the step on groups of machines (dual-phase replay, byterobust Alg. 1), evicts
the machine both phases name onto the standby and restarts from memory; ``summary.json`` adds
the replay's groups and verdicts and the ``suspects``.

``--fault matmul`` (DeepSpeed): from 2/7 of the run on, every ``nn.Linear`` output of
``--slow-rank``'s machine is 8x too large (a defective device), in every process there. Its loss
jumps; the ladder's first rung runs the stop-time checks on every machine - a GEMM, a link
ring and one step of a reference model compared bit for bit - and the reference step names the
machine, evicted onto the standby; ``summary.json`` adds the checks' table and the ``suspects``.

``--fault slow`` (DeepSpeed): from 2/7 of the run on, ``--slow-rank``'s rank spends 0.6 s per
step in a slow data loader (a plugin). Every step gets slower, yet the controller's validation
round finds every rank's GEMM and links healthy: nothing localized. The launcher
(``--decline-every 2``) takes 5 rounds of 5 stack samples of every rank, evicts the machine
flagged in more than half of them onto the standby while the step time is still up, and
restarts every rank from memory (byterobust 5.1, MFU decline); ``summary.json`` adds the rounds
(``declines.jsonl``) and the ``suspects``.

``--framework megatron`` runs the same with Megatron-core's GPT on TP1 x PP2 x DP2
(:mod:`failslow.demo.megatron_worker`); with ``--no-standby`` the launcher chooses each smaller
world's grid (odyssey's reroute or reconfigure), named in the action, and the final model is
compared by Megatron's layout-free tensor names.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from failslow import envvars
from failslow.core.control.journal import JOURNAL, read_journal
from failslow.core.diagnosis.stacks import DeclineTally
from failslow.demo import fault_plugin, rank_launch
from failslow.demo.rank_launch import READY, RESUMED
from failslow.demo.run_dir import new_run_dir
from failslow.errors import FailslowError

DECLINE_EVERY_S = 2.0
"""``--fault slow``: a round of stack samples this often (the paper's 10 s, shortened
for a demo)."""


@dataclass
class FailstopDemoOptions:
    world_size: int = 4
    steps: int = 400
    kill_steps: tuple[int, ...] = (114, 257)
    """Kill a rank at (or, waiting for warm spares, after) each of these steps."""
    victims: tuple[int, ...] = (2, 1)
    """The rank killed at each kill step."""
    standbys: int = 1
    min_ranks: int | None = None
    """``failslow run --min-ranks``: with no standby left, a killed rank's slot is dropped and
    the job goes on with one rank fewer (the parameters then match within 1e-5, not bitwise);
    on Megatron's grid in the layout odyssey chooses."""
    framework: str = "deepspeed"
    """``deepspeed`` (the ZeRO-1 job) or ``megatron`` (GPT on TP1 x PP2 x DP2)."""
    injected: tuple[str, int, int] | None = None
    """``(kind, slot, step)``: instead of kills, a fault plugin (:mod:`.fault_plugin`) -
    ``hang``: the machine of that slot hangs after that step, and the launcher finds it with
    ``--hang-after``, by stack aggregation; ``nan``: that slot's model gets a NaN after that
    step, and the job rolls back."""
    hang_after_s: float = 10.0
    out_dir: Path | None = None
    live: bool = True
    reference: bool = True
    """Run the job once more without kills and compare the parameters."""
    spare_wait_s: float = 120.0
    """How long a kill waits for the warm spares (then, or 30 steps before the end, it kills
    anyway: a cold restart)."""
    timeout_s: float = 1800.0

    def validate(self) -> None:
        if self.framework not in rank_launch.WORKERS:
            raise FailslowError(
                f"demo --fault kill: framework {self.framework!r} is not one of "
                f"{sorted(rank_launch.WORKERS)}"
            )
        if self.framework == "megatron" and self.world_size != 4:
            raise FailslowError("demo --fault kill: the Megatron job runs PP2 x DP2 on 4 ranks")
        if self.injected is not None and (
            self.kill_steps or self.injected[0] not in fault_plugin.KINDS
            or not 0 <= self.injected[1] < self.world_size
            or not 0 < self.injected[2] < self.steps - 5
        ):  # fmt: skip
            raise FailslowError(
                f"demo --fault {self.injected[0]}: the faulty slot must be a rank's "
                f"(0..{self.world_size - 1}) and its step within 1..{self.steps - 6}, with no "
                f"kills"
            )
        if len(self.victims) != len(self.kill_steps):
            raise FailslowError("demo --fault kill: one victim rank per kill step")
        if any(not 0 <= v < self.world_size for v in self.victims):
            raise FailslowError(f"demo --fault kill: victims must be ranks of {self.world_size}")
        if self.min_ranks is not None and not 1 <= self.min_ranks <= self.world_size:
            raise FailslowError(f"demo --fault kill: min_ranks must be in 1..{self.world_size}")
        if list(self.kill_steps) != sorted(self.kill_steps) or any(
            not 0 < k < self.steps - 5 for k in self.kill_steps
        ):
            raise FailslowError(
                f"demo --fault kill: kill steps must increase, within 1..{self.steps - 6}"
            )


@dataclass
class _Run:
    step: int = -1
    launch: int = 0
    events: list[str] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    seen: dict[int, float] = field(default_factory=dict)
    """When each step was first seen done (before the last kill)."""


@contextlib.contextmanager
def _live(run: _Run, opts: FailstopDemoOptions, enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield lambda: None
        return
    from rich.live import Live
    from rich.table import Table

    def render() -> Table:
        job = rank_launch.WORKERS[opts.framework][3]
        table = Table(title=f"failslow demo --fault kill: {opts.world_size}-rank {job}")
        table.add_column("step")
        table.add_column("launch")
        table.add_column("events (newest last)")
        table.add_row(
            f"{max(run.step, 0)}/{opts.steps}", str(run.launch), "\n".join(run.events[-8:])
        )
        return table

    with Live(render(), refresh_per_second=4, transient=False) as live:
        yield lambda: live.update(render())


def run_failstop_demo(opts: FailstopDemoOptions) -> dict[str, Any]:
    """Run the job with kills (and the reference without); returns the summary, also written to
    ``summary.json`` in the run directory."""
    opts.validate()
    out = new_run_dir(opts.out_dir, "kill")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="failslow-kill-", dir=shm) as t:
        tmp = Path(t)
        run = _Run()
        with _live(run, opts, opts.live) as refresh:
            _chaos(opts, tmp, out, run, refresh)
            reference = None
            if opts.reference:
                run.events.append("reference: the same job without the fault ...")
                refresh()
                reference = rank_launch.run_reference(
                    tmp,
                    out,
                    opts.steps,
                    world_size=opts.world_size,
                    timeout_s=opts.timeout_s,
                    framework=opts.framework,
                )
                run.events.append("reference done")
                refresh()
        stops = rank_launch.failstops(tmp / "chaos-state")
        for name in ("hangs.jsonl", "incidents.jsonl", "declines.jsonl"):
            found = tmp / "chaos-state" / name
            if found.exists():
                (out / name).write_text(found.read_text())
        journal = tmp / "chaos-rings" / "diagnoses" / JOURNAL  # the controller's
        if journal.exists():
            (out / JOURNAL).write_text(journal.read_text())
        stops += _rollbacks(out)
    summary = _summary(opts, run, stops, out, reference)
    _restore_sources(summary, (out / "job.log").read_text(errors="replace"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_table(summary, out)
    return summary


def chaos_env(opts: FailstopDemoOptions, job_out: Path) -> dict[str, str]:
    """The environment of the job with the fault: :data:`rank_launch.COMPARED` settings (every
    step snapshotted, no mitigation strategy), for the ranks and for the launcher's controller
    (:func:`~failslow.demo.worker_io.launch_env`) - its model is compared bitwise with the
    reference run's, and a micro-batch plan bought on a busy machine (the controller still
    detects and validates; on shared cores noise can read as a straggler) sums the gradients in
    another order: parameters 3.7e-9 apart, not bitwise (issue 49's kill demo under load,
    reproduced in ``benchmarks/soak.py``: two S2 plans applied and reverted)."""
    fault = {}
    if opts.injected is not None:
        kind, slot, step = opts.injected
        fault[fault_plugin.ENV] = json.dumps({"kind": kind, "slot": slot, "step": step})
        fault[envvars.PLUGINS] = fault_plugin.__name__  # its stop-time check hook, too
        if kind == "slow":  # one GEMM at a time in the validation round (2 shared cores)
            fault["FAILSLOW__VALIDATION__GEMM_SERIAL"] = "true"
    return rank_launch.job_env(job_out, opts.steps, opts.framework, rank_launch.COMPARED, **fault)


def _chaos(opts: FailstopDemoOptions, tmp: Path, out: Path, run: _Run, refresh: Any) -> None:
    job_out = out / "job"
    kind = opts.injected[0] if opts.injected is not None else None
    env = chaos_env(opts, job_out)
    argv = rank_launch.command(
        tmp, "chaos", world_size=opts.world_size, standbys=opts.standbys,
        restarts=max(1, len(opts.kill_steps)), min_ranks=opts.min_ranks,
        framework=opts.framework, hang_after_s=opts.hang_after_s if kind == "hang" else None,
        decline_every_s=DECLINE_EVERY_S if kind == "slow" else None,
        threshold=2.0 if kind == "slow" else None,
    )  # fmt: skip
    log_path = out / "job.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    rings = tmp / "chaos-rings"
    dead: set[int] = set()
    pending = list(zip(opts.kill_steps, opts.victims, strict=True))
    started = time.monotonic()
    waiting_since: float | None = None
    resumed_lines = 0
    try:
        while proc.poll() is None:
            if time.monotonic() - started > opts.timeout_s:
                raise FailslowError(f"demo: not done after {opts.timeout_s:.0f} s; see {log_path}")
            text = log_path.read_text(errors="replace")
            steps = [s for s, _ in rank_launch.progress(job_out)]
            now = time.time()
            _scan(text, run, opts, kind)  # before the resumes: the kill the next one ends
            lines = RESUMED.findall(text)
            if len(lines) > resumed_lines:  # a new launch finished its restore
                resumed_lines = len(lines)
                run.launch += 1
                if run.kills and "resumed" not in run.kills[-1]:
                    run.kills[-1]["resumed"] = int(lines[-1])
                    run.kills[-1]["resumed_seen"] = now
                run.events.append(f"every rank resumed from memory at step {lines[-1]}")
            kill = run.kills[-1] if run.kills else None
            if kill is not None and "resumed_seen" in kill and "first_step_done" not in kill:
                mtime = (job_out / "progress-rank0.json").stat().st_mtime
                if mtime > kill["resumed_seen"] and steps:
                    kill["first_step_done"] = mtime
            if steps:
                run.step = max(steps)
                if kill is None or "first_step_done" in kill:
                    for s in steps:
                        run.seen.setdefault(s, now)
            trained = kill is None or "first_step_done" in kill  # the last restart trains
            if pending and run.step >= pending[0][0] and trained:
                waiting_since = waiting_since or time.monotonic()
                ready = text.count(READY) >= run.launch + 1
                late = run.step >= opts.steps - 30
                if ready or late or time.monotonic() - waiting_since > opts.spare_wait_s:
                    _, victim = pending.pop(0)
                    pid = rank_launch.pid_of(rings, victim, dead)
                    if pid is not None:
                        done = run.step
                        os.kill(pid, signal.SIGKILL)
                        dead.add(pid)
                        run.kills.append(
                            {"rank": victim, "pid": pid, "step_done": done, "at": time.time(),
                             "last_step_seen_at": run.seen.get(done), "warm": ready}
                        )  # fmt: skip
                        run.events.append(f"SIGKILL rank {victim} (pid {pid}) after step {done}")
                    waiting_since = None
            refresh()
            time.sleep(0.05)
    finally:
        rank_launch.end(proc)
    if proc.returncode != 0:
        raise FailslowError(f"demo: the job failed with status {proc.returncode}; see {log_path}")
    run.step = opts.steps
    run.events.append("the job finished")
    refresh()


def _scan(text: str, run: _Run, opts: FailstopDemoOptions, kind: str | None) -> None:
    """The launcher's lines worth showing, and the injected fault's rank as the incident's
    "kill" once the launcher acted on it."""
    for line in text.splitlines()[-50:]:
        event = line.removeprefix("failslow run: ")
        shown = (" died (", " hung (", "hang: ", "reattempt: ", "roll back code: ",
                 "needs a person: ", "replay (", "replay: ", "stop-time checks",
                 "evict: ", "decline: ")  # fmt: skip
        if any(x in line for x in shown) or event.startswith("odyssey "):
            if event not in run.events:
                run.events.append(event)
        seen = {"hang": " hung (", "nan": "failslow run: reattempt: rank ",
                "sdc": " corrupts its steps (", "matmul": " failed the stop-time checks",
                "slow": " slows the job ("}.get(kind or "")  # fmt: skip
        if seen is not None and seen in line and not run.kills:
            # the faulty rank is the incident's "kill", after the last step done well: a hung
            # one did not end the step after the fault's, a NaN one's peers may have, a
            # corrupt step is never done well
            fault = opts.injected[2] if opts.injected is not None else run.step
            last = {"nan": max(fault, run.step), "sdc": fault - 1,
                    "slow": run.step}.get(kind or "", fault)  # fmt: skip
            rank = int(re.search(r"rank (\d+)", line).group(1))  # type: ignore[union-attr]
            # a slowdown's "seen" counts from its first slow step to the eviction
            began = fault if kind == "slow" else last
            run.kills.append(
                {"rank": rank, "pid": 0, "step_done": last,
                 "at": run.seen.get(began, time.time()),
                 "last_step_seen_at": run.seen.get(last), "warm": READY in text}
            )  # fmt: skip


def _summary(
    opts: FailstopDemoOptions,
    run: _Run,
    stops: list[dict[str, Any]],
    out: Path,
    reference: Path | None,
) -> dict[str, Any]:
    times = sorted(run.seen.values())
    normal = [b - a for a, b in itertools.pairwise(times)]
    step_s = float(np.median(normal)) if normal else 0.0
    restarts = []
    for kill, stop in zip(run.kills, stops, strict=False):
        resumed = kill.get("resumed")
        lost = kill["step_done"] + 1 - resumed if resumed is not None else None
        before = kill.get("last_step_seen_at")
        after = kill.get("first_step_done")
        downtime = after - before - step_s if before is not None and after is not None else None
        slot = stop["slot"]
        if "rung" in stop:  # not a fail-stop: the stop-time ladder's relaunch
            action = stop["rung"]
        elif stop["replaced_by"] is not None:
            action = f"onto standby slot {stop['replaced_by']} (slot {slot} evicted)"
        elif stop.get("ranks_left") is not None:
            action = f"slot {slot} dropped: {stop['ranks_left']} ranks go on (odyssey)"
        else:
            action = f"in place on slot {slot} (no standby left)"
        restarts.append(
            {"rank": kill["rank"], "killed_after_step": kill["step_done"], "resumed_at": resumed,
             "lost_steps": lost, "downtime_s": downtime, "warm_spares": kill["warm"],
             "detected_s": stop["wall"] - kill["at"], "action": action}
        )  # fmt: skip
    parameters: dict[str, Any] = {"compared": False}
    resharded = any(s.get("ranks_left") is not None for s in stops)
    if reference is not None and resharded:
        parameters = rank_launch.compare_parameters(
            out / "job", reference,
            "1e-5 relative (fewer ranks sum the same micro-batch gradients in another order)",
            rtol=1e-5,
        )  # fmt: skip
    elif reference is not None:
        parameters = rank_launch.compare_parameters(
            out / "job", reference, "bitwise (a restart from a bitwise snapshot runs the same math)"
        )
    kind = opts.injected[0] if opts.injected is not None else "kill"
    incident = {"hang": _hang_summary, "nan": _ladder_summary, "sdc": _ladder_summary,
                "matmul": _ladder_summary, "slow": _decline_summary}.get(kind)  # fmt: skip
    return {
        **(incident(out) if incident is not None else {}),
        "framework": opts.framework,
        "fault": kind,
        "world_size": opts.world_size,
        "steps": opts.steps,
        "normal_step_s": step_s,
        "restarts": restarts,
        "lost_steps": sum(r["lost_steps"] or 0 for r in restarts),
        "downtime_s": sum(r["downtime_s"] or 0.0 for r in restarts),
        "failstops": [s for s in stops if "rung" not in s],
        "plans": _plans(out),
        "parameters": parameters,
    }


def _plans(out: Path) -> list[dict[str, Any]]:
    """Every plan the controller decided in the job with the fault (its journal's ``plan``
    events): none is allowed (:func:`chaos_env`), and the summary shows that none ran."""
    found = out / JOURNAL
    if not found.exists():
        return []
    return [
        {k: e.get(k) for k in ("action", "strategy", "apply_step", "committed", "reason")}
        for e in read_journal(found)
        if e.get("kind") == "plan"
    ]


def _hang_summary(out: Path) -> dict[str, Any]:
    """The hang's incident, the rungs taken and the suspects (the launcher's ``hangs.jsonl``,
    copied into the run directory)."""
    path = out / "hangs.jsonl"
    looks = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    named = [look for look in looks if look.get("suspects")]
    rungs = ["no collective on any rank: hang", "stack aggregation (py-spy)"]
    if named:
        rungs += ["evict the suspects' machines", "restart every rank from memory"]
    return {
        "incident": "hang",
        "rungs": rungs,
        "suspects": named[0]["suspects"] if named else None,
        "hang_looks": looks,
    }


def _decline_summary(out: Path) -> dict[str, Any]:
    """The unexplained slowdown's incident, the rungs taken and the suspects (the launcher's
    ``declines.jsonl``, copied into the run directory): the first tally (rounds numbered from
    1) whose most flagged group was flagged in more than half of its rounds - the one the
    launcher evicted on. A later decline (a restart's warm-up, say) that named nobody does not
    take it back."""
    path = out / "declines.jsonl"
    rounds = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    tallies: list[list[dict[str, Any]]] = []
    for r in rounds:
        if r["round"] == 1 or not tallies:
            tallies.append([])
        tallies[-1].append(r)
    suspects = None
    for tally in tallies:  # the launcher's rule: DeclineTally.degrader
        counted = DeclineTally(rounds=len(tally), seen=len(tally), flags=collections.Counter(
            (r["flagged"][0], tuple(r["flagged"][1])) for r in tally if r["flagged"][1]
        ))  # fmt: skip
        degrader = counted.degrader()
        if degrader is not None:
            kind, ranks = degrader
            suspects = {"ranks": list(ranks), "kind": kind, "rounds": counted.flags[degrader]}
            break
    rungs = ["step time up, every rank healthy in the validation round: a decline",
             f"{len(rounds)} rounds of stack samples ({len(tallies)} tallies)"]  # fmt: skip
    if suspects is not None:
        rungs += ["evict the flagged group's machines", "restart every rank from memory"]
    return {
        "incident": "decline",
        "rungs": rungs,
        "suspects": suspects,
        "decline_rounds": [{"round": r["round"], "flagged": r["flagged"]} for r in rounds],
    }


def _rollbacks(out: Path) -> list[dict[str, Any]]:
    """The launcher's relaunches for the incidents ranks reported (``incidents.jsonl``), each
    in the shape of a fail-stop record (no slot evicted) with its ``rung``."""
    from failslow.node.incidents import read_log

    return [
        {"rank": r["incident"].get("rank"), "slot": r["incident"].get("rank"), "wall": r["wall"],
         "replaced_by": None, "ranks_left": None,
         "rung": f"{r['rung']}: every rank from before step {r['before_step']}"}
        for r in read_log(out)
    ]  # fmt: skip


def _ladder_summary(out: Path) -> dict[str, Any]:
    """The incident, the ladder's rungs, the stop-time checks' table and the replay's verdicts
    (the launcher's ``incidents.jsonl``, copied into the run directory); ``suspects``: the
    machines the checks or the replay named (None: a rollback alone)."""
    from failslow.node.incidents import read_log

    lines = read_log(out)
    first = lines[0]["incident"] if lines else {}
    summary: dict[str, Any] = {
        "incident": {"kind": first.get("kind", "nan"), "rank": first.get("rank"),
                     "step": first.get("step"), "metric": first.get("metric"),
                     "why": first.get("why")},
        "rungs": [f"{first.get('metric', 'loss')} checked on every rank (report_metrics)"]
        + [f"{r['rung']}: {r['why']}" for r in lines],
        "suspects": None,
    }  # fmt: skip
    checks = [line["checks"] for line in lines if "checks" in line]
    if checks:
        summary["checks"] = checks[-1]
    named = [c for c in checks if c["suspects"]]
    if named:
        summary["suspects"] = {"ranks": named[-1]["suspects"], "kind": "stop-time checks"}
    replays = [line["replay"] for line in lines if "replay" in line]
    if replays:
        summary["suspects"] = {"ranks": replays[-1]["suspects"], "kind": "dual-phase replay"}
        summary["replay"] = replays[-1]
    return summary


def _restore_sources(summary: dict[str, Any], log: str) -> None:
    """Where the killed rank's state came from at each restart (the ranks' restore lines, one
    per rank and launch): ``holder's backup`` when its slot was evicted with its memory; and
    where the launcher chose a new grid for the ranks that go on, odyssey's choice."""
    launches = rank_launch.restore_sources(log)
    if summary.get("fault") in ("nan", "sdc", "matmul") and summary["restarts"]:
        launches = launches[-len(summary["restarts"]) :]  # the ladder's last relaunch
    for restart, restored in zip(summary["restarts"], launches, strict=False):
        restart["restored_from"] = restored.get(str(restart["rank"]))
    choices = iter(re.findall(r"failslow run: (odyssey \w+: \S+ -> \S+) on", log))
    for restart in summary["restarts"]:
        if "dropped" in restart["action"]:
            choice = next(choices, None)
            if choice is not None:
                restart["action"] = restart["action"].replace("(odyssey)", f"({choice})")


def _print_table(summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    hang, nan, sdc, matmul, slow = (
        summary["fault"] == f for f in ("hang", "nan", "sdc", "matmul", "slow")
    )
    title = "fail-stops: killed, seen, every rank restarted from memory"
    if hang:
        title = "a machine hangs: found by its stacks, every rank restarted from memory"
    if nan:
        title = "a NaN loss: every rank rolled back to the newest snapshot before it"
    if sdc:
        title = "a silent corruption: named by dual-phase replay, evicted, restarted from memory"
    if matmul:
        title = "a faulty matmul: named by the stop-time checks, evicted, restarted from memory"
    if slow:
        title = "an unexplained slowdown: named by rounds of stacks, evicted, restarted from memory"
    after = {"hang": "hung after step", "nan": "last step done", "sdc": "last good step",
             "matmul": "last good step", "slow": "last step done"}.get(
                 summary["fault"], "killed after step")  # fmt: skip
    table = Table(title=title)
    for col in ("rank", after, "seen", "resumed at",
                "lost steps", "downtime", "warm", "restarted", "its state from"):  # fmt: skip
        table.add_column(col)
    for r in summary["restarts"]:
        table.add_row(
            str(r["rank"]), str(r["killed_after_step"]), f"{r['detected_s'] * 1000:.0f} ms",
            str(r["resumed_at"]), str(r["lost_steps"]),
            f"{r['downtime_s']:.1f} s" if r["downtime_s"] is not None else "-",
            "yes" if r["warm_spares"] else "no", r["action"], r.get("restored_from") or "-",
        )  # fmt: skip
    console = Console()
    console.print(table)
    if hang or slow:
        suspects = summary["suspects"]
        named = f"ranks {suspects['ranks']} ({suspects['kind']})" if suspects else "nobody"
        console.print(f"rungs: {' -> '.join(summary['rungs'])}; stack aggregation named {named}")
    if nan or sdc or matmul:
        console.print(f"incident: {summary['incident']['why']}")
        for rung in summary["rungs"]:
            console.print(f"  rung: {rung}")
    for row in summary.get("checks", {}).get("table", []):
        console.print(
            f"  checks, machine {row['rank']}: GEMM error {row['device_error']}, reference "
            f"digest {row['digest']}, link {row['link']}: {row['verdict']}"
        )
    if sdc and summary.get("replay"):
        for phase in summary["replay"]["phases"]:
            verdicts = ", ".join(
                f"{g['members']} {'FAULTY' if g['reproduced'] else 'clean'}"
                for g in phase["groups"]
            )
            console.print(f"  replay ({phase['phase']}): {verdicts}")
    p = summary["parameters"]
    if p["compared"]:
        if "bitwise" in p["tolerance"]:
            verdict = "bitwise equal" if p["equal"] else "DIFFER"
        else:
            verdict = f"equal within {p['tolerance']}" if p["equal"] else "DIFFER"
        verdict += f" (max |diff| {p['max_abs_diff']:.3g})"
        console.print(f"final parameters vs the same job without the fault: {verdict}")
    for plan in summary["plans"]:  # none expected: chaos_env allows no strategy
        console.print(
            f"controller plan: {plan['action']} {plan['strategy']} at step {plan['apply_step']} "
            f"({plan['reason']})"
        )
    console.print(f"summary: {out / 'summary.json'}")
