"""Plans the planner emits and adapters apply (DESIGN.md, Contracts: Plan).

One of :class:`Ignore` (greyhound S1), :class:`MicroBatchPlan` (S2), :class:`TopologyPlan`
(S3), :class:`RestartPlan` (S4) or :class:`RerouteOrReconfigure` (odyssey IV: data rerouting or
dynamic parallelism after a fail-stop). Each carries its estimated overhead (seconds of lost
training, paid once) and expected step time afterwards, so the ski-rental policy and the
simulator compare them on one scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from failslow.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Plan:
    overhead_s: float = 0.0
    """Estimated one-off cost of applying the plan, in seconds of lost training."""
    step_time_s: float | None = None
    """Estimated step time once the plan is in effect (None: unknown)."""
    baseline_step_s: float | None = None
    """The same model's estimate for the configuration the plan replaces (None: unknown). With
    it, the planner judges the plan by the model's *relative* gain applied to the observed step
    time (``observed * step_time_s / baseline_step_s``): a slowdown factor measured by a GEMM
    is not the job's, so absolute estimates and observations are not on one scale."""


@dataclass(frozen=True, kw_only=True)
class Ignore(Plan):
    pass


@dataclass(frozen=True, kw_only=True)
class MicroBatchPlan(Plan):
    """Micro-batches per DP replica and the loss weights that keep the gradient unchanged.

    ``weights[r] = counts[r] * D / M``: replica ``r`` scales its mean loss by it, so the
    all-reduced mean gradient equals the even split's (greyhound 5.2, weighted aggregation).
    """

    counts: tuple[int, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class StateMove:
    """Copy the training state of one role from one host to another."""

    role: int
    src_host: str
    dst_host: str
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class TopologyPlan(Plan):
    """New host of every role (``hosts[r]``), and the state moves that get it there."""

    hosts: tuple[str, ...]
    moves: tuple[StateMove, ...] = ()
    reason: str = ""

    @property
    def bytes_moved(self) -> int:
        return sum(m.nbytes for m in self.moves)


@dataclass(frozen=True, kw_only=True)
class RestartPlan(Plan):
    """Restart from the in-memory checkpoint without ``evict`` hosts, on ``replacements``."""

    evict: tuple[str, ...]
    replacements: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RerouteOrReconfigure(Plan):
    """Odyssey's choice after losing nodes: reroute data within the old layout, or re-plan.

    ``choice`` is ``"reroute"`` (keep DP/PP, survivors of a stage take the lost replicas'
    micro-batches, odyssey Eq. 12-13) or ``"reconfigure"`` (new DP/PP sizes, layer split and
    batch distribution, odyssey Alg. 1).
    """

    choice: str
    dp: int
    pp: int
    layers_per_stage: tuple[int, ...] = ()
    micro_batches_per_replica: tuple[int, ...] = ()
    failed_per_stage: tuple[int, ...] = ()
    alternatives: dict[str, float] = field(default_factory=dict)
    """Estimated total cost (seconds) of each option considered, for the record."""


def same_change(a: Plan | None, b: Plan | None) -> bool:
    """Whether ``a`` and ``b`` change the job the same way (the same counts and weights, the
    same placement, the same evictions), whatever their estimates of cost and gain."""
    if a is None or b is None:
        return a is b
    if type(a) is not type(b):
        return False
    def bare(plan: Plan) -> Plan:
        return dataclasses.replace(plan, overhead_s=0.0, step_time_s=None, baseline_step_s=None)

    return bare(a) == bare(b)


PLAN_TYPES: dict[str, type[Plan]] = {
    cls.__name__: cls
    for cls in (
        Ignore,
        MicroBatchPlan,
        TopologyPlan,
        RestartPlan,
        RerouteOrReconfigure,
    )
}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """``{"type": class name, **fields}`` with tuples as lists (JSON-able; for the store)."""
    data = dataclasses.asdict(plan)
    data["type"] = type(plan).__name__
    return data


def plan_from_dict(data: dict[str, Any], types: Mapping[str, type[Plan]] = PLAN_TYPES) -> Plan:
    """Inverse of :func:`plan_to_dict` over ``types`` (a channel may carry more kinds than the
    planner's); a malformed record raises a one-line ConfigError."""
    data = dict(data)
    cls = types.get(str(data.pop("type", "")))
    if cls is None:
        raise ConfigError(f"plan record: unknown type; expected one of {sorted(types)}")
    try:
        if cls is TopologyPlan:
            data["moves"] = tuple(StateMove(**m) for m in data.get("moves", ()))
        for name, value in data.items():
            if isinstance(value, list):
                data[name] = tuple(value)
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"plan record for {cls.__name__}: {exc}") from exc
