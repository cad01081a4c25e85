"""The stop-time checks: the ladder's first rung, which names defective machines (byterobust
4.2 "Diagnose", 4.3 "NaN loss diagnosis").

When training stopped on an incident that names no machine (a NaN loss, a 5x jump), byterobust
first tests the machines: the GPU ("EUD"), the links between machines ("each machine runs an
all-gather test with neighboring machines to verify the connectivity and integrity of data
transfer"), then a *bit-wise alignment* test - every machine runs one training step of a
reference model with predefined weights on fixed input, and "machines that yield incorrect
results are promptly isolated". Only when every machine passes does the ladder go on to
reattempt, roll back and replay (:mod:`failslow.core.planner.ladder`).

Each machine runs the tests in a world of its own (:mod:`failslow.runtime.stop_check`) and
reports one result; :func:`judge` reads them all, pure:

- **device**: a GEMM checked against the same product in float64; a relative error above
  :data:`DEVICE_TOLERANCE` is a defective device (float32 at these sizes errs by ~1e-6);
- **links**: each machine sends a known pattern to the next one in a ring and checks what the
  previous one sent; a machine on every bad link is named, else both ends of each bad link;
- **bitwise alignment**: the digest of the reference step (loss, gradients, updated weights);
  the digest a strict majority of machines computed is the right one, and a machine with
  another digest is named. No strict majority names nobody: the machines disagree among
  themselves, and there is no telling which are right;
- a machine that reported nothing (it crashed or hung in its own tests) while others reported
  is named; when none reported, the tests did not run and nobody is.

Times (the GEMM's, each link's) are reported, never judged: a slow machine does not make a
NaN, and the fail-slow localization (:mod:`failslow.core.localize`) owns speed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEVICE_TOLERANCE = 1e-4
"""A GEMM's largest error against float64, relative to the product's largest magnitude, above
which the device is defective."""


@dataclass(frozen=True, slots=True)
class CheckVerdict:
    suspects: list[int]
    """The machines (the world's ranks) the checks name, sorted; empty: every machine passed
    (or the checks could not tell)."""
    why: str
    """One line: what named each suspect, or why nobody is named."""
    table: list[dict[str, Any]] = field(default_factory=list)
    """Per machine: ``rank``, ``device_error``, ``gemm_s``, ``digest`` (short), ``link`` (from
    the previous machine: ``ok`` or why not), ``local_s`` (its device and reference tests),
    ``join_s`` (the link test's world formed), ``verdict``."""

    def to_dict(self) -> dict[str, Any]:
        return {"suspects": self.suspects, "why": self.why, "table": self.table}


def judge(results: Mapping[int, Mapping[str, Any] | None], machines: int) -> CheckVerdict:
    """The verdict on ``machines`` machines from their results (a rank missing or None: it
    reported nothing). A result holds ``device`` (``{"rel_error", "seconds"}``), ``digest``
    (hex) and ``link`` (``{"from", "ok", "why", "seconds"}``, what it received from the
    previous machine in the ring; absent on one machine or before the link test ran)."""
    reported = {r: res for r in range(machines) if (res := results.get(r)) is not None}
    if not reported:  # a row per machine still, each saying so
        table = [_row(r, None, ["reported nothing"]) for r in range(machines)]
        return CheckVerdict([], "no machine reported its stop-time checks: they did not run", table)
    reasons: dict[int, list[str]] = {r: [] for r in range(machines)}
    for r in range(machines):
        if r not in reported:
            reasons[r].append("reported nothing (crashed or hung in its own tests)")
    for r, res in reported.items():
        error = (res.get("device") or {}).get("rel_error")
        if error is None or not error <= DEVICE_TOLERANCE:  # NaN is not <= anything
            reasons[r].append(f"its GEMM is off by {_num(error)} (> {DEVICE_TOLERANCE:g})")
    for r, why in _links(reported, machines).items():
        reasons[r].append(why)
    alignment = _alignment(reported)
    for r, why in alignment[0].items():
        reasons[r].append(why)
    suspects = sorted(r for r, why in reasons.items() if why)
    table = [_row(r, reported.get(r), reasons[r]) for r in range(machines)]
    if suspects:
        why = "; ".join(f"machine {r} {' and '.join(reasons[r])}" for r in suspects)
    else:
        why = f"every machine passed the device, link and bitwise-alignment checks{alignment[1]}"
    return CheckVerdict(suspects, why, table)


def _links(reported: Mapping[int, Mapping[str, Any]], machines: int) -> dict[int, str]:
    bad: list[tuple[int, int, str]] = []
    for r, res in reported.items():
        link = res.get("link")
        if link is not None and not link.get("ok"):
            bad.append((int(link.get("from", (r - 1) % machines)), r, str(link.get("why"))))
    if not bad:
        return {}
    on_every = set.intersection(*({a, b} for a, b, _ in bad))
    named: dict[int, str] = {}
    for a, b, why in bad:
        for r in sorted(on_every) if on_every else (a, b):
            named.setdefault(r, f"is on the bad link {a} -> {b} ({why})")
    return named


def _alignment(reported: Mapping[int, Mapping[str, Any]]) -> tuple[dict[int, str], str]:
    digests = {r: str(d) for r, res in reported.items() if (d := res.get("digest"))}
    if len(digests) < 2:
        return {}, ""
    right, votes = Counter(digests.values()).most_common(1)[0]
    if votes * 2 <= len(digests):
        spread = len(set(digests.values()))
        return {}, f" (bitwise alignment: {spread} digests, no majority - nobody named by it)"
    return {
        r: f"computes the reference step differently ({d[:12]} != {right[:12]} of "
        f"{votes} of {len(digests)} machines)"
        for r, d in digests.items() if d != right
    }, ""  # fmt: skip


def _row(rank: int, res: Mapping[str, Any] | None, reasons: list[str]) -> dict[str, Any]:
    res = res or {}
    device = res.get("device") or {}
    link = res.get("link")
    return {
        "rank": rank,
        "device_error": device.get("rel_error"),
        "gemm_s": device.get("seconds"),
        "digest": str(res["digest"])[:12] if res.get("digest") else None,
        "link": None if link is None else "ok" if link.get("ok") else str(link.get("why")),
        "local_s": res.get("local_s"),
        "join_s": res.get("join_s"),
        "verdict": "; ".join(reasons) if reasons else "pass",
    }


def _num(value: Any) -> str:
    return "nothing (not measured)" if value is None else f"{float(value):.3g}"
