"""Built-in notifier: diagnoses, plans and plan results as log lines (one per event)."""

from __future__ import annotations

import logging
from typing import Any

from failslow import hookimpl

log = logging.getLogger("failslow")


@hookimpl
def failslow_on_diagnosis(diagnosis: Any) -> None:
    log.warning("failslow: diagnosis %s", diagnosis.to_json())


@hookimpl
def failslow_on_plan(plan: Any, action: str, reason: str) -> None:
    log.warning("failslow: %s %s (%s)", action, type(plan).__name__, reason)


@hookimpl
def failslow_on_plan_result(plan: Any, step: int | None, outcome: str, detail: str) -> None:
    where = f" from step {step}" if step is not None else ""
    log.warning("failslow: %s %s%s %s", type(plan).__name__, outcome, where, detail)
