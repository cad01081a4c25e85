"""The controller side of a validation round (greyhound 4.3, "Validation").

:func:`validation_round` pauses every rank at one collective (through the agents and their
traps, :mod:`failslow.core.control.agent`), runs the GEMM and O(1) link tests, always releases
the job, and returns each task's per-rank results; :func:`diagnose` turns them into a
:class:`~failslow.core.diagnosis.record.Diagnosis`. Store traffic per round: a handful of
writes, one counter per task, and one read per rank and task - nothing per iteration.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from failslow.core.control.agent import DEFAULT_PREFIX
from failslow.core.control.store import Store
from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.errors import FailslowError


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
    group_key: int,
    call_index: int,
    tasks: Sequence[Mapping[str, Any]],
    timeout_s: float = 30.0,
    prefix: str = DEFAULT_PREFIX,
) -> RoundResult:
    """Pause all ``world_size`` ranks at ``(group_key, call_index)``, run ``tasks``, release.

    ``call_index`` must be one no rank has reached yet (the caller takes the ranks' current
    position plus a margin). The job is released on every path, timeouts and errors included.
    """
    epoch = store.add(f"{prefix}/epoch", 1)
    base = f"{prefix}/{epoch}"
    deadline = time.monotonic() + timeout_s
    store.set_json(
        f"{prefix}/pause", {"epoch": epoch, "group_key": group_key, "call_index": call_index}
    )
    try:
        if not _wait_count(store, f"{base}/parked", world_size, deadline, f"{base}/missed"):
            parked = store.add(f"{base}/parked", 0)
            missed = store.add(f"{base}/missed", 0)
            if missed:
                raise PauseMissed(
                    f"validation round {epoch}: {missed} rank(s) were past call {call_index} "
                    f"of group {group_key} when the request arrived"
                )
            raise ValidationTimeout(
                f"validation round {epoch}: only {parked} of {world_size} ranks parked at "
                f"call {call_index} of group {group_key} within {timeout_s:.0f} s"
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


def diagnose(
    gemm: Mapping[int, Any] | None,
    links: Mapping[int, Any] | None,
    *,
    threshold: float = 1.1,
    evidence: Mapping[str, Any] | None = None,
) -> Diagnosis | None:
    """A Diagnosis from one GEMM task's and one links task's per-rank results (None: healthy).

    GEMM: each rank's slowest dtype time against the peers' median (greyhound: > 1.1x is slow).
    Links: the link times reported by rank 0 (every rank returns the same table) against the
    median link; a slow link with a compute-slow endpoint is attributed to that rank (kept in
    the evidence), since a stalled rank also stalls every transfer it takes part in.
    """
    from failslow.core.validation.gemm import slow_ranks
    from failslow.core.validation.links import slow_links

    slow_r: dict[int, float] = {}
    record: dict[str, Any] = dict(evidence or {})
    if gemm:
        per_rank = {
            r: max(v["ok"].values()) for r, v in gemm.items() if v and "ok" in v and v["ok"]
        }
        slow_r = slow_ranks(per_rank, threshold=threshold)
        record["gemm_s"] = per_rank
    slow_l: dict[tuple[int, int], float] = {}
    if links:
        table = next((v["ok"] for _, v in sorted(links.items()) if v and "ok" in v), None)
        if table:
            seconds = {(int(a), int(b)): float(s) for a, b, s in table}
            slow_l = slow_links(seconds, threshold=threshold)
            record["link_s"] = [[a, b, s] for (a, b), s in seconds.items()]
            # a rank that computes slowly also sends and acknowledges late: its links are
            # explained by the compute fail-slow unless the link is slow on its own
            explained = {link for link in slow_l if link[0] in slow_r or link[1] in slow_r}
            if explained:
                record["links_explained_by_slow_ranks"] = sorted(explained)
                slow_l = {k: v for k, v in slow_l.items() if k not in explained}
    if not slow_r and not slow_l:
        return None
    kind = Kind.BOTH if slow_r and slow_l else Kind.COMPUTE if slow_r else Kind.COMMUNICATION
    return Diagnosis(
        kind,
        tuple(SlowRank(r, max(1.0, s)) for r, s in sorted(slow_r.items())),
        tuple(SlowLink(a, b, max(1.0, s)) for (a, b), s in sorted(slow_l.items())),
        record,
    )
