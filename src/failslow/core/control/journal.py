"""What the control plane did, as one stream of events: the run's journal and its status record.

Every observer of a job reads the same events (DESIGN.md, ``observe/``): the controller reports
its state changes and the onsets it takes in, the mitigator the step times it reads and every
decision with its outcome. :class:`ControlPlane <failslow.core.control.control_plane.ControlPlane>`
hands each event to its observers: :class:`Journal` (``events.jsonl`` in the run's log directory,
what ``failslow report`` draws), :class:`StatusBoard` (one key in the control store,
``failslow/status``, what ``failslow top`` shows), and the metrics exporter of
:mod:`failslow.observe.metrics`.

Events are JSON-able dicts with ``kind`` and ``wall`` (Unix time):

- ``{"kind": "state", "state": "profiling", "detail": {...}}`` - a controller transition;
- ``{"kind": "onset", "rank", "type": "onset"|"relief", "iteration", "before_s", "after_s"}`` -
  a node's change point as the controller took it in;
- ``{"kind": "transient", "rank", "start", "end", "detected_at", "before_s", "after_s"}`` - a
  slowdown a node's detector verified that was over before it persisted (issue 47): recorded
  here, never acted on;
- ``{"kind": "diagnosis", "diagnosis": {kind, slow_ranks, slow_links, evidence}}``;
- ``{"kind": "steps", "steps": [[step, seconds], ...]}`` - step times new to the mitigator
  (rank 0's; a synchronous job has one step time);
- ``{"kind": "plan", "action": "apply"|"replan"|"revert"|"rollback", "strategy", "plan":
  {...}, "reason", "epoch", "apply_step", "committed", "detail", "in_effect", "desired"}`` - a
  decision and its dispatch; ``plan`` carries the model's estimates (``overhead_s``,
  ``step_time_s``, ``baseline_step_s``); ``desired`` is what the ranks were told to run,
  ``in_effect`` what every rank reported running (the closed loop, :mod:`.closed_loop`);
- ``{"kind": "effect", "action", "strategy", "plan", "epoch", "apply_step", "state": "in
  effect"|"not in effect", "detail", "in_effect"}`` - what the ranks reported running after a
  plan's apply step (``detail``: the first rank's reason when it did not);
- ``{"kind": "outcome", "action", "strategy", "plan", "apply_step", "before_s",
  "predicted_s", "measured_s", "verdict": "pays"|"short"|"unknown"|"not measured", "reason"}``
  - a plan's measured step time a few steps after it took effect, beside its prediction; "not
  measured" (``measured_s`` None) when a newer plan or the fail-slow's end came first;
- ``{"kind": "drift", "action", "strategy", "plan", "apply_step", "before_s", "predicted_s",
  "measured_s", "verdict": "stopped paying", "reason", "then": "replan"|"kept"|"revert"|"none",
  "then_reason"}`` - a plan that paid at its outcome and, watched on, stopped paying (the
  closed loop's kept windows), and what the mitigator did about it;
- ``{"kind": "unavailable", "strategy", "reason"}`` - a strategy whose plan could not take
  effect in this job: never planned again.

Per event the cost is one line appended and, for the status record, one store write; step
events come once per mitigator tick (10 Hz), never per rank: nothing grows with the world size.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from failslow.core.control import keys
from failslow.core.control.store import Store

log = logging.getLogger(__name__)

JOURNAL = "events.jsonl"
"""The journal's file name in the run's log directory."""

Observer = Callable[[dict[str, Any]], None]
"""Takes one event; must be cheap and must not raise (the plane logs and drops what does)."""


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "wall": time.time(), **fields}


class Journal:
    """Appends every event to ``path`` as one JSON line (flushed, so a crash keeps it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def __call__(self, ev: dict[str, Any]) -> None:
        line = json.dumps(ev, default=str, sort_keys=True)
        with self._lock:
            if not self._fh.closed:
                self._fh.write(line + "\n")
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The events of a journal; a torn last line (the writer was killed) is skipped, any other
    malformed line is a one-line error naming it."""
    from failslow.errors import FailslowError

    events = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines):
                break
            raise FailslowError(f"{path}:{n}: not a JSON event: {line[:80]!r}") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise FailslowError(f"{path}:{n}: an event needs a 'kind': {line[:80]!r}")
        events.append(record)
    return events


class StatusBoard:
    """The job's status in one store key (``failslow/status``), rewritten on every event that
    changes it: controller state, diagnoses so far and the last one, the plan in effect, the
    last action, the newest step. Readers (``failslow top``) need no other controller key."""

    def __init__(self, store: Store, *, world_size: int) -> None:
        self.store = store
        self.status: dict[str, Any] = {
            "world_size": world_size,
            "state": "tracking",
            "since": time.time(),
            "diagnoses": 0,
            "last_diagnosis": None,
            "in_effect": None,
            "last_action": None,
            "unavailable": {},
            "step": None,
            "step_s": None,
            "wall": time.time(),
        }
        self._lock = threading.Lock()

    def __call__(self, ev: dict[str, Any]) -> None:
        kind = ev["kind"]
        with self._lock:
            s = self.status
            if kind == "state":
                s["state"], s["since"] = ev["state"], ev["wall"]
            elif kind == "diagnosis":
                s["diagnoses"] += 1
                s["last_diagnosis"] = {**ev["diagnosis"], "wall": ev["wall"]}
                s["last_diagnosis"].pop("evidence", None)
            elif kind == "plan":
                s["last_action"] = {
                    k: ev.get(k)
                    for k in ("action", "strategy", "reason", "apply_step", "committed", "wall")
                }
                s["in_effect"] = ev.get("in_effect")
            elif kind == "effect":
                s["in_effect"] = ev.get("in_effect")
                last = s["last_action"]
                if last and last.get("apply_step") == ev.get("apply_step"):
                    effect = {"effect": ev["state"], "effect_detail": ev["detail"]}
                    s["last_action"] = {**last, **effect}
            elif kind in ("outcome", "drift"):
                last = s["last_action"]
                if last and last.get("apply_step") == ev.get("apply_step"):
                    keep = ("predicted_s", "measured_s", "verdict")
                    s["last_action"] = {**last, **{k: ev.get(k) for k in keep}}
            elif kind == "unavailable":
                s["unavailable"] = {**s["unavailable"], ev["strategy"]: ev["reason"]}
            elif kind == "steps" and ev["steps"]:
                s["step"], s["step_s"] = ev["steps"][-1]
            else:
                return
            s["wall"] = time.time()
            record = dict(s)
        self.store.set_json(keys.STATUS, record)
