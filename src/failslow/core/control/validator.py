"""The controller side of a validation round (greyhound 4.3, "Validation").

:func:`validation_round` pauses every rank at one collective (through the agents and their
traps, :mod:`failslow.runtime.agent`), runs the GEMM and O(1) link tests, always releases
the job, and returns each task's per-rank results;
:func:`failslow.core.localize.diagnose.diagnose` turns them into a
:class:`~failslow.core.diagnosis.record.Diagnosis`. Store traffic per round: a handful of
writes, one counter per task, and one read per rank and task - nothing per iteration.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from failslow.core.control import keys
from failslow.core.control.store import Store
from failslow.errors import FailslowError

AGENT_POLL_S = 0.2
"""How often a rank's agent looks for a pause request, unless told otherwise; each agent
publishes its own period in its progress record (the controller sizes the pause margin by it)."""


class ValidationTimeout(FailslowError):
    """Ranks did not park or finish a task in time; the job was released anyway."""


class PauseMissed(ValidationTimeout):
    """A rank was already past the target collective; released at once, retry further ahead."""


@dataclass(frozen=True)
class RoundResult:
    epoch: int
    results: list[dict[int, Any]]
    """Per task, rank -> that rank's result (``{"ok": ...}`` or ``{"error": ...}``)."""
    paused_s: float


def _wait_count(
    store: Store, key: str, want: int, deadline: float, abort: str | None = None
) -> bool:
    while True:
        if store.add(key, 0) >= want:
            return True
        if time.monotonic() >= deadline or (abort is not None and store.add(abort, 0) > 0):
            return False
        time.sleep(0.01)


def validation_round(
    store: Store,
    *,
    world_size: int,
    tasks: Sequence[Mapping[str, Any]],
    group_key: int = 0,
    call_index: int = 0,
    step: int | None = None,
    timeout_s: float = 30.0,
    prefix: str = keys.VALIDATE,
    token: str | None = None,
) -> RoundResult:
    """Pause all ``world_size`` ranks at ``(group_key, call_index)`` - or, with ``step``, at
    the boundary of that training step (session-driven ranks) - run ``tasks``, release.

    The target must be one no rank has reached yet (the caller takes the ranks' current
    position plus a margin). The job is released on every path, timeouts and errors included.
    """
    epoch = store.add(f"{prefix}/epoch", 1)
    base = f"{prefix}/{epoch}"
    deadline = time.monotonic() + timeout_s
    request: dict[str, Any] = {"epoch": epoch}
    if step is not None:
        request["step"] = step
        where = f"the boundary of step {step}"
    else:
        request.update(group_key=group_key, call_index=call_index)
        where = f"call {call_index} of group {group_key}"
    if token:
        request["token"] = token  # ranks holding the job's token act on nothing else
    store.set_json(f"{prefix}/pause", request)
    try:
        if not _wait_count(store, f"{base}/parked", world_size, deadline, f"{base}/missed"):
            parked = store.add(f"{base}/parked", 0)
            missed = store.add(f"{base}/missed", 0)
            if missed:
                raise PauseMissed(
                    f"validation round {epoch}: {missed} rank(s) were past {where} when the "
                    "request arrived"
                )
            raise ValidationTimeout(
                f"validation round {epoch}: only {parked} of {world_size} ranks parked at "
                f"{where} within {timeout_s:.0f} s"
            )
        parked_at = time.monotonic()
        store.set_json(f"{base}/tasks", list(tasks))
        results: list[dict[int, Any]] = []
        for i in range(len(tasks)):
            if not _wait_count(store, f"{base}/done/{i}", world_size, deadline):
                raise ValidationTimeout(
                    f"validation round {epoch}: task {i} ({tasks[i].get('kind')}) did not "
                    f"finish on all {world_size} ranks within {timeout_s:.0f} s"
                )
            results.append({r: store.get_json(f"{base}/result/{i}/{r}") for r in range(world_size)})
        return RoundResult(epoch, results, time.monotonic() - parked_at)
    finally:
        store.set(f"{base}/release", b"1")

