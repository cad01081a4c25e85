"""The rank runtime every adapter drives (DESIGN.md: adapters translate, core decides).

One :class:`Session` per training process. An adapter registers itself as a plugin (its
``@failslow.hookimpl`` methods report the topology and apply plans), calls :meth:`Session.start`
once the process group exists, :meth:`Session.step_boundary` at the start of every global
step, :meth:`Session.micro_batch` before each training micro-batch and
:meth:`Session.before_optimizer_step` before the optimizer step - that is all an adapter does.
The session is the lifecycle and the step boundary; the concerns behind it each have their
module:

- capture (greyhound 4.2) and, with a control store configured, the rank's control agent that
  pauses for validation (greyhound 4.3; :mod:`.rank_control`);
- rank 0's job record and recent step times for the controller (:mod:`.job_report`);
- the rank's step profile (time per micro-batch, the rest, the optimizer part), published with
  its agent's progress record for the planner's S2 estimate (:mod:`.step_profile`);
- plans received over the plan channel (:mod:`failslow.core.control.plan_channel`) and applied
  at the step boundary every rank agreed on, all ranks or none (:mod:`.plan_application`); at
  the next boundary, what the rank ran in that step is checked against the plan and the
  verdict goes back to the controller (the receiver's thread sends it), which calls a plan
  in effect only when every rank ran it;
- in-memory snapshots, backups on peers and resume (byterobust 6.3; :mod:`.snapshot_service`),
  and the stop for a hot update (byterobust 6.1; :meth:`Session._stop_for_update`).

Per step the session does O(1) local work: no store access, no collective (except the one
all-reduce on the step a plan takes effect). It owns every thread it starts (plan receiver, job
report, snapshot and backup threads, the rank agent it attached) and stops them in
:meth:`Session.close`.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from failslow import envvars
from failslow import plugins as _plugins
from failslow.capabilities import Capabilities, Unsupported
from failslow.config import FailslowConfig, load_config
from failslow.core.control.plan_channel import PlanResult
from failslow.core.control.stop import (
    EXIT_EVICTED,
    EXIT_FOR_RESTART,
    EXIT_FOR_UPDATE,
    StopForUpdate,
)
from failslow.core.planner.allocation import even_plan
from failslow.core.planner.plans import MicroBatchPlan, Plan, RestartPlan, TopologyPlan
from failslow.core.topology import Topology, host_name
from failslow.runtime import rank_control, teardown
from failslow.runtime.agreement import all_ranks_ok
from failslow.runtime.metric_watch import MetricWatch
from failslow.runtime.plan_application import PlanApplication
from failslow.runtime.snapshot_service import SnapshotService
from failslow.runtime.step_profile import StepProfile

log = logging.getLogger(__name__)

_current: list[Session] = []
"""The sessions started in this process and not closed yet, the newest last."""


def current() -> Session | None:
    """The newest session started in this process and not closed (None: none)."""
    return _current[-1] if _current else None


class Session:
    def __init__(
        self,
        config: FailslowConfig | Mapping[str, Any] | None = None,
        *,
        source: str = "failslow config",
        plugins: Iterable[Any] = (),
    ) -> None:
        if not isinstance(config, FailslowConfig):
            config = load_config(config, source=source)
        self.config = config
        self.pm = _plugins.plugin_manager(plugins)
        self.rank = 0
        self.world_size = 1
        self.store: Any = None
        self.receiver: Any = None
        self.step = -1
        """The last step boundary passed (-1 before the first)."""
        self.first_step: int | None = None
        """The first step boundary this process passed (a resumed one starts past 0)."""
        self.step_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)
        self.profile = StepProfile()
        """Time per micro-batch and the rest of the step (the adapters call
        :meth:`micro_batch`); published with the rank agent's progress record."""
        self._units: tuple[Plan | None, int | None] | None = None
        """(plan in effect, this rank's replica's count under it), kept until the plan changes."""
        self.plans = PlanApplication(
            self.pm.hook,
            rank=0,
            capabilities=lambda: self.capabilities,
            even_plan=lambda: even_plan(self.topology),
            all_ranks_ok=self._all_ranks_ok,
            topology=lambda: self.topology,
        )
        self._epoch_of: dict[int, int] = {}
        """The plan channel's epoch of the plan applied at a step (reported when checked)."""
        self.snapshot_service: SnapshotService | None = None
        self._job_report: Any = None
        self._last_boundary: float | None = None
        self._outcomes_seen = 0
        self.started = False
        self._started_wall = time.time()
        self.metric_watch = MetricWatch(config.checks, can_roll_back=self._can_roll_back)
        """``failslow.report_metrics`` of this rank (byterobust 4.1)."""

    # ---- lifecycle ---------------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> None:
        _plugins.register(self.pm, plugin, name)

    def start(self) -> Session:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.plans.rank = self.rank
        self.metric_watch.rank = self.rank
        if self.config.enabled:
            if self.config.checkpoint.every_steps:
                # resume first: a smaller world's restore changes the topology the job reports
                self.snapshot_service = SnapshotService(
                    self.config.checkpoint,
                    self.pm.hook,
                    rank=self.rank,
                    world_size=self.world_size,
                    topology=lambda: self.topology,
                    capabilities=lambda: self.capabilities,
                    wait_timeout_s=self.config.planner.plan_timeout_s,
                    profile=self.profile_summary,
                    metrics=(self.metric_watch.check.history, self.metric_watch.check.load),
                ).start()
            self._start_capture_and_store()
        self.pm.hook.failslow_session_start(
            config=self.config, rank=self.rank, world_size=self.world_size
        )
        self.started = True
        _current.append(self)
        teardown.install()
        teardown.track(self)  # closed at exit if the script does not close it
        return self

    def _start_capture_and_store(self) -> None:
        capture = self._install_capture() if self.config.capture else None
        if not self.config.store:
            return
        from failslow.core.control.plan_channel import PlanReceiver
        from failslow.core.control.resilient import ResilientStore
        from failslow.runtime.job_report import JobReport

        self.store = ResilientStore(self.config.store)
        if capture is not None and rank_control.current() is None:
            rank_control.attach(capture, self.store, token=self.config.job_token)
        rank_control.follow_steps(lambda: self.step, profile=self.profile_summary)
        if self.rank == 0:
            self._job_report = JobReport(self.store, self.job_record(), self.step_times).start()
        self.receiver = PlanReceiver(
            self.store,
            rank=self.rank,
            prepare=self.prepare,
            step=lambda: self.step,
            decision_timeout_s=self.config.planner.plan_timeout_s,
            token=self.config.job_token,
        ).start()

    def _install_capture(self) -> Any:
        """The collective hook into ``$FAILSLOW_RING_DIR`` (``failslow run`` sets it), else
        ``<log_dir>/rings``; with neither, capture stays off (one warning)."""
        from failslow import nccl_hook

        ring_dir = os.environ.get(envvars.RING_DIR)
        if not ring_dir and self.config.log_dir:
            ring_dir = os.path.join(self.config.log_dir, "rings")
            os.makedirs(ring_dir, exist_ok=True)
        if not ring_dir and nccl_hook.current() is None:
            log.warning(
                "failslow: capture off - no ring directory (run under `failslow run`, set "
                "$%s or the log_dir setting)",
                envvars.RING_DIR,
            )
            return None
        return nccl_hook.install(ring_dir)

    def close(self) -> None:
        """Stop everything the session started; no control thread outlives it (nothing is
        inside a store call at interpreter exit)."""
        if self in _current:
            _current.remove(self)
        if self.snapshot_service is not None:
            self.snapshot_service.close()
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None
        if self._job_report is not None:
            self._job_report.stop()
            self._job_report = None
        rank_control.detach()  # also an agent the environment attached: it used this trap
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.started:
            self.pm.hook.failslow_session_end(rank=self.rank)
            self.started = False

    # ---- what the adapter reports ------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        topology = self.pm.hook.failslow_report_topology()
        if topology is None:
            raise RuntimeError("failslow: no plugin reports the topology (no adapter registered)")
        return topology

    @property
    def capabilities(self) -> Capabilities:
        caps = self.pm.hook.failslow_capabilities()
        if caps is None:
            reason = "no adapter registered"
            return Capabilities(
                microbatch_plans=reason, topology_plans=reason, snapshots=reason, hot_update=reason
            )
        return caps

    def capabilities_changed(self) -> None:
        """An adapter found that it can do less than it declared (a training loop that decides
        what a plan needs itself): rank 0 publishes the job record again, so the controller
        plans from, and reports, the new reason."""
        if self._job_report is not None:
            self._job_report.publish_job(self.job_record())

    def job_record(self) -> dict[str, Any]:
        """What rank 0 publishes: the layout, the adapter's capabilities, the world size and
        when this launch started (a restart is in effect once a later launch registered)."""
        return {
            "topology": self.topology.to_dict(),
            "capabilities": self.capabilities.to_dict(),
            "world_size": self.world_size,
            "started": self._started_wall,
        }

    # ---- snapshots ---------------------------------------------------------------------------
    @property
    def snapshots(self) -> Any:
        """The rank's :class:`~failslow.core.checkpoint.snapshot.Snapshotter` (checkpoint on)."""
        service = self.snapshot_service
        return service.snapshots if service is not None else None

    @property
    def resumed_step(self) -> int | None:
        """The step this process resumed at from a snapshot (None: a fresh start)."""
        service = self.snapshot_service
        return service.resumed_step if service is not None else None

    def profile_summary(self) -> dict[str, Any] | None:
        """The step profile's summary with the S2 form (``by_size``: the samples per count
        unit, None in the count form), as the rank's progress record publishes it."""
        summary = self.profile.summary()
        if summary is not None:
            summary["by_size"] = self.pm.hook.failslow_microbatch_unit()
        return summary

    def _replica_units(self) -> int | None:
        """The count this rank's DP replica ran in the step that just ended (the plan in
        effect's, else the even split's): micro-batches, or units of samples in the size form.
        Asked of the adapter once per plan; None where it reports no topology."""
        plan = self.plans.current
        if self._units is None or self._units[0] is not plan:
            try:
                topology = self.topology
                replica = topology.replica_of(self.rank)
                units = (
                    plan.counts[replica]
                    if isinstance(plan, MicroBatchPlan)
                    else topology.micro_batches // topology.dp
                )
            except (RuntimeError, LookupError, ValueError):  # no adapter yet, or no such rank
                units = None
            self._units = (plan, units)
        return self._units[1]

    def before_optimizer_step(self) -> None:
        """The adapter calls this right before the optimizer mutates the state: the pending
        snapshot's copy must be complete (byterobust 6.3); the step profile splits the step
        here."""
        self.profile.optimizer_step()
        if self.snapshot_service is not None:
            self.snapshot_service.before_optimizer_step()

    # ---- plans -------------------------------------------------------------------------------
    @property
    def current(self) -> Plan | None:
        """The plan in effect (None: the framework's own even split)."""
        return self.plans.current

    def prepare(self, plan: Plan) -> None:
        """Check ``plan`` on this rank without changing anything; raise if it cannot apply."""
        if isinstance(plan, StopForUpdate):
            self.capabilities.require("hot_update")
            if self.snapshot_service is None:
                raise Unsupported("hot_update", "needs snapshots (checkpoint.every_steps >= 1)")
            return
        if isinstance(plan, RestartPlan):
            self.capabilities.require("snapshots")
            if self.snapshot_service is None:
                raise Unsupported("restart", "needs snapshots (checkpoint.every_steps >= 1)")
            if not os.environ.get(envvars.SLOT):
                raise Unsupported(
                    "restart", "needs a node launcher that restarts ranks: failslow run "
                    "--nproc-per-node N --standbys S"
                )  # fmt: skip
            return
        self.plans.prepare(plan)

    def schedule(self, plan: Plan, step: int) -> None:
        """Apply ``plan`` at step boundary ``step``; every rank must call this with the same
        arguments (tests, offline use). Checks the plan at once."""
        self.plans.schedule(plan, step, now=self.step)

    def plans_for_data(self, step: int) -> list[tuple[int, Plan]]:
        """Before the data loading reads global step ``step`` (a loader may read ahead of
        training): every plan decided to take effect at ``step`` or earlier that has not taken
        effect yet, as ``(apply_step, plan)`` in step order - scheduled ones and the one the
        plan channel committed (waiting for its decision where it could be due)."""
        found = self.plans.scheduled_until(step)
        if self.receiver is not None:
            found += self.receiver.before_data(step)
        return sorted(found, key=lambda item: item[0])

    def step_boundary(self, step: int) -> None:
        """The adapter is about to start global step ``step``: apply what is due here."""
        now = time.perf_counter()
        if self._last_boundary is not None and self.step >= 0:
            elapsed = now - self._last_boundary
            self.step_times.append((self.step, elapsed))
            self.pm.hook.failslow_on_step(step=self.step, step_time_s=elapsed)
            if self.snapshot_service is not None and self.snapshot_service.resized:
                self.snapshot_service.measured(self.step_times)
        if self.first_step is None:
            self.first_step = step
        rank_control.at_step(step)  # a validation pause here is in no step's time
        self._last_boundary = time.perf_counter()
        self.profile.boundary(now, self._last_boundary, units=self._replica_units())
        self.step = step
        checked = self.plans.check(step, self.profile.last_calls)  # before a new plan applies
        if checked is not None:
            self._report_effect(checked[0].step, checked[1])
        plan = self.plans.scheduled(step)
        if self.receiver is not None:
            due = self.receiver.due(step)
            if due is not None:
                plan = due
                self._epoch_of[step] = self.receiver.due_epoch  # type: ignore[assignment]
            self._report_outcomes()
        if isinstance(plan, StopForUpdate):
            self._stop_for_update(plan, step)
        elif isinstance(plan, RestartPlan):
            self._stop_for_restart(plan, step)
        elif plan is not None:
            applied = self.plans.apply(plan, step)
            if not applied:
                self._report_effect(step, f"rolled back at step {step}: {self.plans.rolled_back}")
            elif isinstance(plan, TopologyPlan) and self._job_report is not None:
                self._job_report.publish_job(self.job_record())  # roles moved: a new layout
        service = self.snapshot_service
        if service is not None and service.due(step):
            service.snapshot(step)

    def _report_effect(self, step: int, reason: str) -> None:
        """Tell the controller what this rank ran at the plan of ``step`` ("": the plan); a
        plan scheduled on the rank itself (tests, offline use) has no one to tell."""
        epoch = self._epoch_of.pop(step, None)
        if epoch is not None and self.receiver is not None:
            self.receiver.report_effect(epoch, reason)

    def micro_batch(self) -> None:
        """The adapter is about to run a training micro-batch (one forward call of it):
        O(1), it only stamps the time (:class:`~failslow.runtime.step_profile.StepProfile`)."""
        self.profile.micro_batch()

    def micro_batch_end(self) -> None:
        """The adapter's micro-batch finished its own work (its backward), before any wait for
        other ranks: O(1) (:meth:`~failslow.runtime.step_profile.StepProfile.micro_batch_end`,
        for loops that meet the other ranks at every micro-batch)."""
        self.profile.micro_batch_end()

    def _stop_for_update(self, plan: StopForUpdate, step: int) -> None:
        """Commit a snapshot of this step on every rank, then exit for the node agent to
        restart this process in place with the update (byterobust 6.1)."""
        self._commit_everywhere(step)
        self.pm.hook.failslow_hot_update(code={"update_id": plan.update_id}, step=step)
        self.pm.hook.failslow_on_plan_result(
            plan=plan, step=step, outcome=PlanResult.APPLIED, detail="stopping for the update"
        )
        log.warning(
            "failslow: rank %d stops at step %d for update %d", self.rank, step, plan.update_id
        )
        self._exit(EXIT_FOR_UPDATE)

    def _stop_for_restart(self, plan: RestartPlan, step: int) -> None:
        """S4 (greyhound 5.2): commit a snapshot of this step on every rank, then exit for the
        node launcher to restart every rank from memory - this one on a standby slot when its
        host is evicted (byterobust 6.2)."""
        evicted = host_name() in plan.evict
        self._commit_everywhere(step)
        detail = "evicted: restarting on a standby" if evicted else "restarting from memory"
        self.pm.hook.failslow_on_plan_result(
            plan=plan, step=step, outcome=PlanResult.APPLIED, detail=detail
        )
        log.warning("failslow: rank %d stops at step %d for S4 (%s)", self.rank, step, detail)
        self._exit(EXIT_EVICTED if evicted else EXIT_FOR_RESTART)

    def _commit_everywhere(self, step: int) -> None:
        import torch.distributed as dist

        assert self.snapshot_service is not None  # prepare refused the stop otherwise
        self.snapshot_service.commit(step)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's snapshot is committed before any process goes

    def _exit(self, status: int) -> None:
        self.close()
        # no interpreter teardown: framework threads blocked in collectives can abort it, and
        # everything that must survive is in the committed snapshot
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def _can_roll_back(self) -> bool:
        """Whether a metric incident can roll the job back: snapshots kept in node memory,
        which the relaunched ranks resume from (``failslow run`` sets the directory)."""
        service = self.snapshot_service
        return service is not None and service.directory is not None

    def _all_ranks_ok(self, ok: bool) -> bool:
        return all_ranks_ok(ok, self.world_size)

    def _report_outcomes(self) -> None:
        outcomes = self.receiver.outcomes
        while self._outcomes_seen < len(outcomes):
            _, plan, step, reason = outcomes[self._outcomes_seen]
            self._outcomes_seen += 1
            if step is None:
                self.pm.hook.failslow_on_plan_result(
                    plan=plan, step=None, outcome=PlanResult.ABORTED, detail=reason
                )
