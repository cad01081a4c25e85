"""One planner for fail-slows and fail-stops (DESIGN.md: Planner; greyhound 5, odyssey IV).

:class:`Planner` is what the controller and the simulator talk to. Fail-slows go through the
ski-rental :class:`~failslow.core.planner.ski_rental.MultiLevelPlanner` over S2 (exact
micro-batch allocation), S3 (topology plan) and S4 (restart without the bad hosts), each
built for the current layout with its estimated overhead; fail-stops go to odyssey's
reroute-or-reconfigure choice (Eq. 8) when a layer profile is known, else to a restart. All
costs come from :class:`MitigationCosts` (measured or configured), none from this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

from failslow.core.diagnosis.record import Diagnosis
from failslow.core.planner.allocation import loss_weights, microbatch_plan
from failslow.core.planner.config import PlannerConfig
from failslow.core.planner.duration_prior import DurationPrior, DurationPriors
from failslow.core.planner.measured_step import MeasuredSteps
from failslow.core.planner.odyssey import ClusterState, ModelProfile, plan_failstop
from failslow.core.planner.plans import MicroBatchPlan, Plan, RerouteOrReconfigure, RestartPlan
from failslow.core.planner.ski_rental import (
    ALL_KINDS,
    COMPUTE_ONLY,
    BreakEven,
    BuyRule,
    Decision,
    ExpectedCost,
    MultiLevelPlanner,
    Strategy,
)
from failslow.core.planner.topology_plan import plan_topology
from failslow.core.topology import Topology
from failslow.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class MitigationCosts:
    """What actions cost on this cluster: measured where the job can, configured otherwise."""

    microbatch_apply_s: float = 0.0
    """Beyond the measured solve time: S2 takes effect at the next step boundary."""
    state_bytes_per_rank: int
    transfer_bytes_per_s: float
    pause_s: float
    """Pause, regroup communicators and resume around a topology swap."""
    restart_s: float
    """Restart without the evicted hosts (from in-memory checkpoints if available)."""
    replan_s: float = 0.0
    """Odyssey: restart in a new parallel layout, on top of the weight transfer."""


LEVEL_NAMES = {"S2": "S2 micro-batches", "S3": "S3 topology", "S4": "S4 restart"}
"""The strategies' names in decisions, events and metrics, by the config's short names."""


def restart_hosts(topology: Topology, diagnosis: Diagnosis) -> tuple[str, ...]:
    """The hosts S4 restarts the job without, the worst first: the slow ranks' hosts by
    slowdown, then the far end (``b``) of each slow link by slowdown."""
    order = [(s.slowdown, topology.hosts[s.rank]) for s in diagnosis.slow_ranks]
    links = [(link.slowdown, topology.hosts[link.b]) for link in diagnosis.slow_links]
    hosts: list[str] = []
    for group in (order, links):
        for _, host in sorted(group, key=lambda item: -item[0]):
            if host not in hosts:
                hosts.append(host)
    return tuple(hosts)


def buy_rule(config: PlannerConfig, world_size: int) -> BuyRule:
    """The buy rule ``config`` asks for, with its duration priors for a job of ``world_size``."""
    if config.rule == "break-even":
        return BreakEven()
    priors = DurationPriors.characterization(world_size, sigma=config.duration_sigma)
    priors = DurationPriors(
        DurationPrior(config.compute_mean_s, config.duration_sigma),
        DurationPrior(config.communication_mean_s, config.duration_sigma)
        if config.communication_mean_s > 0
        else priors.communication,
    )
    return ExpectedCost(priors, earliest=config.earliest)


class Planner:
    """Decisions for one job. ``estimate`` (optional) predicts a plan's step time on the
    observed scale (None where it cannot). ``measure`` (optional) gives the job's measured
    per-replica step model for a diagnosis (the mitigator's, from the ranks' step profiles,
    :mod:`failslow.core.planner.measured_step`; None where no profile is published): S2's
    counts are then the ones that model says minimize the step, and its prediction is that
    model's - the validation GEMM's slowdown only where nothing was measured.

    ``revert_topology``: undo a topology swap at relief, as greyhound does (7.5). Off by
    default: a node-granular swap leaves a healthy job exactly as fast as before (the same
    layout on renamed hosts), so undoing it only pays the pause and the state moves again.
    Micro-batch plans are always undone at relief (the even split is the healthy optimum).
    ``strategies``: the levels this job may use ("S2", "S3", "S4"; the adapter's capabilities
    and the user's config decide). ``rule``: when to buy (default
    :class:`~failslow.core.planner.ski_rental.ExpectedCost` under greyhound's characterization
    for a job of this size; :class:`~failslow.core.planner.ski_rental.BreakEven` is Algorithm 1
    as published). ``standbys``: how many hosts a restart can replace now (the node
    launchers' free standby slots; None: no limit known) - S4 evicts the worst that many of
    the diagnosed hosts, and is no option without one (a host restarted in place keeps its
    slow GPU or link).
    """

    def __init__(
        self,
        topology: Topology,
        costs: MitigationCosts,
        *,
        healthy_microbatch_s: float,
        profile: ModelProfile | None = None,
        estimate: Callable[[Plan, Topology], float | None] | None = None,
        measure: Callable[[Diagnosis], MeasuredSteps | None] | None = None,
        standbys: Callable[[], int | None] | None = None,
        min_gain: float = 0.05,
        revert_topology: bool = False,
        strategies: Collection[str] = ("S2", "S3", "S4"),
        rule: BuyRule | None = None,
    ) -> None:
        self.topology = topology
        self.costs = costs
        self.profile = profile
        self._healthy_microbatch_s = healthy_microbatch_s
        self._estimate = estimate
        self._measure = measure
        self._standbys = standbys
        self._why_not: dict[str, str] = {}
        """Level name -> why its builder had no plan for the newest diagnosis."""
        names = LEVEL_NAMES
        levels = {
            "S2": Strategy(names["S2"], COMPUTE_ONLY, self._s2),
            "S3": Strategy(names["S3"], ALL_KINDS, self._s3, revertible=revert_topology),
            "S4": Strategy(names["S4"], ALL_KINDS, self._s4, last_resort=True, revertible=False),
        }
        unknown = set(strategies) - set(levels)
        if unknown:
            raise ConfigError(
                f"planner: unknown strategies {sorted(unknown)}; allowed: {', '.join(levels)}"
            )
        if rule is None:
            rule = ExpectedCost(DurationPriors.characterization(topology.world_size))
        self.ski = MultiLevelPlanner(
            [levels[name] for name in levels if name in strategies], min_gain=min_gain, rule=rule
        )

    # ---- fail-slow -------------------------------------------------------------------------
    def onset(
        self, diagnosis: Diagnosis, *, healthy_step_s: float, age_s: float = 0.0
    ) -> list[Decision]:
        return self.ski.onset(diagnosis, healthy_step_s=healthy_step_s, age_s=age_s)

    def reconsider(self, diagnosis: Diagnosis) -> list[Decision]:
        return self.ski.reconsider(diagnosis)

    def observe(self, step_time_s: float) -> list[Decision]:
        return self.ski.observe(step_time_s)

    def catch_up(self, step_times: list[float]) -> list[Decision]:
        return self.ski.catch_up(step_times)

    def relief(self) -> list[Decision]:
        return self.ski.relief()

    def passed_over(self) -> dict[str, str]:
        """Level -> why the newest diagnosis got no plan from it (the builder's own reason
        where it gave one)."""
        return {name: self._why_not.get(name, why) for name, why in self.ski.passed_over.items()}

    def _with_estimate(self, plan: Plan, layout: Topology) -> Plan:
        """The plan with the job's own estimate of its step time, where it has one (None: the
        builder's). That estimate is on the observed scale, so the builder's relative
        baseline (another model's) is dropped."""
        step_s = self._estimate(plan, layout) if self._estimate is not None else None
        if step_s is None:
            return plan
        return replace(plan, step_time_s=step_s, baseline_step_s=None)

    def _s2(self, diagnosis: Diagnosis) -> Plan | None:
        started = time.perf_counter()
        topology = self.topology
        model = self._measure(diagnosis) if self._measure is not None else None
        if model is not None:  # sized from what each replica's step measured
            unit = topology.microbatch_multiple or (topology.pp if topology.pp > 1 else 1)
            counts = model.best_counts(topology.micro_batches, multiple_of=unit, minimum=unit)
            if not model.calibrated and unit == 1:
                counts = probe_counts(counts, topology.micro_batches // topology.dp)
            plan: MicroBatchPlan = MicroBatchPlan(
                counts=counts,
                weights=tuple(loss_weights(counts)),
                step_time_s=model.step_s(counts),
            )
        else:  # nothing measured yet: the validation GEMM's slowdown
            plan = microbatch_plan(
                topology, diagnosis, healthy_time=self._healthy_microbatch_s, overhead_s=0.0
            )
        solve_s = time.perf_counter() - started
        even = topology.micro_batches // topology.dp
        self._why_not.pop(LEVEL_NAMES["S2"], None)
        if all(c == even for c in plan.counts):
            self._why_not[LEVEL_NAMES["S2"]] = (
                "the step the ranks measured is shortest with the even split"
                if model is not None
                else "the validation GEMM's slowdown is too small to move a micro-batch"
            )
            return None
        plan = replace(plan, overhead_s=solve_s + self.costs.microbatch_apply_s)
        return plan if model is not None else self._with_estimate(plan, topology)

    def _s3(self, diagnosis: Diagnosis) -> Plan | None:
        plan = plan_topology(
            self.topology,
            diagnosis,
            state_bytes_per_rank=self.costs.state_bytes_per_rank,
            transfer_bandwidth_bytes_per_s=self.costs.transfer_bytes_per_s,
            pause_s=self.costs.pause_s,
        )
        if plan is None:
            return None
        return self._with_estimate(plan, self.topology.with_hosts(plan.hosts))

    def _s4(self, diagnosis: Diagnosis) -> Plan | None:
        hosts = restart_hosts(self.topology, diagnosis)
        free = self._standbys() if self._standbys is not None else None
        if free is not None:
            hosts = hosts[:free]  # a host restarted in place keeps its slow GPU or link
        self._why_not.pop(LEVEL_NAMES["S4"], None)
        if not hosts:
            self._why_not[LEVEL_NAMES["S4"]] = (
                "no free standby host to replace the diagnosed one(s)"
                if free == 0
                else "the diagnosis names no host"
            )
            return None
        # without the diagnosed hosts the job runs at its healthy pace again: that is the
        # prediction the controller measures the restart against
        healthy_step = self._healthy_microbatch_s * self.topology.micro_batches / self.topology.dp
        plan = RestartPlan(
            evict=tuple(sorted(hosts)), overhead_s=self.costs.restart_s, step_time_s=healthy_step
        )
        return self._with_estimate(plan, self.topology)

    # ---- fail-stop -------------------------------------------------------------------------
    def failstop(
        self,
        failed_hosts: Iterable[str],
        *,
        horizon_s: float,
        options: tuple[str, ...] = ("reroute", "reconfigure"),
    ) -> RerouteOrReconfigure | RestartPlan:
        """Plan after losing ``failed_hosts``: odyssey's choice, or a restart without a profile."""
        failed = tuple(sorted(set(failed_hosts)))
        if self.profile is None:
            return RestartPlan(evict=failed, overhead_s=self.costs.restart_s)
        return plan_failstop(
            self.profile,
            ClusterState.from_topology(self.topology, failed),
            global_batch_microbatches=self.topology.micro_batches,
            horizon_s=horizon_s,
            restart_s=self.costs.replan_s,
            transfer_bandwidth_Bps=self.costs.transfer_bytes_per_s,
            options=options,
        )


def probe_counts(best: tuple[int, ...], even: int) -> tuple[int, ...]:
    """A probe on the way to ``best`` from the even split (``even`` each): every replica that
    gives micro-batches away gives half of what ``best`` takes from it (rounded toward
    ``best``), the ones that receive take less, the largest gains first. S2's size form plans
    it where a replica's cost per unit is a linear guess: what the replica measures at a
    second count gives its part per micro-batch, so the split is then sized from measurement
    and its prediction extrapolates from two measured counts (the probe itself already moves
    work off the slowed replica)."""
    probe = [
        e + (b - e) // 2 if b < e else b for b, e in zip(best, [even] * len(best), strict=True)
    ]
    surplus = sum(probe) - sum(best)
    while surplus > 0:
        gainer = max(range(len(probe)), key=lambda i: (probe[i] - even, -i))
        if probe[gainer] <= even:
            break
        probe[gainer] -= 1
        surplus -= 1
    return tuple(probe) if surplus == 0 else best
