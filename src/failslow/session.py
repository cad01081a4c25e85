"""The rank-side runtime every adapter drives (DESIGN.md: adapters translate, core decides).

One :class:`Session` per training process. An adapter registers itself as a plugin (its
``@failslow.hookimpl`` methods report the topology and apply plans), calls :meth:`Session.start`
once the process group exists, and :meth:`Session.step_boundary` at the start of every global
step - that is all an adapter does. The session

- installs the collective hook (capture, greyhound 4.2) and, with a control store configured,
  the rank agent that pauses for validation (greyhound 4.3);
- publishes the job's topology and capabilities once (rank 0, ``failslow/job``) and the recent
  step times (rank 0, ``failslow/steps``; the controller's ski-rental observes them);
- receives plans (:mod:`failslow.core.control.plan_channel`) and applies each at the step
  boundary every rank agreed on, then confirms with one all-reduce that every rank switched;
  if any rank failed, all of them go back to the previous plan (nothing half-applied).

Per step the session does O(1) local work: no store access, no collective (except the one
all-reduce on the step a plan takes effect).
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from failslow import plugins as _plugins
from failslow.capabilities import Capabilities, Unsupported
from failslow.config import FailslowConfig, load_config
from failslow.core.planner.plans import (
    EXIT_FOR_UPDATE,
    MicroBatchPlan,
    Plan,
    StopForUpdate,
    TopologyPlan,
)
from failslow.core.topology import Topology

log = logging.getLogger(__name__)

JOB_KEY = "failslow/job"
STEPS_KEY = "failslow/steps"

_KINDS: dict[type, tuple[str, str]] = {
    MicroBatchPlan: ("microbatch_plans", "microbatch_plan"),
    TopologyPlan: ("topology_plans", "topology_plan"),
    StopForUpdate: ("hot_update", ""),
}
SNAPSHOT_DIR_ENV = "FAILSLOW_SNAPSHOT_DIR"


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
        self.current: Plan | None = None
        """The plan in effect (None: the framework's own even split)."""
        self.step_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)
        self._scheduled: dict[int, Plan] = {}
        self._last_boundary: float | None = None
        self._outcomes_seen = 0
        self._stop = threading.Event()
        self._publisher: threading.Thread | None = None
        self.started = False
        self.snapshots: Any = None
        """The rank's :class:`~failslow.core.checkpoint.snapshot.Snapshotter` (checkpoint on)."""
        self.backup: Any = None
        self._holders: tuple[int, ...] | None = None
        self.snapshot_dir: Any = None
        self.last_snapshot: int | None = None
        self.resumed_step: int | None = None
        """The step this process resumed at from a snapshot (None: a fresh start)."""

    # ---- lifecycle ---------------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> None:
        _plugins.register(self.pm, plugin, name)

    def start(self) -> Session:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.config.enabled:
            self._start_capture_and_store()
            if self.config.checkpoint.every_steps:
                self._start_snapshots()
        self.pm.hook.failslow_session_start(
            config=self.config, rank=self.rank, world_size=self.world_size
        )
        self.started = True
        return self

    def _start_capture_and_store(self) -> None:
        capture = None
        if self.config.capture:
            capture = self._install_capture()
        if not self.config.store:
            return
        from failslow.core.control.plan_channel import PlanReceiver
        from failslow.core.control.resilient import ResilientStore

        self.store = ResilientStore(self.config.store)
        if capture is not None and capture.agent is None:
            capture.attach_agent(self.store)
        if self.rank == 0:
            self._job = self.job_record()
            self._publisher = threading.Thread(
                target=self._publish_steps, name="failslow-steps", daemon=True
            )
            self._publisher.start()
        self.receiver = PlanReceiver(
            self.store,
            rank=self.rank,
            prepare=self.prepare,
            step=lambda: self.step,
            decision_timeout_s=self.config.planner.plan_timeout_s,
        ).start()

    def _install_capture(self) -> Any:
        """The collective hook into ``$FAILSLOW_RING_DIR`` (``failslow run`` sets it), else
        ``<log_dir>/rings``; with neither, capture stays off (one warning)."""

        from failslow import nccl_hook
        from failslow.nccl_hook.capture import RING_DIR_ENV

        ring_dir = os.environ.get(RING_DIR_ENV)
        if not ring_dir and self.config.log_dir:
            ring_dir = os.path.join(self.config.log_dir, "rings")
            os.makedirs(ring_dir, exist_ok=True)
        if not ring_dir and nccl_hook.current() is None:
            log.warning(
                "failslow: capture off - no ring directory (run under `failslow run`, set "
                "$%s or the log_dir setting)",
                RING_DIR_ENV,
            )
            return None
        return nccl_hook.install(ring_dir)

    def _start_snapshots(self) -> None:
        """Snapshots on (byterobust 6.3): require the adapter's support, resume from the newest
        step every rank can restore (a restart in place after a hot update or an eviction),
        then back every snapshot up on a peer outside the rank's parallel groups."""
        from pathlib import Path

        from failslow.core.checkpoint.snapshot import Snapshotter

        self.capabilities.require("snapshots")
        cfg = self.config.checkpoint
        directory = cfg.directory or os.environ.get(SNAPSHOT_DIR_ENV)
        self.snapshot_dir = Path(directory) if directory else None
        # three slots and waiting when busy: every rank keeps the same steps (restore agrees)
        self.snapshots = Snapshotter(self.snapshot_dir, rank=self.rank, slots=3, on_busy="wait")
        if self.snapshot_dir is not None:
            self.resume()
        if cfg.backup and self.world_size > 1:
            if self.snapshot_dir is None:
                log.warning("failslow: no snapshot directory, so no backups on peers")
                return
            from failslow.core.checkpoint.backup import BackupService

            holders = self._placement()
            after = self.resumed_step if self.resumed_step is not None else -1
            self.backup = BackupService(
                self.snapshots,
                holders,
                self.rank,
                self.snapshot_dir,
                every=cfg.every_steps,
                after_step=after,
            )

    def _placement(self) -> tuple[int, ...]:
        """Backup holders: the placement recorded by an earlier run of this job (restore must
        find the backups where they were made), else a new one for the current topology."""
        import json

        import torch.distributed as dist

        from failslow.core.checkpoint.placement import backup_holders

        if self._holders is not None:
            return self._holders
        assert self.snapshot_dir is not None
        path = self.snapshot_dir / "placement.json"
        try:
            mine = json.loads(path.read_text())
        except (OSError, ValueError):
            mine = None
        if not isinstance(mine, list) or len(mine) != self.world_size:
            mine = None
        found = [mine]
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            import torch

            first = torch.tensor([self.rank if mine is not None else self.world_size])
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            if int(first) < self.world_size:
                dist.broadcast_object_list(found, src=int(first))
        holders = tuple(found[0]) if found[0] is not None else backup_holders(self.topology)
        tmp = path.with_name(f"{path.name}.{self.rank}.tmp")  # ranks of a node share the file
        tmp.write_text(json.dumps(list(holders)))
        tmp.replace(path)
        self._holders = holders
        return holders

    def resume(self) -> int | None:
        """Restore the newest snapshot step every rank can obtain (its own node's snapshot, or
        the backup its holder keeps); returns the step (None: nothing to resume, fresh start)."""
        import torch.distributed as dist

        from failslow.core.checkpoint import restore

        assert self.snapshot_dir is not None
        anything = int(restore.has_committed(self.snapshot_dir, self.rank))
        if self._agree(anything)[1] == 0:
            return None  # a fresh job: no rank has a snapshot or a backup
        distributed = dist.is_available() and dist.is_initialized() and self.world_size > 1
        if distributed:
            try:
                found = restore.restore(
                    rank=self.rank, holders=self._placement(), directory=self.snapshot_dir
                )
            except restore.RestoreError as exc:
                raise restore.RestoreError(
                    f"failslow: cannot resume from the snapshots in {self.snapshot_dir}: {exc} "
                    "(remove the directory to start the job afresh)"
                ) from None
            step, state = found.step, found.state()
        else:
            loaded = self.snapshots.load()
            if loaded is None:
                return None
            step, state = loaded
        if not self.pm.hook.failslow_restore_state(state=state, step=step):
            raise Unsupported("snapshots", "no plugin restored the snapshot")
        self.resumed_step = step
        log.warning("failslow: rank %d resumed from the snapshot of step %d", self.rank, step)
        return step

    def _agree(self, step: int) -> tuple[int, int]:
        """(min, max) of ``step`` over all ranks (one all-reduce of two ints)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return step, step
        pair = torch.tensor([-step, step], dtype=torch.int64)
        dist.all_reduce(pair, op=dist.ReduceOp.MAX)
        return -int(pair[0]), int(pair[1])

    def snapshot(self, step: int) -> None:
        """Start this step's snapshot (the copy runs beside the step's forward/backward)."""
        state = self.pm.hook.failslow_snapshot_state(step=step)
        if state is None:
            raise Unsupported("snapshots", "no plugin returned the training state")
        self.snapshots.start(state, step)
        self.last_snapshot = step

    def before_optimizer_step(self) -> None:
        """The adapter calls this right before the optimizer mutates the state: the pending
        snapshot's copy must be complete (byterobust 6.3)."""
        if self.snapshots is not None:
            self.snapshots.wait_consistent()

    def close(self) -> None:
        self._stop.set()
        if self.snapshots is not None:
            self.snapshots.wait_sealed(timeout_s=self.config.planner.plan_timeout_s)
            if self.backup is not None:  # the same last step on every rank
                self.backup.close(last_step=self.last_snapshot)
                self.backup = None
            self.snapshots.close()
            self.snapshots = None
        if self.receiver is not None:
            self.receiver.stop()
        if self._publisher is not None:
            self._publisher.join(timeout=5.0)
        self._stop_agent()
        if self.started:
            self.pm.hook.failslow_session_end(rank=self.rank)
            self.started = False

    def _stop_agent(self) -> None:
        """No control thread outlives the session: stop the rank agent (it polls the store)
        and close the session's store, so nothing is inside a store call at interpreter exit."""
        from failslow import nccl_hook

        capture = nccl_hook.current()
        if capture is not None and capture.agent is not None:
            capture.agent.stop()
            capture.agent = None
        if self.store is not None:
            self.store.close()
            self.store = None

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

    def job_record(self) -> dict[str, Any]:
        return {
            "topology": self.topology.to_dict(),
            "capabilities": self.capabilities.to_dict(),
            "world_size": self.world_size,
        }

    # ---- plans -------------------------------------------------------------------------------
    def prepare(self, plan: Plan) -> None:
        """Check ``plan`` on this rank without changing anything; raise if it cannot apply."""
        kind = _KINDS.get(type(plan))
        if kind is None:
            raise Unsupported(type(plan).__name__, "no adapter hook applies this kind of plan")
        capability, hook = kind
        self.capabilities.require(capability)
        if isinstance(plan, StopForUpdate):
            if self.snapshots is None:
                raise Unsupported("hot_update", "needs snapshots (checkpoint.every_steps >= 1)")
            return
        answer = getattr(self.pm.hook, f"failslow_prepare_{hook}")(plan=plan, rank=self.rank)
        if answer is None:
            raise Unsupported(capability, f"no plugin implements failslow_prepare_{hook}")

    def schedule(self, plan: Plan, step: int) -> None:
        """Apply ``plan`` at step boundary ``step``; every rank must call this with the same
        arguments (tests, offline use). Checks the plan at once."""
        if step <= self.step:
            raise ValueError(f"failslow: step {step} already passed (at {self.step})")
        self.prepare(plan)
        self._scheduled[step] = plan

    def step_boundary(self, step: int) -> None:
        """The adapter is about to start global step ``step``: apply what is due here."""
        now = time.perf_counter()
        if self._last_boundary is not None and self.step >= 0:
            elapsed = now - self._last_boundary
            self.step_times.append((self.step, elapsed))
            self.pm.hook.failslow_on_step(step=self.step, step_time_s=elapsed)
        self._last_boundary = now
        self.step = step
        plan = self._scheduled.pop(step, None)
        if self.receiver is not None:
            plan = self.receiver.due(step) or plan
            self._report_outcomes()
        if plan is not None:
            self._apply(plan, step)
        every = self.config.checkpoint.every_steps
        if self.snapshots is not None and every and step % every == 0:
            self.snapshot(step)

    def _apply(self, plan: Plan, step: int) -> None:
        if isinstance(plan, StopForUpdate):
            self._stop_for_update(plan, step)
        _, hook = _KINDS[type(plan)]
        error = ""
        try:
            if not getattr(self.pm.hook, f"failslow_apply_{hook}")(plan=plan, step=step):
                error = f"no plugin applied the {type(plan).__name__}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if not self._all_ranks_ok(not error):
            # every rank goes back to the plan in effect before (also one that failed halfway)
            previous = self.current or self._even_plan()
            getattr(self.pm.hook, f"failslow_apply_{hook}")(plan=previous, step=step)
            detail = f"rank {self.rank}: {error}" if error else "another rank failed to apply it"
            log.warning("failslow: plan at step %d rolled back: %s", step, detail)
            self.pm.hook.failslow_on_plan_result(
                plan=plan, step=step, outcome="rolled back", detail=detail
            )
            return
        self.current = plan
        self.pm.hook.failslow_on_plan_result(plan=plan, step=step, outcome="applied", detail="")

    def _stop_for_update(self, plan: StopForUpdate, step: int) -> None:
        """Commit a snapshot of this step on every rank, then exit for the node agent to
        restart this process in place with the update (byterobust 6.1)."""
        import torch.distributed as dist

        self.snapshot(step)
        self.snapshots.wait_consistent()
        sealed = self.snapshots.wait_sealed(timeout_s=self.config.planner.plan_timeout_s)
        if sealed != step:
            raise RuntimeError(f"failslow: snapshot of step {step} not sealed for the update")
        self.pm.hook.failslow_hot_update(code={"update_id": plan.update_id}, step=step)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's snapshot is committed before any process goes
        self.pm.hook.failslow_on_plan_result(
            plan=plan, step=step, outcome="applied", detail="stopping for the update"
        )
        log.warning(
            "failslow: rank %d stops at step %d for update %d", self.rank, step, plan.update_id
        )
        self.close()
        # no interpreter teardown: framework threads blocked in collectives can abort it, and
        # everything that must survive is in the committed snapshot
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FOR_UPDATE)

    def _even_plan(self) -> MicroBatchPlan:
        topology = self.topology
        even = topology.micro_batches // topology.dp
        return MicroBatchPlan(counts=(even,) * topology.dp, weights=(1.0,) * topology.dp)

    def _all_ranks_ok(self, ok: bool) -> bool:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _report_outcomes(self) -> None:
        outcomes = self.receiver.outcomes
        while self._outcomes_seen < len(outcomes):
            _, plan, step, reason = outcomes[self._outcomes_seen]
            self._outcomes_seen += 1
            if step is None:
                self.pm.hook.failslow_on_plan_result(
                    plan=plan, step=None, outcome="aborted", detail=reason
                )

    # ---- rank 0: the job record and recent step times for the controller ------------------
    def _publish_steps(self) -> None:
        published, job_published = -1, False
        while not self._stop.wait(0.5):
            if not job_published:  # the store may still be connecting: until it holds it
                self.store.set_json(JOB_KEY, self._job)
                job_published = self.store.get(JOB_KEY) is not None
            recent = list(self.step_times)
            if not recent or recent[-1][0] == published:
                continue
            published = recent[-1][0]
            self.store.set_json(
                STEPS_KEY, {"steps": [[s, t] for s, t in recent], "wall": time.time()}
            )
