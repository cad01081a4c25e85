"""The stop-time checks on the node's machines: the ladder's first rung (byterobust 4.2
"Diagnose", 4.3 "NaN loss diagnosis").

After a launch ended on an incident that names no machine (a rank's metrics went bad), the
agent runs the checks before anything else: every slot of the world runs
:mod:`failslow.runtime.stop_check` (device, links, bitwise alignment) in a world of its own
(:meth:`failslow.node.ranks.LocalRanks.spawn_check`), and
:func:`failslow.core.diagnosis.stop_checks.judge` names the machines that failed. The launcher
evicts them like dead ones (standby, ``--min-ranks`` drop, or in place) and the job restarts
from memory before the bad step; when every machine passes, the ladder goes on to reattempt.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failslow.core.control.stop import STOP_CHECKS, rank_result_path, take_rank_results
from failslow.core.diagnosis.stop_checks import CheckVerdict, judge
from failslow.errors import FailslowError

_names = itertools.count()


@dataclass
class CheckOutcome:
    verdict: CheckVerdict
    """What the checks found: the machines they name (``suspects``), why, the table."""
    seconds: float = 0.0
    status: int = 0
    """The check world's exit status (0: every machine ran its tests to the end; -1: they
    could not start)."""

    @property
    def suspects(self) -> list[int]:
        return self.verdict.suspects

    @property
    def why(self) -> str:
        return self.verdict.why

    @property
    def table(self) -> list[dict[str, Any]]:
        return self.verdict.table

    def to_dict(self) -> dict[str, Any]:
        return {**self.verdict.to_dict(), "seconds": self.seconds, "status": self.status}


def _wait(group: Any, name: str, state_dir: Path, deadline: float) -> int:
    """The check world's status. A machine that died leaves its peers' link test waiting for
    it: once every other machine wrote its own tests' result they are stopped, not waited
    for until the link test's timeout."""
    while (status := group.poll()) is None:
        died = {r for r, (_, p) in group.ranks.items() if p.poll() not in (None, 0)}
        alive = set(group.ranks) - died
        done = {r for r in alive if rank_result_path(state_dir, STOP_CHECKS, name, r).exists()}
        if (died and done == alive) or time.monotonic() > deadline:
            group.signal_group(signal.SIGKILL)
            return int(group.wait(timeout=60))
        time.sleep(0.05)
    return int(status)


def run(
    ranks: Any,
    env: dict[str, str],
    *,
    incident: dict[str, Any],
    state_dir: Path,
    timeout_s: float = 120.0,
    say: Callable[[str], None] = print,
    nodes: Any = None,
) -> CheckOutcome:
    """Run the stop-time checks on every machine of the current world (see the module). With
    several nodes (``nodes``, :class:`failslow.node.nodes.NodeGroup`) the world is every
    node's machines: each node reports its machines' results through the job's store, node 0
    judges them all and publishes the verdict, which every node reads."""
    started = time.monotonic()
    machines = len(ranks.worlds[-1].slots) * (1 if nodes is None else nodes.options.nnodes)
    name = f"check{next(_names)}"
    say(f"stop-time checks on {machines} machines: device, links, bitwise alignment")
    spec = {"incident": incident, "timeout_s": min(60.0, timeout_s / 2)}
    try:
        group = ranks.spawn_check(env, name, spec)
    except (FailslowError, OSError) as exc:  # the ladder goes on without them
        why = f"the stop-time checks could not start: {exc}"
        say(why)
        return CheckOutcome(CheckVerdict([], why), time.monotonic() - started, status=-1)
    status = _wait(group, name, Path(state_dir), started + timeout_s)
    results = take_rank_results(state_dir, STOP_CHECKS, name)
    if nodes is None:
        verdict = judge(results, machines)
    else:
        verdict = _across(nodes, ranks.last_launch, results, machines, timeout_s)
    outcome = CheckOutcome(verdict, time.monotonic() - started, status)
    say(f"stop-time checks ({outcome.seconds:.1f} s): {verdict.why}")
    return outcome


def _across(
    nodes: Any, launch: int, results: dict[int, Any], machines: int, timeout_s: float
) -> CheckVerdict:
    """Several nodes' check results judged by node 0 (a node that did not report in time: its
    machines reported nothing)."""
    if nodes.node_rank != 0:
        nodes.report(launch, "check", {"results": {str(r): res for r, res in results.items()}})
        _, got = nodes.decision(launch, "check/verdict", timeout_s)
        if got is None:
            return CheckVerdict([], f"node 0 judged no stop-time checks within {timeout_s:g} s")
        return CheckVerdict(list(got["suspects"]), str(got["why"]), list(got["table"]))
    every = dict(results)
    for reported in nodes.reports(launch, "check", timeout_s).values():
        every.update({int(r): res for r, res in (reported.get("results") or {}).items()})
    verdict = judge(every, machines)
    nodes.decide(launch, "check/verdict", verdict.to_dict())
    return verdict
