"""The controller's mitigation loop: diagnosis -> ski-rental planner -> plan on every rank.

greyhound 5 (multi-level mitigation, Alg. 1): once a fail-slow is diagnosed the planner buys
the cheapest strategy whose cost the accumulated slowdown has paid for, watching the job's step
times to decide whether to escalate; when the fail-slow is over it reverts what can be reverted.
:class:`Mitigator` runs that loop beside the :class:`~failslow.core.control.controller.Controller`
(which calls :meth:`on_diagnosis` and, when a re-validation finds every rank healthy while a plan
is in effect, :meth:`on_healthy`):

- the job's layout and the adapter's capabilities come from ``failslow/job`` (written once by
  rank 0's session); strategies the adapter cannot apply are never planned;
- step times come from ``failslow/steps`` (rank 0's recent steps; a synchronous job has one
  step time) - one read per tick, independent of the world size;
- S4 evicts no more hosts than the node launchers' free standby slots can replace
  (``failslow/standbys/<node>``, read when a restart is planned); after a restart the job
  registers again from its new hosts, and the next plan is made on that layout;
- each decision becomes a plan sent through :func:`~failslow.core.control.plan_channel.dispatch`
  (every rank switches at the same step, or none does); a revert of a micro-batch plan sends
  the even split.

``hooks`` (a pluggy hook relay, optional) gets ``failslow_choose_plan`` (a site policy may
replace a proposal), ``failslow_on_plan`` and ``failslow_on_plan_result``.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from failslow.core.control import job_record, keys
from failslow.core.control.journal import event
from failslow.core.control.plan_channel import PlanOutcome, PlanResult, dispatch, horizon_steps
from failslow.core.control.store import Store
from failslow.core.diagnosis.record import Diagnosis
from failslow.core.planner.allocation import even_plan
from failslow.core.planner.config import PlannerConfig
from failslow.core.planner.measured_step import MeasuredSteps, ranks_to_read
from failslow.core.planner.planner import MitigationCosts, Planner, buy_rule
from failslow.core.planner.plans import (
    MicroBatchPlan,
    Plan,
    RestartPlan,
    TopologyPlan,
    plan_to_dict,
)
from failslow.core.planner.ski_rental import Decision
from failslow.core.topology import Topology

log = logging.getLogger(__name__)

CAPABILITY_OF = {"S2": "microbatch_plans", "S3": "topology_plans", "S4": "snapshots"}


@dataclass
class Action:
    """One decision and what became of it (for the demo, the benchmark and the log)."""

    wall: float
    action: str
    strategy: str
    plan: Plan
    reason: str
    outcome: PlanOutcome | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Mitigator:
    def __init__(
        self,
        store: Store,
        config: PlannerConfig,
        *,
        world_size: int,
        hooks: Any = None,
        clock: Callable[[], float] = time.time,
        token: str | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.store = store
        self.on_event = on_event
        """Gets the new step times and every decision with its outcome (:mod:`.journal`)."""
        self.config = config
        self.world_size = world_size
        self.hooks = hooks
        self.token = token
        self._clock = clock
        self.planner: Planner | None = None
        self.topology: Topology | None = None
        self.actions: list[Action] = []
        self.step_times: dict[int, tuple[float, float]] = {}
        """step -> (seconds, wall time first seen) of every step rank 0 reported."""
        self._queue: collections.deque[tuple[str, Any]] = collections.deque()
        self._slow_ranks: frozenset[int] = frozenset()
        self._step_model: dict[str, Any] | None = None
        """Behind the newest S2 estimate (journaled with the plan): per replica [seconds per
        micro-batch, rest before the optimizer, optimizer on], and the rank profiles they came
        from."""
        self.in_effect: Plan | None = None
        """The plan every rank runs now (None: the job's own even split)."""
        self._restarted = False
        """A restart committed since the layout was read: the job re-registers from its new
        hosts (a standby took an evicted rank)."""
        self._restart_step = -1
        """The newest committed restart's step: the slow steps before it were its cost, not the
        cost of what is diagnosed after it."""
        self._lock = threading.Lock()

    # ---- inputs (called from the controller's thread) ----------------------------------------
    def on_diagnosis(self, diagnosis: Diagnosis) -> None:
        with self._lock:
            self._queue.append(("diagnosis", diagnosis))

    def on_healthy(self) -> None:
        with self._lock:
            self._queue.append(("healthy", None))

    @property
    def active(self) -> bool:
        """A fail-slow is being mitigated (the controller then re-validates periodically)."""
        return self.planner is not None and self.planner.ski.active

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool], tick_s: float = 0.1) -> None:
        while not stop():
            try:
                self.tick()
            except Exception:  # the controller side must keep running
                log.warning("failslow: mitigator tick failed", exc_info=True)
            time.sleep(tick_s)

    def tick(self) -> None:
        for seconds in self._new_step_times():
            if self.planner is not None:
                self._execute(self.planner.observe(seconds))
        while True:
            with self._lock:
                if not self._queue:
                    break
                kind, item = self._queue.popleft()
            if kind == "diagnosis":
                self._diagnosed(item)
            elif self.active:
                self._slow_ranks = frozenset()
                assert self.planner is not None
                self._execute(self.planner.relief())

    def _new_step_times(self) -> list[float]:
        record = self.store.get_json(keys.STEPS)
        if not record:
            return []
        new, fresh = [], []
        for step, seconds in record.get("steps", []):
            if int(step) not in self.step_times:
                self.step_times[int(step)] = (float(seconds), self._clock())
                if int(step) >= self._restart_step:
                    new.append(float(seconds))
                fresh.append([int(step), float(seconds)])
        if fresh and self.on_event is not None:
            self.on_event(event("steps", steps=fresh))
        return new

    def healthy_step_s(self, diagnosis: Diagnosis) -> float:
        """The step time before the fail-slow: steps seen before its first onset, else the
        onsets' own before-times (the node analyzer's iteration time before the change)."""
        onsets = diagnosis.evidence.get("onsets", []) if diagnosis.evidence else []
        started = self._onset_wall(diagnosis)
        before = [s for s, wall in self.step_times.values() if started and wall < started]
        if len(before) >= 3:
            return statistics.median(before)
        befores = [float(o["before_s"]) for o in onsets if o.get("before_s")]
        if befores:
            return statistics.median(befores)
        times = sorted(s for s, _ in self.step_times.values())
        if times:
            return times[len(times) // 4]
        raise RuntimeError("failslow: no step time known yet; cannot plan")

    @staticmethod
    def _onset_wall(diagnosis: Diagnosis) -> float | None:
        onsets = diagnosis.evidence.get("onsets", []) if diagnosis.evidence else []
        return min((float(o["wall"]) for o in onsets if "wall" in o), default=None)

    def _build_planner(self, healthy_step_s: float) -> Planner | None:
        job = self.store.get_json(keys.JOB)
        if not job:
            log.warning(
                "failslow: no job record (%s) yet: no adapter reported a topology", keys.JOB
            )
            return None
        topology = Topology.from_dict(job["topology"])
        capabilities = job.get("capabilities", {})
        allowed = [
            name
            for name in self.config.strategies
            if capabilities.get(CAPABILITY_OF[name], "undeclared") == ""
        ]
        planner_config = self.config
        self.topology = topology
        return Planner(
            topology,
            MitigationCosts(
                microbatch_apply_s=planner_config.microbatch_apply_s,
                state_bytes_per_rank=int(job.get("state_bytes_per_rank", 0)),
                transfer_bytes_per_s=planner_config.transfer_gbps * 1e9 / 8,
                pause_s=planner_config.pause_s,
                restart_s=planner_config.restart_s,
            ),
            healthy_microbatch_s=healthy_step_s * topology.dp / topology.micro_batches,
            estimate=self._measured_step,
            min_gain=planner_config.min_gain,
            strategies=allowed,
            rule=buy_rule(planner_config, topology.world_size),
            standbys=self._free_standbys,
        )

    def _free_standbys(self) -> int | None:
        """Hosts a restart can replace now: the free standby slots the node launchers publish;
        None where none publishes any (a rank then refuses a restart no launcher can make)."""
        names = self.store.keys(keys.STANDBYS + "/")
        if not names:
            return None
        return sum(int((self.store.get_json(name) or {}).get("free", 0)) for name in names)

    def _reread_layout(self) -> None:
        """After a restart: the layout the job registered from its new hosts."""
        job = self.store.get_json(keys.JOB)
        if not job or self.planner is None:
            return
        self._restarted = False
        self.topology = self.planner.topology = Topology.from_dict(job["topology"])

    def _measured_step(self, plan: Plan, layout: Topology) -> float | None:
        """An S2 plan's step time from the ranks' step profiles (:mod:`.measured_step`: the
        diagnosed ranks' progress records and one healthy replica's); None for other plans or
        where a rank published no profile (the plan's own model then stands)."""
        topology = self.topology
        if not isinstance(plan, MicroBatchPlan) or topology is None or not self._slow_ranks:
            return None
        diagnosed = sorted(self._slow_ranks)
        records = {
            r: self.store.get_json(f"{keys.VALIDATE}/progress/{r}")
            for r in ranks_to_read(topology, diagnosed)
        }
        now = self.in_effect if isinstance(self.in_effect, MicroBatchPlan) else self._even_plan()
        assert now is not None
        model = MeasuredSteps.from_records(topology, now.counts, records, diagnosed)
        if model is None:
            return None
        self._step_model = {
            "replicas": [[r.per_microbatch_s, r.rest_s, r.post_s] for r in model.replicas],
            "profiles": {str(r): (rec or {}).get("profile") for r, rec in records.items()},
        }
        return model.step_s(plan.counts)

    def _diagnosed(self, diagnosis: Diagnosis) -> None:
        # what the fail-slow is: its slow ranks, else the ends of its slow links (a re-validation
        # of a compute fail-slow may add a noisy link or two; that is not a new fail-slow)
        slow = frozenset(s.rank for s in diagnosis.slow_ranks) or frozenset(
            r for link in diagnosis.slow_links for r in (link.a, link.b)
        )
        if self.active and slow == self._slow_ranks and not self._restarted:
            return  # the same fail-slow, seen again by a re-validation: keep what is in effect
        if self._restarted:
            self._reread_layout()
        healthy = self.healthy_step_s(diagnosis)
        if self.planner is None:
            self.planner = self._build_planner(healthy)
            if self.planner is None:
                return
        self._slow_ranks = slow
        compound = self.planner.ski.active  # the event went on: it observed every step since
        self._execute(self.planner.onset(diagnosis, healthy_step_s=healthy), diagnosis)
        # the slowdown began before the diagnosis: what it cost so far counts (Alg. 1's impact)
        started = self._onset_wall(diagnosis)
        if started is not None and not compound:
            for step, (seconds, wall) in sorted(self.step_times.items()):
                if wall >= started and step >= self._restart_step:
                    self._execute(self.planner.observe(seconds), diagnosis)

    # ---- turning decisions into plans on the ranks -------------------------------------------
    def _execute(self, decisions: list[Decision], diagnosis: Diagnosis | None = None) -> None:
        for decision in decisions:
            plan = decision.plan
            if decision.action == "revert":
                if not isinstance(plan, MicroBatchPlan):
                    log.warning("failslow: cannot revert %s; left in effect", decision.strategy)
                    continue
                even = self._even_plan()
                assert even is not None  # a revert follows a plan, which needed the topology
                plan = even
            elif self.hooks is not None and diagnosis is not None:
                plan = self.hooks.failslow_choose_plan(diagnosis=diagnosis, proposed=plan) or plan
            if plan == self.in_effect or (plan == self._even_plan() and self.in_effect is None):
                continue  # already what every rank runs
            action = Action(
                self._clock(), decision.action, decision.strategy, plan, decision.reason
            )
            self.actions.append(action)
            if self.hooks is not None:
                self.hooks.failslow_on_plan(plan=plan, action=decision.action, reason=action.reason)
            action.outcome = self._dispatch(plan)
            if action.outcome.committed and isinstance(plan, RestartPlan):
                self._restarted = True  # from its snapshot: the plan in effect stays in effect
                self._restart_step = action.outcome.apply_step or self._restart_step
            elif action.outcome.committed:
                self.in_effect = None if plan == self._even_plan() else plan
                if isinstance(plan, TopologyPlan):
                    self._roles_moved(plan)
            self._journal(action)
            if self.hooks is not None:
                outcome = action.outcome
                self.hooks.failslow_on_plan_result(
                    plan=plan,
                    step=outcome.apply_step,
                    outcome=PlanResult.COMMITTED if outcome.committed else PlanResult.ABORTED,
                    detail=outcome.reason,
                )

    def _journal(self, action: Action) -> None:
        if self.on_event is None or action.outcome is None:
            return
        outcome = action.outcome
        self.on_event(
            event(
                "plan",
                action=action.action,
                strategy=action.strategy,
                plan=plan_to_dict(action.plan),
                reason=action.reason,
                apply_step=outcome.apply_step,
                committed=outcome.committed,
                detail=outcome.reason,
                in_effect=None if self.in_effect is None else plan_to_dict(self.in_effect),
                # what the S2 estimate came from (the newest, which this plan carries)
                step_model=self._step_model
                if action.action == "apply" and isinstance(action.plan, MicroBatchPlan)
                else None,
            )
        )

    def _roles_moved(self, plan: TopologyPlan) -> None:
        """After a topology swap, plan from the new placement: diagnoses keep naming processes,
        and a process now runs another role (its replica, its stage)."""
        assert self.topology is not None  # a topology plan needed it
        self.topology = self.topology.moved(self.topology.placement(plan.hosts))
        if self.planner is not None:
            self.planner.topology = self.topology

    def _even_plan(self) -> MicroBatchPlan | None:
        return even_plan(self.topology) if self.topology is not None else None

    def _dispatch(self, plan: Plan) -> PlanOutcome:
        recent = [s for _, (s, _w) in sorted(self.step_times.items())[-5:]]
        step_time = statistics.median(recent) if recent else None
        outcome = dispatch(
            self.store,
            plan,
            world_size=job_record.world_size(self.store, self.world_size),
            horizon_steps=horizon_steps(step_time, self.config.horizon_s),
            timeout_s=self.config.plan_timeout_s,
            token=self.token,
        )
        log.info("failslow: plan %d %s", outcome.epoch, outcome)
        return outcome
