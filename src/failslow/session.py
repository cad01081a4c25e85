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
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from failslow import plugins as _plugins
from failslow.capabilities import Capabilities, Unsupported
from failslow.config import FailslowConfig, load_config
from failslow.core.planner.plans import MicroBatchPlan, Plan, TopologyPlan
from failslow.core.topology import Topology

log = logging.getLogger(__name__)

JOB_KEY = "failslow/job"
STEPS_KEY = "failslow/steps"

_KINDS: dict[type, tuple[str, str]] = {
    MicroBatchPlan: ("microbatch_plans", "microbatch_plan"),
    TopologyPlan: ("topology_plans", "topology_plan"),
}


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

    # ---- lifecycle ---------------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> None:
        _plugins.register(self.pm, plugin, name)

    def start(self) -> Session:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.config.enabled:
            self._start_capture_and_store()
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
        import os

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

    def close(self) -> None:
        self._stop.set()
        if self.receiver is not None:
            self.receiver.stop()
        if self._publisher is not None:
            self._publisher.join(timeout=5.0)
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

    def _apply(self, plan: Plan, step: int) -> None:
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
