"""Mitigation policies the simulator compares, each driving the real planner code.

- ``none``: ignore fail-slows; after a fail-stop wait for the repair, restart from the last
  remote checkpoint.
- ``restart``: every diagnosed fail-slow and every fail-stop -> checkpoint to remote storage
  and restart without the bad host (greyhound S4 alone).
- ``greyhound``: ski-rental over S1..S4 as published (greyhound 5.1 Alg. 1, the break-even
  rule) with the real S2 allocator under the paper's rule that a replica's count is a multiple
  of PP (footnote 4) and the real S3 topology planner; S4 and fail-stops use remote-storage
  checkpoint-restart.
- ``failslow``: the planner the controller runs - the expected-cost buy rule under greyhound
  3's duration prior (:class:`~failslow.core.planner.ski_rental.ExpectedCost`), S2 at the
  granularity the adapter declares, S4 and fail-stops restarting from in-memory checkpoints
  onto warm standbys (byterobust 6) and, when no standby is left, odyssey's
  reroute-or-reconfigure choice; a topology swap is kept after relief (reverting it only
  costs another pause).
- ``oracle``: the ceiling. It hears of onsets and reliefs when the detector does (detection is
  not the planner's to improve) but knows how long every fail-slow lasts and what every
  option's step time will be: at each diagnosis it takes the option (nothing, S2, S3, S3 then
  S2, S4) that completes the most steps until the fail-slows touching the job end, and after
  a fail-stop it gives odyssey's choice the true time to the next fault or repair.
- ``oobleck`` / ``recycle`` / ``odyssey``: fail-stop handling only - always reconfigure,
  always reroute, or odyssey's adaptive choice (odyssey V-B baselines).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from failslow.core.diagnosis.record import Diagnosis
from failslow.core.diagnosis.standby import spares_for_failslow
from failslow.core.planner.odyssey import ClusterState, healthy_step_time
from failslow.core.planner.planner import MitigationCosts, Planner, restart_hosts
from failslow.core.planner.plans import (
    MicroBatchPlan,
    Plan,
    RerouteOrReconfigure,
    RestartPlan,
    TopologyPlan,
)
from failslow.core.planner.ski_rental import BreakEven, BuyRule, Decision
from failslow.core.topology import Topology

if TYPE_CHECKING:
    from failslow.sim.engine import Simulation


class Policy:
    name = "none"
    halted = False

    def attach(self, sim: Simulation) -> None:
        self.sim = sim

    def on_diagnosis(self, diagnosis: Diagnosis) -> None:
        pass

    def on_relief(self) -> None:
        pass

    def on_step(self, step_s: float) -> None:
        pass

    def on_failstop(self, host: str) -> None:
        """Default: training halts until the host is repaired, then a remote restart."""
        self.halted = True
        self.sim.mark("halt until repair")

    def on_repair(self, host: str) -> None:
        if self.halted:
            self.halted = False
            self.sim.lose_progress()
            self.sim.pause(self.sim.costs.restart_disk_s)
            self.sim.mark(f"restart after repair of {host}")


def _slow_hosts(sim: Simulation, diagnosis: Diagnosis) -> list[str]:
    return sorted(restart_hosts(sim.topology, diagnosis))


class AlwaysRestart(Policy):
    name = "restart"

    def on_diagnosis(self, diagnosis: Diagnosis) -> None:
        self.sim.replace_hosts(_slow_hosts(self.sim, diagnosis))
        self.sim.pause(self.sim.costs.restart_disk_s)
        self.sim.mark("S4 restart")

    def on_failstop(self, host: str) -> None:
        self.sim.lose_progress()
        self.sim.replace_hosts([host])
        self.sim.pause(self.sim.costs.restart_disk_s)
        self.sim.mark("restart on spare")


class SkiRental(Policy):
    """greyhound 5.1: Algorithm 1 over S2 (allocation), S3 (topology), S4 (restart)."""

    name = "greyhound"
    in_memory = False

    def _rule(self) -> BuyRule | None:
        return BreakEven()  # Algorithm 1 as published

    def _layout(self, topology: Topology) -> Topology:
        """The layout the planner plans for: greyhound's S2 counts are multiples of PP."""
        return replace(topology, microbatch_multiple=0)

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        costs = sim.costs
        model = sim.scenario.model
        self.planner = Planner(
            self._layout(sim.topology),
            MitigationCosts(
                state_bytes_per_rank=costs.state_bytes_per_rank,
                transfer_bytes_per_s=costs.transfer_bytes_per_s,
                pause_s=costs.pause_s,
                restart_s=costs.restart_memory_s if self.in_memory else costs.restart_disk_s,
                replan_s=costs.replan_s,
            ),
            healthy_microbatch_s=model.forward_s + model.backward_s,
            profile=sim.scenario.profile,
            estimate=self._estimate,
            standbys=self._standbys,
            revert_topology=not self.in_memory,  # greyhound reverts (7.5); failslow keeps it
            rule=self._rule(),
        )
        self._undo: dict[int, object] = {}

    def _standbys(self) -> int | None:
        """Hosts a restart can replace: the warm spares (in memory); a restart from remote
        storage requeues onto any host."""
        return spares_for_failslow(self.sim.spares) if self.in_memory else None

    def _estimate(self, plan: Plan, layout: Topology) -> float:
        """Step time the simulator's model predicts once ``plan`` is in effect."""
        sim = self.sim
        if isinstance(plan, RestartPlan):
            return sim.healthy_step_s()
        counts = list(plan.counts) if isinstance(plan, MicroBatchPlan) else sim.counts
        return sim.step_s_under(layout, counts)

    def on_diagnosis(self, diagnosis: Diagnosis) -> None:
        self.planner.topology = self._layout(self.sim.topology)
        # the steps of the detection latency are not fed to the planner: it hears their length
        self._apply(
            self.planner.onset(
                diagnosis, healthy_step_s=self.sim.healthy_step_s(), age_s=self.sim.costs.detect_s
            )
        )

    def on_step(self, step_s: float) -> None:
        if self.planner.ski.active:
            self.planner.topology = self._layout(self.sim.topology)
            self._apply(self.planner.observe(step_s))

    def on_relief(self) -> None:
        self._apply(self.planner.relief())

    def _apply(self, decisions: list[Decision]) -> None:
        sim = self.sim
        for d in decisions:
            plan = d.plan
            sim.mark(d.strategy if d.action == "apply" else f"revert {d.strategy}")
            if d.action == "apply":
                if isinstance(plan, MicroBatchPlan):
                    self._undo[id(plan)] = list(sim.counts)
                    sim.set_counts(list(plan.counts))
                elif isinstance(plan, TopologyPlan):
                    self._undo[id(plan)] = sim.topology
                    sim.pause(plan.overhead_s)
                    sim.set_topology(sim.topology.with_hosts(plan.hosts))
                elif isinstance(plan, RestartPlan):
                    sim.pause(plan.overhead_s)
                    sim.set_counts(sim.even_counts)
                    sim.replace_hosts(list(plan.evict), warm=self.in_memory)
            else:
                previous = self._undo.pop(id(plan), None)
                if isinstance(plan, MicroBatchPlan) and isinstance(previous, list):
                    sim.set_counts(previous)
                elif isinstance(plan, TopologyPlan) and isinstance(previous, Topology):
                    sim.pause(plan.overhead_s)
                    sim.set_topology(previous)

    def on_failstop(self, host: str) -> None:
        sim = self.sim
        sim.lose_progress()
        sim.replace_hosts([host])
        sim.pause(sim.costs.restart_disk_s)
        sim.mark("restart (remote checkpoint)")


