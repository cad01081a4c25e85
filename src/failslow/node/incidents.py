"""The launcher's side of a training incident a rank reported (byterobust 4.1-4.2).

Two kinds: a rank whose metrics went bad, and a rank that died of an exception traceable to a
code update.

A rank whose loss or gradient norm went bad (``failslow.report_metrics``,
:mod:`failslow.runtime.metric_watch`) leaves a rollback request in the job's state directory and
exits; the launch ends (the other ranks are stopped, or ``torchrun`` stops them). After the
launch, :meth:`Incidents.after` reads the requests and climbs the stop-time ladder
(:class:`~failslow.core.planner.ladder.Ladder`): stop-time checks on every machine (evict those
they name; :meth:`Incidents.checked`), reattempt from memory, roll back the latest code update,
replay, then stop for a person. Each rung is a line of ``<state dir>/incidents.jsonl``
with the incident, the rung and why it was taken; the agent carries it out
(:mod:`failslow.node.hot_update.agent`). On several nodes there is one ladder, node 0's
(:meth:`Incidents.across`): every node reports its ranks' requests through the job's store,
node 0 takes the rung from all of them, and the other nodes take it from node 0 - so every
node restarts from the same step, and a code rollback (node 0's history) or a stop for a
person is the whole job's. The stop-time checks test every node's machines in one world, judged
by node 0 (:mod:`failslow.node.stop_checks`); the replay works on one node only.

A rank that died of an uncaught exception left its record (:mod:`failslow.runtime.crash_record`);
:meth:`Incidents.blame` finds the newest running code update one of its frames is in a file of
(:mod:`failslow.node.hot_update.blame`) - that update is rolled back at once, on probation or not
(4.1: "user-space errors ... traceable to specific code modules ... trigger a code rollback").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from failslow.core.control.stop import EXIT_ROLLBACK, take_rollback_requests
from failslow.core.planner.ladder import NEEDS_PERSON, ROLL_BACK_CODE, Ladder, Rung
from failslow.runtime import crash_record

LOG = "incidents.jsonl"
INCIDENT, RUNG, RUNG_AFTER_CHECKS = "incident", "rung", "rungchecks"
"""Where, under a launch's keys of the job's store, the nodes report their ranks' requests and
node 0 publishes the rung (:meth:`Incidents.across`), and the rung after the checks."""


class Incidents:
    def __init__(
        self,
        state_dir: Path | None,
        history: Any,
        *,
        ladder: Ladder | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.state_dir = state_dir
        self.history = history
        self.ladder = ladder or Ladder()
        self.say = say
        self.incident: dict[str, Any] = {}
        """The last incident the ranks reported (its first request)."""
        self._ranks: list[Any] = []
        """The ranks that reported it."""
        self.nodes: Any = None
        """With several nodes (:meth:`across`), the job's :class:`~failslow.node.nodes.NodeGroup`:
        node 0 takes each rung for every node."""
        self._launch: Callable[[], int] = lambda: 0

    REPORTS_WITHIN_S = 30.0
    """How long node 0 waits for the other nodes' requests after a launch (they report as soon
    as their ranks are gone; a node that did not is named, and its requests are not counted)."""
    RUNG_WITHIN_S = 90.0
    """How long another node waits for node 0's rung."""

    def across(self, nodes: Any, launch: Callable[[], int]) -> None:
        """Several nodes, one ladder (:mod:`failslow.node.nodes`): after a launch that ended on
        an incident (``launch()``: its index), node 0 reads every node's requests and takes the
        rung, which the other nodes take from it instead of climbing their own."""
        self.nodes, self._launch = nodes, launch

    def clear(self) -> None:
        """Drop requests and exception records a launch before this one left (an earlier run
        of the launcher)."""
        if self.state_dir is not None:
            take_rollback_requests(self.state_dir)
            crash_record.take(self.state_dir)

    def after(
        self, *, replay: bool = False, diagnose: bool = False, status: int | None = None
    ) -> Rung | None:
        """After a launch ended with ``status``: the rung for the incident its ranks reported
        (None: no rank reported one - an ordinary failure); ``replay``: the launcher can
        replay the step on groups of its ranks; ``diagnose``: it can run the stop-time checks
        on them (:meth:`checked` then gives the rung after them). With several nodes the
        nodes agree on it when the launch ended on an incident (:data:`EXIT_ROLLBACK`, here or
        on the node that claimed the stop); any other status is an ordinary failure."""
        if self.state_dir is None:
            return None
        requests = take_rollback_requests(self.state_dir)
        if self.nodes is not None:
            if status != EXIT_ROLLBACK:
                return None
            if self.nodes.node_rank != 0:
                return self._follow(requests)
            requests = self._gather(requests)
        if not requests:
            if self.nodes is not None:
                self.nodes.decide(self._launch(), RUNG, None)
            return None
        first = self.incident = requests[0]
        self._ranks = [r.get("rank") for r in requests]
        who = f"rank {first['rank']}: " if "rank" in first else ""
        what = f"{who}{first.get('why', 'a bad metric')}"
        update = self._latest_update()
        rung = self.ladder.next(
            first["step"], what, code_update=update, replay=replay, diagnose=diagnose
        )
        if self.nodes is not None:
            self.nodes.decide(self._launch(), RUNG, _rung_record(rung, first, self._ranks))
        return self._took(rung)

    def _gather(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Node 0: its own requests and every other node's, earliest step first."""
        launch = self._launch()
        got = self.nodes.reports(launch, INCIDENT, self.REPORTS_WITHIN_S)
        reports = {k: list(r.get("requests") or []) for k, r in got.items()}
        missing = [k for k in range(1, self.nodes.options.nnodes) if k not in reports]
        if missing:
            self.say(
                f"node(s) {missing} did not report their ranks' incidents within "
                f"{self.REPORTS_WITHIN_S:g} s: the ladder goes on with the others'"
            )
        every = [*requests, *(r for k in sorted(reports) for r in reports[k])]
        return sorted(every, key=lambda r: int(r.get("step", 0)))

    def _follow(self, requests: list[dict[str, Any]]) -> Rung | None:
        """Another node: report this node's requests, take node 0's rung."""
        launch = self._launch()
        self.nodes.report(launch, INCIDENT, {"requests": requests})
        came, rung = self.nodes.decision(launch, RUNG, self.RUNG_WITHIN_S)
        if not came:
            self.say(
                f"node 0 took no rung for launch {launch}'s incident within "
                f"{self.RUNG_WITHIN_S:g} s: restarting as after a failure"
            )
            return None
        if rung is None:
            return None
        self.incident, self._ranks = dict(rung.get("incident") or {}), list(rung.get("ranks") or [])
        return self._took(_followed(rung))

    def checked(self, outcome: Any) -> Rung:
        """Log what the stop-time checks found (:class:`failslow.node.stop_checks.CheckOutcome`;
        its suspects already evicted) and take the rung after them."""
        if self.nodes is not None and self.nodes.node_rank != 0:  # node 0 climbs on
            came, rung = self.nodes.decision(self._launch(), RUNG_AFTER_CHECKS, self.RUNG_WITHIN_S)
            if not came or rung is None:
                why = f"node 0 took no rung after the checks within {self.RUNG_WITHIN_S:g} s"
                rung = {"name": NEEDS_PERSON, "before_step": 0, "why": why}
            self._log({"wall": time.time(), "incident": self.incident, "rung": "checks result",
                       "before_step": rung["before_step"], "why": outcome.why,
                       "checks": outcome.to_dict()})  # fmt: skip
            return self._took(_followed(rung))
        self._log({"wall": time.time(), "incident": self.incident, "rung": "checks result",
                   "before_step": self.ladder.taken[-1].before_step, "why": outcome.why,
                   "checks": outcome.to_dict()})  # fmt: skip
        rung = self.ladder.diagnosed(outcome.suspects, outcome.why)
        if self.nodes is not None:
            record = _rung_record(rung, self.incident, self._ranks)
            self.nodes.decide(self._launch(), RUNG_AFTER_CHECKS, record)
        return self._took(rung)

    def _took(self, rung: Rung) -> Rung:
        self._log({"wall": time.time(), "incident": self.incident, "ranks": self._ranks,
                   "rung": rung.name, "before_step": rung.before_step,
                   "why": rung.why})  # fmt: skip
        self.say(f"{rung.name}: {rung.why}")
        return rung

    def replayed(self, outcome: Any) -> None:
        """Log what the replay rung found (:class:`failslow.node.replay.ReplayOutcome`)."""
        names = outcome.suspects
        done = f"evict machine(s) {names}" if names else "nobody named: the job needs a person"
        self._log({"wall": time.time(), "incident": self.incident, "rung": "replay result",
                   "before_step": self.ladder.taken[-1].before_step if self.ladder.taken else None,
                   "why": f"{outcome.why} - {done}", "replay": outcome.to_dict()})  # fmt: skip
        self.say(f"replay: {outcome.why} ({outcome.seconds:.1f} s) - {done}")

    def blame(self) -> tuple[Any, str] | None:
        """After a launch ended with a failure: the newest running code update an exception
        of its ranks is traceable to, and why (None: none is - an ordinary failure). Each
        blame is a line of ``incidents.jsonl`` with the rung ``roll back code``."""
        if self.state_dir is None:
            return None
        records = crash_record.take(self.state_dir)
        if not records:
            return None
        from failslow.node.hot_update.blame import blame, changed_files
        from failslow.node.hot_update.history import LIVE

        live = [u for u in self.history.updates() if u.kind == "update" and u.outcome in LIVE]
        for update in sorted(live, key=lambda u: (u.applied_at or 0.0, u.id), reverse=True):
            if update.version is None:
                continue
            found = blame(records, changed_files(update.previous, update.version),
                          update.version.code_dir)  # fmt: skip
            if found is None:
                continue
            why = (
                f"{found.describe(f'update #{update.id}', update.version.code_dir)}: roll the "
                f"update back and restart (byterobust 4.1)"
            )
            incident = {**found.record, "kind": "exception",
                        "where": f"{found.file}:{found.line}"}  # fmt: skip
            self._log({"wall": time.time(), "incident": incident,
                       "ranks": [found.record.get("rank")], "rung": ROLL_BACK_CODE,
                       "before_step": None, "why": why})  # fmt: skip
            self.say(f"{ROLL_BACK_CODE}: {why}")
            return update, why
        return None

    def _log(self, record: dict[str, Any]) -> None:
        assert self.state_dir is not None
        with (self.state_dir / LOG).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _latest_update(self) -> str | None:
        """The latest code update that is running (applied or on probation), described."""
        from failslow.node.hot_update.history import LIVE

        live = [u for u in self.history.updates() if u.kind == "update" and u.outcome in LIVE]
        if not live:
            return None
        latest = max(live, key=lambda u: (u.applied_at or 0.0, u.id))
        return f"update #{latest.id}: {latest.describe()}"


def _rung_record(rung: Rung, incident: dict[str, Any], ranks: list[Any]) -> dict[str, Any]:
    """What node 0 publishes of a rung for the other nodes (:meth:`Incidents.across`)."""
    return {"name": rung.name, "before_step": rung.before_step, "why": rung.why,
            "incident": incident, "ranks": ranks}  # fmt: skip


def _followed(record: dict[str, Any]) -> Rung:
    """The rung another node takes from node 0's record (:func:`_rung_record`)."""
    return Rung(str(record["name"]), int(record["before_step"]), f"node 0: {record['why']}")


def read_log(state_dir: Path) -> list[dict[str, Any]]:
    """The rungs taken so far (``incidents.jsonl``), oldest first."""
    path = Path(state_dir) / LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
