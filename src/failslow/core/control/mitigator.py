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
  the even split;
- a committed plan is what the ranks were told (:attr:`Mitigator.desired`), not what they run
  (:attr:`Mitigator.in_effect`): that is set only when every rank reported running it
  (:mod:`.closed_loop`). A plan not in effect is journaled with its reason and rolled back
  (the plan confirmed before, or a topology swap's reverse), and its strategy is disabled for
  this job with that reason. A plan in effect is measured a few steps later against its
  prediction; one that saved less than half of it is re-planned once from the ranks' newer
  step profiles (S2) or reverted, and the planner judges the strategy by what it measured. One
  that paid stays watched (:meth:`~.closed_loop.ClosedLoop.drifts`): when it stops paying it is
  re-planned, kept where the profiles put the even split slower still, or reverted;
- a restart (S4) is in effect when the job registered again without the evicted hosts.

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
from failslow.core.control.closed_loop import ClosedLoop, Kept, Outcome, Watched
from failslow.core.control.journal import event
from failslow.core.control.plan_channel import PlanOutcome, PlanResult, dispatch, horizon_steps
from failslow.core.control.store import Store
from failslow.core.diagnosis.record import Diagnosis
from failslow.core.planner.allocation import even_plan
from failslow.core.planner.config import PlannerConfig
from failslow.core.planner.measured_step import MeasuredSteps, ranks_to_read
from failslow.core.planner.planner import LEVEL_NAMES, MitigationCosts, Planner, buy_rule
from failslow.core.planner.plans import (
    MicroBatchPlan,
    Plan,
    RestartPlan,
    TopologyPlan,
    plan_to_dict,
    same_change,
)
from failslow.core.planner.ski_rental import Decision
from failslow.core.planner.topology_plan import reverse_topology_plan
from failslow.core.topology import Topology

log = logging.getLogger(__name__)

CAPABILITY_OF = {"S2": "microbatch_plans", "S3": "topology_plans", "S4": "snapshots"}
REPLANS = 1
"""Re-plans from measured costs per plan that fell short, before it is reverted."""


@dataclass
class Action:
    """One decision and what became of it (for the demo, the benchmark and the log).

    ``action``: ``"apply"`` (a strategy bought), ``"replan"`` (its plan made anew from newer
    measurements), ``"revert"`` (relief, or a plan that did not pay) or ``"rollback"`` (back
    from a plan that was not in effect)."""

    wall: float
    action: str
    strategy: str
    plan: Plan
    reason: str
    outcome: PlanOutcome | None = None
    """The plan channel's: committed at a step, or aborted."""
    effect: str = ""
    """``"in effect"`` / ``"not in effect"`` once the ranks reported ("" before, or for a plan
    never committed)."""
    effect_detail: str = ""
    result: Outcome | None = None
    """Its measured step time against its prediction (plans bought or re-planned)."""
    unmeasured: str = ""
    drift: dict[str, Any] | None = None
    """Where it paid and later stopped paying: that outcome's fields, and ``then`` (replan,
    kept, revert) with ``then_reason``."""
    """Why it has no ``result``: a newer plan, or the fail-slow's end, came inside its window."""
    replans: int = 0
    before: Topology | None = None
    """The layout before a topology plan (its reverse is computed from it)."""
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
        self._healthy_s: float | None = None
        """The step before the fail-slow being mitigated (its first diagnosis's)."""
        self.in_effect: Plan | None = None
        """The plan every rank reported running (None: the job's own even split)."""
        self.desired: Plan | None = None
        """The plan the ranks were told to run last (committed; None: the even split)."""
        self.unavailable: dict[str, str] = {}
        """Strategy -> why its plan could not take effect in this job (never planned again)."""
        self.loop = ClosedLoop(
            store,
            world_size=lambda: job_record.world_size(store, world_size),
            keep_steps=config.keep_steps,
            clock=clock,
        )
        self._restart_check: tuple[Action, float] | None = None
        """A committed restart and its wall time, until the job registered again."""
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
        self._close_loop()
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
                # over: nothing left to measure a plan against
                self._not_measured(self.loop.unmeasured(), "the fail-slow ended before its window")
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
        allowed = []
        for name in self.config.strategies:
            why = capabilities.get(CAPABILITY_OF[name], "undeclared")
            if why == "":
                allowed.append(name)
            elif LEVEL_NAMES[name] not in self.unavailable:  # said once, with the adapter's reason
                self.unavailable[LEVEL_NAMES[name]] = why
                log.info("failslow: %s is unavailable in this job: %s", LEVEL_NAMES[name], why)
                if self.on_event is not None:
                    self.on_event(event("unavailable", strategy=LEVEL_NAMES[name], reason=why))
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
            measure=self._measure,
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

    def _measure(self, diagnosis: Diagnosis | None = None) -> MeasuredSteps | None:
        """The job's per-replica step model from the ranks' step profiles
        (:mod:`failslow.core.planner.measured_step`: the diagnosed ranks' progress records and
        one healthy replica's, measured under the plan every rank reported running); None
        where a rank published no profile (S2 is then sized from the GEMM)."""
        topology = self.topology
        if topology is None or not self._slow_ranks:
            return None
        diagnosed = sorted(self._slow_ranks)
        records = self._progress_records(topology, diagnosed)
        now = self.in_effect if isinstance(self.in_effect, MicroBatchPlan) else self._even_plan()
        assert now is not None
        # the healthy replica's parts from its steps before the slowdown
        model = MeasuredSteps.from_records(
            topology, now.counts, records, diagnosed, healthy_step_s=self._healthy_s
        )
        if model is None:
            return None
        self._step_model = {
            "replicas": [[r.per_microbatch_s, r.rest_s, r.post_s] for r in model.replicas],
            "profiles": {str(r): (rec or {}).get("profile") for r, rec in records.items()},
            "healthy_step_s": self._healthy_s,
            "calibrated": model.calibrated,
        }
        return model

    def _progress_records(
        self, topology: Topology, diagnosed: list[int]
    ) -> dict[int, dict[str, Any] | None]:
        """The progress records the S2 step model reads (the diagnosed ranks', one healthy
        replica's), O(diagnosed)."""
        return {
            r: self.store.get_json(f"{keys.VALIDATE}/progress/{r}")
            for r in ranks_to_read(topology, diagnosed)
        }

    def _diagnosed(self, diagnosis: Diagnosis) -> None:
        # what the fail-slow is: its slow ranks, else the ends of its slow links (a re-validation
        # of a compute fail-slow may add a noisy link or two; that is not a new fail-slow)
        slow = frozenset(s.rank for s in diagnosis.slow_ranks) or frozenset(
            r for link in diagnosis.slow_links for r in (link.a, link.b)
        )
        if self.active and slow == self._slow_ranks and not self._restarted:
            # the same fail-slow, seen again by a re-validation: keep what is in effect - but
            # where nothing was bought yet, plan again from what the ranks measure now (an
            # early diagnosis's profiles may still have held the steps before the slowdown)
            assert self.planner is not None
            if self.planner.ski.bought_nothing:
                self._execute(self.planner.reconsider(diagnosis), diagnosis)
                self._say_no_plan(diagnosis)
            return
        if self._restarted:
            self._reread_layout()
        healthy = self._healthy_s = self.healthy_step_s(diagnosis)
        if self.planner is None:
            self.planner = self._build_planner(healthy)
            if self.planner is None:
                return
        self._slow_ranks = slow
        compound = self.planner.ski.active  # the event went on: it observed every step since
        self._execute(self.planner.onset(diagnosis, healthy_step_s=healthy), diagnosis)
        self._say_no_plan(diagnosis)
        # the slowdown began before the diagnosis: what it cost so far counts (Alg. 1's impact)
        started = self._onset_wall(diagnosis)
        if started is not None and not compound:
            since = [
                seconds
                for step, (seconds, wall) in sorted(self.step_times.items())
                if wall >= started and step >= self._restart_step
            ]
            self._execute(self.planner.catch_up(since), diagnosis)

    def _say_no_plan(self, diagnosis: Diagnosis) -> None:
        """Where no level has a plan for ``diagnosis``, the journal and the log say why (else a
        user sees a diagnosis and then nothing)."""
        assert self.planner is not None
        if self.planner.ski.candidates():
            return
        reasons = self.planner.passed_over()
        log.info(
            "failslow: no plan for the diagnosis of rank(s) %s: %s",
            sorted(self._slow_ranks),
            "; ".join(f"{name}: {why}" for name, why in reasons.items()) or "no level allowed",
        )
        if self.on_event is not None:
            self.on_event(
                event("no plan", ranks=sorted(self._slow_ranks), fail_slow=diagnosis.kind.value,
                      reasons=reasons)
            )  # fmt: skip

    # ---- turning decisions into plans on the ranks -------------------------------------------
    def _execute(self, decisions: list[Decision], diagnosis: Diagnosis | None = None) -> None:
        for decision in decisions:
            plan: Plan | None = decision.plan
            if decision.action == "revert":
                plan = self._undoing(decision.plan, decision.strategy)
                if plan is None:
                    continue
            elif self.hooks is not None and diagnosis is not None:
                plan = self.hooks.failslow_choose_plan(diagnosis=diagnosis, proposed=plan) or plan
            assert plan is not None
            self._send(decision.action, decision.strategy, plan, decision.reason)

    def _undoing(self, plan: Plan, strategy: str) -> Plan | None:
        """The plan that undoes ``plan``: the even split for a micro-batch plan, the reverse
        swap for a topology plan (from the layout before it); None where nothing can (a
        restart), said in the log."""
        if isinstance(plan, MicroBatchPlan):
            return self._even_plan()
        if isinstance(plan, TopologyPlan):
            done = next((a for a in reversed(self.actions) if a.plan == plan and a.before), None)
            if done is not None and done.before is not None:
                return reverse_topology_plan(done.before, plan, reason=f"undo {strategy}")
        log.warning("failslow: cannot revert %s; left in effect", strategy)
        return None

    def _send(self, what: str, strategy: str, plan: Plan, reason: str) -> Action | None:
        """Dispatch ``plan`` as ``what`` (apply, replan, revert, rollback); None when every
        rank was told to run it already."""
        even = self._even_plan()
        if same_change(plan, self.desired if self.desired is not None else even):
            return None  # already what the ranks were told to run
        action = Action(self._clock(), what, strategy, plan, reason, before=self.topology)
        if (
            what in ("apply", "replan")
            and isinstance(plan, MicroBatchPlan)
            and self._step_model is not None
            and self._step_model.get("calibrated") is False
        ):
            action.detail["probe"] = True
            action.reason = reason = (
                f"{reason}; a probe: the size form's part per micro-batch is measured under it, "
                "then the split is sized from two measured counts"
            )
        self.actions.append(action)
        if self.hooks is not None:
            self.hooks.failslow_on_plan(plan=plan, action=what, reason=reason)
        action.outcome = outcome = self._dispatch(plan)
        if outcome.committed and outcome.apply_step is not None:
            self._not_measured(
                self.loop.unmeasured(outcome.apply_step),
                f"{what} {strategy} took effect at step {outcome.apply_step}, before its window",
            )
        if outcome.committed and isinstance(plan, RestartPlan):
            self._restarted = True  # from its snapshot: the plan in effect stays in effect
            self._restart_step = outcome.apply_step or self._restart_step
            self._restart_check = (action, self._clock())
        elif outcome.committed:
            assert outcome.apply_step is not None
            self.desired = None if same_change(plan, even) else plan
            self.loop.committed(action, outcome.epoch, outcome.apply_step)
            if isinstance(plan, TopologyPlan):
                self._roles_moved(plan)
        elif what in ("apply", "replan") and self.planner is not None:
            self.planner.ski.dropped(strategy)  # no rank changed anything
        self._journal(action)
        if outcome.refused and what in ("apply", "replan") and self.planner is not None:
            # a rank's prepare said this job cannot run it (capability, loader, counts): do
            # not pause the job for it again
            self._disable(strategy, f"refused: {outcome.reason}")
        if self.hooks is not None:
            self.hooks.failslow_on_plan_result(
                plan=plan,
                step=outcome.apply_step,
                outcome=PlanResult.COMMITTED if outcome.committed else PlanResult.ABORTED,
                detail=outcome.reason,
            )
        return action

    # ---- the closed loop: effect, then outcome -----------------------------------------------
    def _close_loop(self) -> None:
        for awaited, state, why in self.loop.effects(self.step_times):
            self._effect(awaited.action, state, why)
        for watched, outcome in self.loop.outcomes(self.step_times):
            if self._outcome(watched.action, outcome):
                self.loop.keep(watched, outcome)
        for kept, outcome in self.loop.drifts(self.step_times):
            self._drifted(kept, outcome)
        if self._restart_check is not None:
            self._check_restart(*self._restart_check)

    def _effect(self, action: Action, state: str, why: str) -> None:
        """Every rank reported on ``action``'s plan: ``state`` is in effect or not."""
        action.effect, action.effect_detail = state, why
        assert action.outcome is not None and action.outcome.apply_step is not None
        step = action.outcome.apply_step
        if state == PlanResult.IN_EFFECT:
            told = self.desired if self.desired is not None else self._even_plan()
            if same_change(action.plan, told):
                self.in_effect = self.desired
            log.info("failslow: plan %d (%s) in effect from step %d", action.outcome.epoch,
                     action.strategy, step)  # fmt: skip
        else:
            log.warning("failslow: plan %d (%s, %s at step %d) not in effect: %s",
                        action.outcome.epoch, action.strategy, action.action, step,
                        why)  # fmt: skip
        self._journal_effect(action)
        if self.hooks is not None:
            self.hooks.failslow_on_plan_result(
                plan=action.plan, step=step, outcome=state, detail=why
            )
        if state != PlanResult.IN_EFFECT:
            self._roll_back(action, why)
        elif action.action in ("apply", "replan") and self.active:
            self.loop.watch(action, step, self.step_times, before_s=action.detail.get("before_s"))
            newer = [
                a.outcome.apply_step for a in self.actions
                if a is not action and a.outcome is not None and a.outcome.committed
                and a.outcome.apply_step is not None and a.outcome.apply_step > step
            ]  # fmt: skip
            if newer:  # replaced before its effect was known
                self._not_measured(
                    self.loop.unmeasured(min(newer)),
                    f"a newer plan took effect at step {min(newer)}, before its window",
                )

    def _roll_back(self, action: Action, why: str) -> None:
        """Back from ``action``'s plan, which some rank did not run: to the plan every rank
        ran before (the even split if none; a swap's reverse); its strategy is disabled."""
        if action.action == "rollback":
            log.error(
                "failslow: the rollback from %s is not in effect either (%s); what the ranks "
                "run is not known - no further plan is sent for it", action.strategy, why,
            )  # fmt: skip
            return
        if action.action in ("apply", "replan") and self.planner is not None:
            self._disable(action.strategy, why)
        told = self.desired if self.desired is not None else self._even_plan()
        if not same_change(action.plan, told):
            return  # a newer plan was sent since; its own report decides
        if isinstance(action.plan, TopologyPlan) and action.before is not None:
            back: Plan | None = reverse_topology_plan(
                action.before, action.plan, reason="roll back: not in effect"
            )
        else:
            back = self.in_effect if self.in_effect is not None else self._even_plan()
        if back is not None:
            self._send("rollback", action.strategy, back, f"not in effect: {why}")

    def _disable(self, strategy: str, why: str) -> None:
        assert self.planner is not None
        self.planner.ski.disable(strategy, why)
        if self.unavailable.get(strategy) == why:
            return
        self.unavailable[strategy] = why
        if self.on_event is not None:
            self.on_event(event("unavailable", strategy=strategy, reason=why))

    def _not_measured(self, gone: list[Watched], why: str) -> None:
        """The plans in ``gone`` stopped being watched before their window was complete: the
        journal says so, with ``why``, rather than leave them without a word (no measurement,
        so the planner learns nothing from them)."""
        for watched in gone:
            action = watched.action
            action.unmeasured = why
            log.info("failslow: %s outcome not measured: %s", action.strategy, why)
            if self.on_event is not None:
                self.on_event(
                    event("outcome", action=action.action, strategy=action.strategy,
                          plan=plan_to_dict(action.plan), apply_step=watched.apply_step,
                          before_s=watched.before_s, predicted_s=watched.predicted_s,
                          measured_s=None, verdict="not measured", reason=why)
                )  # fmt: skip

    def _outcome(self, action: Action, outcome: Outcome) -> bool:
        """``action``'s plan measured ``outcome`` while in effect: keep it, re-plan it from the
        ranks' newer profiles, or revert it; the planner judges its strategy by it from now.
        True where it paid and stays in effect (the closed loop keeps watching it)."""
        action.result = outcome
        if self.on_event is not None:
            # what the ranks measured under the plan, beside what it was sized from (the plan
            # event's step_model): where a prediction erred, the part that moved
            measured = None
            if isinstance(action.plan, MicroBatchPlan) and self.topology and self._slow_ranks:
                records = self._progress_records(self.topology, sorted(self._slow_ranks))
                measured = {str(r): (rec or {}).get("profile") for r, rec in records.items()}
            self.on_event(
                event("outcome", action=action.action, strategy=action.strategy,
                      plan=plan_to_dict(action.plan), profiles=measured, **outcome.to_dict())
            )  # fmt: skip
        log.info("failslow: %s outcome: %s", action.strategy, outcome.reason)
        if self.planner is None or not self.active:
            return False
        if not same_change(action.plan, self.in_effect):
            return False  # replaced since: its outcome is a record only
        self.planner.ski.measured(action.strategy, outcome.measured_s)
        bought_nothing = outcome.before_s is not None and outcome.measured_s >= (
            outcome.before_s * (1.0 - self.config.min_gain)
        )
        if isinstance(action.plan, TopologyPlan):
            if bought_nothing:  # a swap is not re-planned: back to the placement before it
                self._revert(action, outcome)
                return False
            return outcome.verdict == "pays"
        if not isinstance(action.plan, MicroBatchPlan):
            return False
        if outcome.verdict == "unknown" and bought_nothing:  # no prediction, and no faster
            self._revert(action, outcome)
            return False
        if outcome.verdict != "short":
            if action.detail.get("probe") and action.replans < REPLANS:
                # what it measured sizes the split; kept where that split is this one
                replan = self._replan(action, outcome)
                if replan is not None:
                    replan.replans = action.replans + 1
                    return False
            return outcome.verdict == "pays"
        if action.replans < REPLANS:
            replan = self._replan(action, outcome)
            if replan is not None and replan.outcome is not None and replan.outcome.committed:
                replan.replans = action.replans + 1
                return False  # else: the ranks still run the plan that fell short - revert it
        self._revert(action, outcome)
        return False

    def _drifted(self, kept: Kept, outcome: Outcome) -> None:
        """``kept``'s plan paid at its verdict and has since stopped paying (a load arrived, the
        fault changed): re-plan it from the profiles the ranks measure now; where that gives
        nothing new, keep it if those profiles put the even split slower still (the fault grew:
        the plan saves less than it promised against a before-time that is out of date), else
        revert it. The journal's ``drift`` event says what was measured and what was done."""
        action = kept.action
        then, why = "none", "no longer the plan in effect"
        if self.planner is not None and self.active and same_change(action.plan, self.in_effect):
            self.planner.ski.measured(action.strategy, outcome.measured_s)
            then, why = self._after_drift(kept, outcome)
        log.warning("failslow: %s stopped paying: %s; %s: %s", action.strategy, outcome.reason,
                    then, why)  # fmt: skip
        action.drift = {**outcome.to_dict(), "then": then, "then_reason": why}
        if self.on_event is not None:
            self.on_event(
                event("drift", action=action.action, strategy=action.strategy,
                      plan=plan_to_dict(action.plan), then=then, then_reason=why,
                      **outcome.to_dict())
            )  # fmt: skip

    def _after_drift(self, kept: Kept, outcome: Outcome) -> tuple[str, str]:
        """What :meth:`_drifted` does: ``(replan | kept | revert, why)``."""
        action = kept.action
        if isinstance(action.plan, MicroBatchPlan) and action.replans <= REPLANS:
            replan = self._replan(action, outcome)
            if replan is not None and replan.outcome is not None and replan.outcome.committed:
                replan.replans = action.replans + 1
                return "replan", f"re-planned from measured step profiles: {replan.plan}"
        even = self._even_plan()
        model = self._measure() if isinstance(action.plan, MicroBatchPlan) else None
        if model is not None and even is not None:
            assert isinstance(action.plan, MicroBatchPlan)
            even_s, plan_s = model.step_s(even.counts), model.step_s(action.plan.counts)
            if even_s > outcome.measured_s * (1.0 + self.config.min_gain):
                # judged from now on against the even split the profiles predict
                self.loop.keep(
                    Watched(action, kept.apply_step, even_s, plan_s),
                    Outcome(kept.apply_step, even_s, plan_s, outcome.measured_s, "pays", ""),
                )
                return "kept", (
                    f"the ranks' step profiles now put the even split at {even_s:.3f} s per "
                    f"step, slower than the {outcome.measured_s:.3f} s measured under the plan"
                )
        before = outcome.before_s
        if (
            isinstance(action.plan, TopologyPlan)
            and before is not None
            and (outcome.measured_s < before * (1.0 - self.config.min_gain))
        ):
            self.loop.keep(
                Watched(action, kept.apply_step, before, outcome.measured_s),
                Outcome(kept.apply_step, before, outcome.measured_s, outcome.measured_s, "", ""),
            )  # judged from now on by what it measures now
            return "kept", "still faster than before the swap; a swap back costs a pause"
        self._revert(action, outcome)
        return "revert", f"did not pay: {outcome.reason}"

    def _revert(self, action: Action, outcome: Outcome) -> None:
        """``action``'s plan did not pay what it measured: undo it (the even split; a swap's
        reverse), and the planner does not buy its strategy again for this fail-slow."""
        assert self.planner is not None
        self.planner.ski.dropped(action.strategy)
        back = self._undoing(action.plan, action.strategy)
        if back is not None:
            self._send("revert", action.strategy, back, f"did not pay: {outcome.reason}")

    def _replan(self, action: Action, outcome: Outcome) -> Action | None:
        """``action``'s strategy planned again from the ranks' newer step profiles, sent when
        it differs, is not the even split and predicts a gain on what was measured."""
        assert self.planner is not None
        decision = self.planner.ski.rebuild(
            action.strategy, f"re-planned from measured step profiles: {outcome.reason}"
        )
        if decision is None or same_change(decision.plan, self._even_plan()):
            return None
        predicted = decision.plan.step_time_s
        if predicted is None or predicted >= outcome.measured_s * (1.0 - self.config.min_gain):
            return None
        replan = self._send("replan", decision.strategy, decision.plan, decision.reason)
        if replan is not None:  # judged against the job before the strategy, as its first plan
            replan.detail["before_s"] = outcome.before_s
        return replan

    def _check_restart(self, action: Action, committed_wall: float) -> None:
        """A restart is in effect when the job registered again (a job record written after
        the commit) on hosts without the evicted ones."""
        plan = action.plan
        assert isinstance(plan, RestartPlan)
        job = self.store.get_json(keys.JOB) or {}
        if float(job.get("started", 0.0)) <= committed_wall:
            if self._clock() - committed_wall < self.config.restart_s + self.config.plan_timeout_s:
                return
            state = PlanResult.NOT_IN_EFFECT
            why = (
                "the job did not register again within "
                f"{self.config.restart_s + self.config.plan_timeout_s:g} s"
            )
        else:
            hosts = set(Topology.from_dict(job["topology"]).hosts)
            kept = sorted(set(plan.evict) & hosts)
            state = PlanResult.NOT_IN_EFFECT if kept else PlanResult.IN_EFFECT
            why = f"the job came back on evicted host(s) {', '.join(kept)}" if kept else ""
        self._restart_check = None
        action.effect, action.effect_detail = state, why
        self._journal_effect(action)
        if self.hooks is not None:
            self.hooks.failslow_on_plan_result(
                plan=plan, step=action.outcome.apply_step if action.outcome else None,
                outcome=state, detail=why,
            )  # fmt: skip
        if state != PlanResult.IN_EFFECT:
            log.warning("failslow: restart not in effect: %s", why)
            if self.planner is not None:
                self._disable(action.strategy, why)
        else:
            self._reread_layout()  # plan from the hosts the job runs on now
            if action.outcome is not None and action.outcome.apply_step is not None:
                self.loop.watch(action, action.outcome.apply_step, self.step_times)

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
                epoch=outcome.epoch,
                apply_step=outcome.apply_step,
                committed=outcome.committed,
                detail=outcome.reason,
                in_effect=None if self.in_effect is None else plan_to_dict(self.in_effect),
                desired=None if self.desired is None else plan_to_dict(self.desired),
                # what the S2 estimate came from (the newest, which this plan carries)
                step_model=self._step_model
                if action.action in ("apply", "replan") and isinstance(action.plan, MicroBatchPlan)
                else None,
            )
        )

    def _journal_effect(self, action: Action) -> None:
        if self.on_event is None or action.outcome is None:
            return
        self.on_event(
            event(
                "effect",
                action=action.action,
                strategy=action.strategy,
                plan=plan_to_dict(action.plan),
                epoch=action.outcome.epoch,
                apply_step=action.outcome.apply_step,
                state=action.effect,
                detail=action.effect_detail,
                in_effect=None if self.in_effect is None else plan_to_dict(self.in_effect),
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