class Replanning(Policy):
    """Fail-stops handled by odyssey's model: reroute, reconfigure, or choose (Eq. 8)."""

    name = "odyssey"
    options: tuple[str, ...] = ("reroute", "reconfigure")

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        self.failed: set[str] = set()
        self.reconfigured = False

    def _replan(self, reason: str) -> None:
        sim = self.sim
        scenario = sim.scenario
        assert scenario.profile is not None
        topology = scenario.topology
        if not self.failed:
            # every host is back: return to the original layout
            cost = sim.costs.replan_s if self.reconfigured else 0.0
            sim.pause(cost)
            sim.degraded_step_s, self.reconfigured = None, False
            sim.changed()
            sim.mark(f"back to full layout ({reason})")
            return
        cluster = ClusterState.from_topology(topology, self.failed)
        alive = topology.world_size - len(self.failed) * topology.tp
        rate = scenario.host_failures_per_hour * max(alive, 1) / 3600.0
        planner = Planner(
            topology,
            MitigationCosts(
                state_bytes_per_rank=sim.costs.state_bytes_per_rank,
                transfer_bytes_per_s=sim.costs.transfer_bytes_per_s,
                pause_s=sim.costs.pause_s,
                restart_s=sim.costs.restart_memory_s,
                replan_s=sim.costs.replan_s,
            ),
            healthy_microbatch_s=scenario.model.forward_s + scenario.model.backward_s,
            profile=scenario.profile,
        )
        plan = planner.failstop(
            self.failed,
            horizon_s=self._horizon_s(1.0 / rate if rate > 0 else scenario.duration_s),
            options=self._options(cluster),
        )
        assert isinstance(plan, RerouteOrReconfigure)
        full = healthy_step_time(
            scenario.profile, ClusterState.from_topology(topology), topology.micro_batches
        )
        assert plan.step_time_s is not None
        sim.pause(plan.overhead_s)
        # the simulator's clock runs on its own step model; odyssey's ratio carries over
        sim.degraded_step_s = sim.healthy_step_s() * plan.step_time_s / full
        sim.changed()
        self.reconfigured = plan.choice == "reconfigure"
        sim.mark(f"{plan.choice} dp={plan.dp} pp={plan.pp} ({reason})")

    def _options(self, cluster: ClusterState) -> tuple[str, ...]:
        return self.options

    def _horizon_s(self, expected_s: float) -> float:
        """How long the new layout is expected to run (odyssey: time to the next fault)."""
        return expected_s

    def on_failstop(self, host: str) -> None:
        if self.sim.scenario.profile is None:
            Policy.on_failstop(self, host)  # nothing to re-plan with: wait for the repair
            return
        self.failed.add(host)
        self._replan(f"lost {host}")

    def on_repair(self, host: str) -> None:
        if host in self.failed:
            self.failed.discard(host)
            self._replan(f"{host} repaired")
        else:
            super().on_repair(host)


