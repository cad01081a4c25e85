"""What a ``failslow run --controller`` did, read from its journal while the job runs.

The demo's ``launcher="failslow-run"`` starts the job the way users do - ``failslow run
--controller N -- torchrun ...`` - so the controller and the mitigator live in that launcher, not
in the demo. Their events reach the demo only through the journal the launcher writes
(``<ring dir>/diagnoses/events.jsonl``, :mod:`failslow.core.control.journal`); this module
follows it and keeps the same view the demo builds from an in-process control plane
(:func:`failslow.demo.mitigation._observe`): the controller's state, the diagnoses, every plan
with its dispatch, its effect (what the ranks reported running) and its measured outcome, and
the strategies found unavailable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JournalFollower:
    """Reads the journal's new lines on each :meth:`poll`; a line still being written (no
    newline yet) is read on a later poll."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self.state = "-"
        self.diagnoses: list[str] = []
        self.actions: list[dict[str, Any]] = []
        self.unavailable: dict[str, str] = {}

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self._take(json.loads(line))

    def _take(self, ev: dict[str, Any]) -> None:
        kind = ev.get("kind")
        if kind == "state":
            self.state = str(ev["state"])
        elif kind == "diagnosis":
            self.diagnoses.append(json.dumps(ev["diagnosis"], sort_keys=True))
        elif kind == "unavailable":
            self.unavailable[str(ev["strategy"])] = str(ev["reason"])
        elif kind == "plan":
            plan = ev.get("plan") or {}
            committed = bool(ev.get("committed"))
            self.actions.append(
                {
                    "action": ev["action"],
                    "strategy": ev["strategy"],
                    "counts": list(plan.get("counts") or ()),
                    "hosts": list(plan.get("hosts") or ()),
                    "apply_step": ev.get("apply_step"),
                    "reason": ev.get("reason") if committed else ev.get("detail"),
                    "committed": committed,
                    "effect": None,
                    "effect_detail": None,
                    "outcome": None,
                    "drift": None,
                    "epoch": ev.get("epoch"),
                }
            )
        elif kind == "effect":
            action = self._find(lambda a: a["epoch"] == ev.get("epoch"))
            if action is not None:
                action["effect"], action["effect_detail"] = ev.get("state"), ev.get("detail")
        elif kind == "drift":
            what, step = ev.get("action"), ev.get("apply_step")
            action = self._find(lambda a: a["action"] == what and a["apply_step"] == step)
            if action is not None:
                action["drift"] = {k: ev.get(k) for k in ("measured_s", "reason", "then")}
        elif kind == "outcome":
            what, step = ev.get("action"), ev.get("apply_step")
            action = self._find(lambda a: a["action"] == what and a["apply_step"] == step)
            if action is not None:
                fields = ("apply_step", "before_s", "predicted_s", "measured_s", "verdict")
                action["outcome"] = {k: ev.get(k) for k in (*fields, "reason")}

    def _find(self, match: Any) -> dict[str, Any] | None:
        return next((a for a in reversed(self.actions) if match(a)), None)
