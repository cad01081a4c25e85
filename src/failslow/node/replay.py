"""Dual-phase replay on the node's ranks: the stop-time ladder's last rung before a person
(byterobust 4.2, Algorithm 1).

An incident that a reattempt from memory and a code rollback did not clear is taken for a
silent data corruption on one machine. :func:`run` replays the bad step on groups of the
world's machines (ranks, one per slot; with ``--slots-as-hosts`` each slot is a host) with TP
and PP kept and DP reduced (:mod:`failslow.core.diagnosis.replay`): first the horizontal groups,
all at once, then the vertical ones. Each group is a world of its own
(:meth:`failslow.node.ranks.LocalRanks.spawn_replay`) that resumes the job's snapshot before the
bad step - reading every old rank's state where it is kept, read-only - trains to the bad step
and reports whether the incident came back there. The machine in the one faulty group of each
phase is the suspect; the agent evicts it and restarts the job from memory without it.

On a TP x PP grid (its ranks' layout notes say so) a machine is one TP group and the groups
hold whole pipelines (:class:`~failslow.core.diagnosis.replay.Grid`): the horizontal ones are
the job's own pipelines, the vertical ones re-form pipelines from machines of any stages - each
replay rank gathers the state of the stage it takes from the old world's snapshots (the
adapter's resharded restore, as when a job goes on without lost ranks), in the world's
layout. A phase whose groups all came out clean (the fault did not reproduce), or more than one
faulty, names nobody: the ladder ends with a person. A group that did not finish its replay (a
crash, the timeout) counts as faulty - a healthy group replays the step cleanly.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from failslow.core.control.stop import REPLAYS, take_rank_results
from failslow.core.diagnosis.replay import Grid, ReplayWorld, plan


@dataclass
class ReplayOutcome:
    suspects: list[int]
    """The world's ranks (machines) the two phases name; empty: nobody."""
    why: str
    phases: list[dict[str, Any]] = field(default_factory=list)
    """Per phase: each group's members, whether the incident came back, its exit status."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"suspects": self.suspects, "why": self.why, "phases": self.phases,
                "seconds": self.seconds}  # fmt: skip


def run(
    ranks: Any,
    command: list[str],
    env: dict[str, str],
    cwd: str | None,
    *,
    until: int,
    incident: dict[str, Any],
    state_dir: Path,
    jump: float = 5.0,
    timeout_s: float = 600.0,
    say: Callable[[str], None] = print,
) -> ReplayOutcome:
    """Replay step ``until`` - the first bad one of ``incident`` - on the two phases' groups of
    the current world (see the module)."""
    started = time.monotonic()
    world = ranks.worlds[-1]
    tp, pp = ranks.grid()
    try:
        grid = Grid.from_coords(ranks.coords(), tp, pp) if tp * pp > 1 else None
        replay = plan(len(world.slots) if grid is None else grid.machines, pp)
    except ValueError as exc:
        return ReplayOutcome([], f"no replay groups: {exc}")

    def world_of(machines: list[int]) -> ReplayWorld:
        return ReplayWorld(machines, machines) if grid is None else grid.world(machines)

    def ranks_of(machines: list[int]) -> list[int]:
        if grid is None:
            return machines
        return [r for x in machines for r in grid.machine_ranks(x)]

    metric, level = incident.get("metric"), incident.get("level")
    spec = {"until": until, "jump": jump,
            "level": {metric: level} if metric and level else {}}  # fmt: skip
    found: list[int] = []
    phases: list[dict[str, Any]] = []
    for phase, groups in (("horizontal", replay.horizontal()), ("vertical", replay.vertical())):
        names = [f"{phase[0]}{i}" for i in range(len(groups))]
        say(f"replay ({phase}): step {until} on groups {groups}")
        running: dict[str, Any] = {}
        try:
            for name, members in zip(names, groups, strict=True):
                replay_world = world_of(members)
                running[name] = ranks.spawn_replay(
                    command, env, cwd, name, replay_world.ranks, spec, roles=replay_world.roles
                )
        except BaseException:  # no group of a failed start outlives it
            for group in running.values():
                group.signal_group(signal.SIGKILL)
                group.wait(timeout=60)
            raise
        report = []
        for (name, group), members in zip(running.items(), groups, strict=True):
            status = _wait(group, timeout_s - (time.monotonic() - started))
            results = list(take_rank_results(state_dir, REPLAYS, name).values())
            done = len(results) == len(members) * (1 if grid is None else grid.tp)
            came_back = any(r.get("reproduced") for r in results) or not done
            report.append({
                "group": name, "members": members, "ranks": world_of(members).ranks,
                "reproduced": came_back, "finished": done, "status": status,
            })  # fmt: skip
            ranks.forget_replay(name)
        phases.append({"phase": phase, "groups": report})
        faulty = [i for i, r in enumerate(report) if r["reproduced"]]
        say(f"replay ({phase}): " + ", ".join(
            f"{r['members']} {'FAULTY' if r['reproduced'] else 'clean'}" for r in report
        ))  # fmt: skip
        if len(faulty) != 1:
            verdict = "is not one machine's" if faulty else "did not come back"
            why = (
                f"the {phase} replay found {len(faulty) or 'no'} faulty groups: the incident "
                f"{verdict}"
            )
            return ReplayOutcome([], why, phases, time.monotonic() - started)
        found.append(faulty[0])
    machines = replay.locate(found[0], found[1])
    suspects = ranks_of(machines)
    why = (
        f"the incident came back in horizontal group {replay.horizontal()[found[0]]} and "
        f"vertical group {replay.vertical()[found[1]]}: machine(s) {machines}"
    )
    if grid is not None:
        why += f" (rank(s) {suspects} of the TP{tp} x PP{pp} grid)"
    return ReplayOutcome(suspects, why, phases, time.monotonic() - started)


def _wait(group: Any, timeout_s: float) -> int:
    try:
        return int(group.wait(timeout=max(timeout_s, 1.0)))
    except subprocess.TimeoutExpired:
        group.signal_group(signal.SIGKILL)
        return int(group.wait(timeout=60))