class AlwaysReconfigure(Replanning):
    name = "oobleck"
    options = ("reconfigure",)


class AlwaysReroute(Replanning):
    name = "recycle"
    options = ("reroute",)

    def _options(self, cluster: ClusterState) -> tuple[str, ...]:
        if any(f >= cluster.dp for f in cluster.failures):
            return ("reconfigure",)  # a stage lost every replica: rerouting cannot continue
        return self.options


class Failslow(SkiRental, Replanning):
    """Ski-rental with in-memory restarts onto warm standbys; odyssey when none is left."""

    name = "failslow"
    in_memory = True

    def _rule(self) -> BuyRule | None:
        return None  # the Planner's default: what the controller runs

    def _layout(self, topology: Topology) -> Topology:
        return topology  # the granularity the adapter declares

    def attach(self, sim: Simulation) -> None:
        SkiRental.attach(self, sim)
        self.failed = set()
        self.reconfigured = False

    def on_failstop(self, host: str) -> None:
        sim = self.sim
        if sim.spares > 0:
            sim.replace_hosts([host], warm=True)
            sim.pause(sim.costs.restart_memory_s)
            sim.mark("restart on standby (in-memory)")
        elif sim.scenario.profile is not None:
            Replanning.on_failstop(self, host)
        else:
            sim.replace_hosts([host])
            sim.pause(sim.costs.restart_disk_s)
            sim.mark("cold restart (in-memory state kept)")

    def on_repair(self, host: str) -> None:
        Replanning.on_repair(self, host)


