"""The Diagnosis record: what localization found (DESIGN.md, Contracts: Diagnosis).

Written by the validator (greyhound 4.3: GEMM on suspect ranks, O(1) ring/tree link passes)
and read by the planner (greyhound 5.1 filters strategies by root cause, Table 2). A slowdown
is a measured time ratio: 1.0 is healthy, 2.0 means the rank or link takes twice as long.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from failslow.errors import FailslowError


class Kind(enum.Enum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class SlowRank:
    rank: int
    slowdown: float


@dataclass(frozen=True, slots=True)
class SlowLink:
    """A slow link between two global ranks (on different hosts for a network link)."""

    a: int
    b: int
    slowdown: float


def _check_slowdown(what: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 1.0):
        raise FailslowError(f"diagnosis: {what} slowdown must be a finite ratio >= 1, got {value}")


@dataclass(frozen=True)
class Diagnosis:
    kind: Kind
    slow_ranks: tuple[SlowRank, ...] = ()
    slow_links: tuple[SlowLink, ...] = ()
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for s in self.slow_ranks:
            _check_slowdown(f"rank {s.rank}", s.slowdown)
        for link in self.slow_links:
            _check_slowdown(f"link {link.a}-{link.b}", link.slowdown)

    @property
    def compute(self) -> bool:
        return self.kind in (Kind.COMPUTE, Kind.BOTH)

    @property
    def communication(self) -> bool:
        return self.kind in (Kind.COMMUNICATION, Kind.BOTH)

    def to_json(self) -> str:
        return json.dumps(
            {
                "kind": self.kind.value,
                "slow_ranks": [[s.rank, s.slowdown] for s in self.slow_ranks],
                "slow_links": [[x.a, x.b, x.slowdown] for x in self.slow_links],
                "evidence": dict(self.evidence),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Diagnosis:
        try:
            raw = json.loads(text)
            return cls(
                kind=Kind(raw["kind"]),
                slow_ranks=tuple(SlowRank(int(r), float(s)) for r, s in raw["slow_ranks"]),
                slow_links=tuple(
                    SlowLink(int(a), int(b), float(s)) for a, b, s in raw["slow_links"]
                ),
                evidence=raw.get("evidence", {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FailslowError(f"diagnosis: malformed record ({exc}): {text[:200]}") from exc
