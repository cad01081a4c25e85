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
    checked = outcome in ("in effect", "not in effect")  # after the step, from what ran
    where = "" if step is None else f" at step {step}" if checked else f" from step {step}"
    log.warning(
        "failslow: %s %s%s%s", type(plan).__name__, outcome, where, f": {detail}" if detail else ""
    )
