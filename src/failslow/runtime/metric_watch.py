"""``failslow.report_metrics``: the rank's side of byterobust's real-time metric checks (4.1).

A training script already logs its loss and gradient norm (to W&B, TensorBoard, stdout); one
more line hands the same numbers to failslow::

    wandb.log(metrics, step=step)
    failslow.report_metrics(step, **metrics)   # or loss=..., grad_norm=...

Every rank that calls it applies the rule of :class:`~failslow.core.diagnosis.metrics.MetricCheck`
(NaN, Inf, a 5x jump of a loss or gradient norm; the ``checks`` settings). On an incident:

- under ``failslow run`` with in-memory snapshots, the rank leaves a rollback request in the
  job's state directory (:func:`~failslow.core.control.stop.request_rollback`) and exits at once
  with :data:`~failslow.core.control.stop.EXIT_ROLLBACK` - nothing of this step is committed; the
  launcher stops the other ranks and climbs the stop-time ladder (byterobust 4.2): every rank
  restarts from the newest snapshot before the bad step (``$FAILSLOW_ROLLBACK_BEFORE``);
- otherwise nothing can roll the job back: :class:`~failslow.errors.MetricIncidentError` names
  what went wrong,
  so the script stops rather than train on.

In a replay group of the stop-time ladder (``$FAILSLOW_REPLAY``; byterobust 4.2, dual-phase
replay) the check waits for the replayed step: there the rank records whether the incident came
back - a NaN or Inf, or a value ``jump`` times the level the job had before it - and exits.

Per call: O(window) over the watched metrics, no collective, no store.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

from failslow import envvars
from failslow.core.diagnosis.metrics import (
    ChecksConfig,
    MetricCheck,
    MetricIncident,
    judge,
    watched,
)
from failslow.errors import FailslowError, MetricIncidentError

log = logging.getLogger(__name__)

__all__ = ["MetricIncidentError", "MetricWatch", "report"]


class MetricWatch:
    """One rank's metric check and what it does on an incident (see the module doc)."""

    def __init__(self, config: ChecksConfig, *, rank: int = 0, can_roll_back: Any = None) -> None:
        self.check = MetricCheck(jump=config.jump, window=config.window, warmup=config.warmup)
        self.rank = rank
        self._can_roll_back = can_roll_back or (lambda: False)
        self.incident: MetricIncident | None = None
        self.replay = replay_spec()

    def report(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {name: _number(name, v) for name, v in metrics.items() if watched(name)}
        if self.replay is not None:
            self._replayed(int(step), values)
            return
        incident = self.check.observe(int(step), values)
        if incident is None:
            return
        self.incident = incident
        state_dir = os.environ.get(envvars.STATE_DIR)
        if state_dir and self._can_roll_back():
            self._roll_back(state_dir, incident)
        raise MetricIncidentError(
            f"failslow: rank {self.rank}: {incident.describe()} - stopping; run under "
            "`failslow run` with in-memory snapshots to roll back automatically"
        )

    def _roll_back(self, state_dir: str, incident: MetricIncident) -> NoReturn:
        from failslow.core.control.stop import EXIT_ROLLBACK, request_rollback

        request_rollback(state_dir, self.rank, incident.to_dict())
        log.error(
            "failslow: rank %d: %s - asking the launcher to roll back before step %d",
            self.rank, incident.describe(), incident.step,
        )  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        # no teardown: this step's state is not to be committed, and peers wait in collectives
        os._exit(EXIT_ROLLBACK)

    def _replayed(self, step: int, values: dict[str, float]) -> None:
        """A replay group's rank: at the replayed step, record whether the incident came back
        and exit (see the module doc)."""
        spec = self.replay
        assert spec is not None
        if step < int(spec["until"]):
            return
        level, jump = spec.get("level") or {}, float(spec.get("jump") or 0.0)
        bad = [n for n, v in values.items() if judge(v, level.get(n), jump) is not None]
        state_dir = os.environ.get(envvars.STATE_DIR)
        if state_dir:
            from failslow.core.control.stop import REPLAYS, write_rank_result

            write_rank_result(state_dir, REPLAYS, str(spec["name"]), self.rank, {
                "step": step, "reproduced": bool(bad), "metrics": bad or sorted(values),
                "values": {n: v if math.isfinite(v) else str(v) for n, v in values.items()},
            })  # fmt: skip
        log.warning(
            "failslow: replay %s, rank %d, step %d: %s", spec["name"], self.rank, step,
            f"the incident came back ({', '.join(bad)})" if bad else "clean",
        )  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def replay_spec() -> dict[str, Any] | None:
    """``$FAILSLOW_REPLAY`` (see :mod:`failslow.envvars`), else None."""
    import json

    text = os.environ.get(envvars.REPLAY)
    if not text:
        return None
    try:
        spec = json.loads(text)
        int(spec["until"]), str(spec["name"])
    except (ValueError, KeyError, TypeError):
        raise FailslowError(
            f"${envvars.REPLAY}: expected {{'name', 'until', ...}}, got {text}"
        ) from None
    return dict(spec)


def _number(name: str, value: Any) -> float:
    """A metric as a float: Python numbers, numpy scalars, one-element tensors."""
    item = getattr(value, "item", None)
    try:
        return float(item() if callable(item) else value)
    except (TypeError, ValueError):
        raise FailslowError(
            f"failslow.report_metrics: {name!r} must be a number, got {type(value).__name__}"
        ) from None


_default: MetricWatch | None = None


def report(step: int, metrics: Mapping[str, Any]) -> None:
    """:func:`failslow.report_metrics`: the current session's watch, else a process-wide one
    (default ``checks`` settings from the environment, no rollback)."""
    global _default
    from failslow.runtime.session import current

    session = current()
    if session is not None:
        session.metric_watch.report(step, metrics)
        return
    if _default is None:
        from failslow.config import load_config

        _default = MetricWatch(load_config().checks, rank=int(os.environ.get("RANK", "0")))
    _default.report(step, metrics)