class Oracle(Failslow):
    """Hindsight: the best option per diagnosis, knowing when the fail-slows end (module doc)."""

    name = "oracle"

    def on_step(self, step_s: float) -> None:
        pass  # everything is decided at the diagnosis

    def on_relief(self) -> None:
        sim = self.sim
        if sim.counts != sim.even_counts:
            sim.set_counts(sim.even_counts)
            sim.mark("revert S2 micro-batches")

    def _horizon_s(self, expected_s: float) -> float:
        sim = self.sim
        upcoming = sim.upcoming("stop", "repair")
        until = upcoming if upcoming is not None else sim.scenario.duration_s
        return max(until - sim.t, 1.0)

    def _s2_under(self, layout: Topology) -> list[int]:
        """The S2 counts the planner gives for the slowdowns as ``layout`` places them."""
        sim = self.sim
        diagnosis = sim.diagnosis_under(layout)
        if diagnosis is None:
            return list(sim.even_counts)
        self.planner.topology = layout
        options = {name: plan for name, plan, _ in self.planner.ski.options(diagnosis)}
        self.planner.topology = sim.topology
        plan = options.get("S2 micro-batches")
        return list(plan.counts) if isinstance(plan, MicroBatchPlan) else list(sim.even_counts)

    def on_diagnosis(self, diagnosis: Diagnosis) -> None:
        sim = self.sim
        self.planner.topology = sim.topology
        ends = [fs.end_s for fs in sim.touching()]
        horizon = max(ends) - sim.t + sim.costs.relief_detect_s if ends else 0.0
        # (label, pause, layout, counts, evict): every option from the current state
        choices: list[tuple[str, float, Topology, list[int], list[str]]] = [
            ("keep", 0.0, sim.topology, list(sim.counts), []),
            ("even", 0.0, sim.topology, list(sim.even_counts), []),
        ]
        for name, plan, _ in self.planner.ski.options(diagnosis):
            if isinstance(plan, MicroBatchPlan):
                choices.append((name, plan.overhead_s, sim.topology, list(plan.counts), []))
            elif isinstance(plan, TopologyPlan):
                layout = sim.topology.with_hosts(plan.hosts)
                choices.append((name, plan.overhead_s, layout, list(sim.counts), []))
                choices.append(
                    (f"{name} + S2", plan.overhead_s, layout, self._s2_under(layout), [])
                )
            elif isinstance(plan, RestartPlan):
                fresh = sim.topology.with_hosts(
                    [f"oracle-probe-{h}" if h in plan.evict else h for h in sim.topology.hosts]
                )
                choices.append(
                    (name, plan.overhead_s, fresh, list(sim.even_counts), list(plan.evict))
                )

        def steps(choice: tuple[str, float, Topology, list[int], list[str]]) -> float:
            _, pause, layout, counts, _ = choice
            return max(0.0, horizon - pause) / sim.step_s_under(layout, counts)

        label, pause, layout, counts, evict = max(choices, key=steps)
        if label in ("keep", "even") and counts == sim.counts:
            return
        sim.mark(f"{label} (oracle)" if label not in ("keep", "even") else "S2 undone (oracle)")
        if evict:
            sim.pause(pause)
            sim.set_counts(counts)
            sim.replace_hosts(evict, warm=True)
            return
        if layout is not sim.topology:
            sim.pause(pause)
            sim.set_topology(layout)
        sim.set_counts(counts)


POLICIES: dict[str, type[Policy]] = {
    "none": Policy,
    "restart": AlwaysRestart,
    "greyhound": SkiRental,
    "failslow": Failslow,
    "oracle": Oracle,
    "oobleck": AlwaysReconfigure,
    "recycle": AlwaysReroute,
    "odyssey": Replanning,
}
