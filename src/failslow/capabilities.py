"""What an adapter can do, and the error for asking what it cannot (DESIGN.md, Invariants).

Every adapter declares a :class:`Capabilities` (SQLAlchemy's requirements object is the model):
each mitigation is supported, or unsupported with the reason a user reads. The session and the
conformance suite hold adapters to it: asking for an unsupported mitigation raises
:class:`Unsupported` naming the capability and the reason - never a silently wrong result.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from failslow.errors import FailslowError

SUPPORTED = ""


class Unsupported(FailslowError, NotImplementedError):
    """A mitigation this job's adapter cannot apply; names the capability and why."""

    def __init__(self, capability: str, reason: str) -> None:
        self.capability = capability
        self.reason = reason
        super().__init__(f"{capability} is not supported here: {reason}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """One field per mitigation: ``""`` (:data:`SUPPORTED`) or the reason it is not."""

    microbatch_plans: str
    """S2: uneven micro-batches per DP replica with an unchanged gradient."""
    topology_plans: str
    """S3: a new rank-to-host placement in place, without a process restart."""
    snapshots: str
    """In-memory snapshot and bitwise restore of the rank's training state."""
    hot_update: str
    """Code update in place, resuming at the same step."""

    def supports(self, capability: str) -> bool:
        return getattr(self, capability) == SUPPORTED

    def require(self, capability: str) -> None:
        """Raise :class:`Unsupported` unless ``capability`` is supported."""
        if capability not in self.names():
            raise ValueError(f"unknown capability {capability!r}; known: {self.names()}")
        reason = getattr(self, capability)
        if reason != SUPPORTED:
            raise Unsupported(capability, reason)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in self.names()}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> Capabilities:
        return cls(**{name: str(data.get(name, "not declared")) for name in cls.names()})
