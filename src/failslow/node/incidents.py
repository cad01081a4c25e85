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
(:mod:`failslow.node.hot_update.agent`).

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

from failslow.core.control.stop import take_rollback_requests
from failslow.core.planner.ladder import ROLL_BACK_CODE, Ladder, Rung
from failslow.runtime import crash_record

LOG = "incidents.jsonl"


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

    def clear(self) -> None:
        """Drop requests and exception records a launch before this one left (an earlier run
        of the launcher)."""
        if self.state_dir is not None:
            take_rollback_requests(self.state_dir)
            crash_record.take(self.state_dir)

    def after(self, *, replay: bool = False, diagnose: bool = False) -> Rung | None:
        """After a launch ended with a failure: the rung for the incident its ranks reported
        (None: no rank reported one - an ordinary failure); ``replay``: the launcher can
        replay the step on groups of its ranks; ``diagnose``: it can run the stop-time checks
        on them (:meth:`checked` then gives the rung after them)."""
        if self.state_dir is None:
            return None
        requests = take_rollback_requests(self.state_dir)
        if not requests:
            return None
        first = self.incident = requests[0]
        self._ranks = [r.get("rank") for r in requests]
        who = f"rank {first['rank']}: " if "rank" in first else ""
        what = f"{who}{first.get('why', 'a bad metric')}"
        update = self._latest_update()
        rung = self.ladder.next(
            first["step"], what, code_update=update, replay=replay, diagnose=diagnose
        )
        return self._took(rung)

    def checked(self, outcome: Any) -> Rung:
        """Log what the stop-time checks found (:class:`failslow.node.stop_checks.CheckOutcome`;
        its suspects already evicted) and take the rung after them."""
        self._log({"wall": time.time(), "incident": self.incident, "rung": "checks result",
                   "before_step": self.ladder.taken[-1].before_step, "why": outcome.why,
                   "checks": outcome.to_dict()})  # fmt: skip
        return self._took(self.ladder.diagnosed(outcome.suspects, outcome.why))

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


def read_log(state_dir: Path) -> list[dict[str, Any]]:
    """The rungs taken so far (``incidents.jsonl``), oldest first."""
    path = Path(state_dir) / LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
