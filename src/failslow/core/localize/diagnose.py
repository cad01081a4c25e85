"""A validation round's results as a Diagnosis (greyhound 4.3, "Validation").

The controller's round (:mod:`failslow.core.control.validator`) returns each task's per-rank
results: every rank's GEMM times and the O(1) ring/tree link passes' times. :func:`diagnose`
names the slow ranks (slowest dtype against the peers' median) and the slow links (against the
median link), attributing a slow link with a compute-slow endpoint to that rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.localize.validation.gemm import FIRST, slow_ranks
from failslow.core.localize.validation.links import slow_links


def diagnose(
    gemm: Mapping[int, Any] | None,
    links: Mapping[int, Any] | None,
    *,
    threshold: float = 1.1,
    evidence: Mapping[str, Any] | None = None,
) -> Diagnosis | None:
    """A Diagnosis from one GEMM task's and one links task's per-rank results (None: healthy).

    GEMM: each rank's slowest dtype time against the peers' median (greyhound: > 1.1x is slow);
    a round timed twice before blame keeps its first timing in the evidence (``gemm_first_s``).
    Links: the link times reported by rank 0 (every rank returns the same table) against the
    median link; a slow link with a compute-slow endpoint is attributed to that rank (kept in
    the evidence), since a stalled rank also stalls every transfer it takes part in.
    """
    slow_r: dict[int, float] = {}
    record: dict[str, Any] = dict(evidence or {})
    if gemm:
        ok = {r: dict(v["ok"]) for r, v in gemm.items() if v and "ok" in v and v["ok"]}
        first = {r: times.pop(FIRST) for r, times in ok.items() if FIRST in times}
        per_rank = {r: max(times.values()) for r, times in ok.items() if times}
        slow_r = slow_ranks(per_rank, threshold=threshold)
        record["gemm_s"] = per_rank
        if first:  # timed twice before blame: what the first timing said
            record["gemm_first_s"] = {r: max(times.values()) for r, times in first.items()}
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
