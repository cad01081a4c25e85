"""Plans on one rank: checked before, switched at one step boundary, rolled back together.

greyhound 5 applies a mitigation "at the next iteration boundary"; in a synchronous job every
rank must switch at the same boundary, and a switch that fails on one rank must not leave the
others on the new plan. The plan channel (:mod:`failslow.core.control.plan_channel`) agrees on
the step; this module is the rank's part:

- :meth:`PlanApplication.prepare` asks the adapter whether the plan can apply
  (``failslow_prepare_*``), changing nothing - the plan channel's prepare phase, and
  :meth:`PlanApplication.schedule` for offline use and tests;
- :meth:`PlanApplication.apply` switches (``failslow_apply_*``) at the agreed boundary and
  confirms with one all-reduce that every rank did; if any rank failed, every rank goes back
  to the plan in effect before (also the one that failed halfway) and
  ``failslow_on_plan_result`` reports ``"rolled back"``; otherwise ``"applied"``. A topology
  plan goes back through the adapter's ``failslow_revert_topology_plan`` (it kept the state
  from before the swap).

Each plan kind maps to its capability and its pair of hooks in one place
(:meth:`PlanApplication._call`), with the hook calls written out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from failslow.capabilities import Capabilities, Unsupported
from failslow.core.control.plan_channel import PlanResult
from failslow.core.planner.plans import MicroBatchPlan, Plan, TopologyPlan

log = logging.getLogger(__name__)

CAPABILITY = {MicroBatchPlan: "microbatch_plans", TopologyPlan: "topology_plans"}
"""The capability each plan kind needs."""


class PlanApplication:
    """The plan in effect on this rank and the plans scheduled for later steps."""

    def __init__(
        self,
        hooks: Any,
        *,
        rank: int,
        capabilities: Callable[[], Capabilities],
        even_plan: Callable[[], MicroBatchPlan],
        all_ranks_ok: Callable[[bool], bool],
    ) -> None:
        self.hooks = hooks
        self.rank = rank
        self._capabilities = capabilities
        self._even_plan = even_plan
        self._all_ranks_ok = all_ranks_ok
        self.current: Plan | None = None
        """The plan in effect (None: the framework's own even split)."""
        self._scheduled: dict[int, Plan] = {}

    def prepare(self, plan: Plan) -> None:
        """Check ``plan`` on this rank without changing anything; raise if it cannot apply."""
        capability = CAPABILITY.get(type(plan))
        if capability is None:
            raise Unsupported(type(plan).__name__, "no adapter hook applies this kind of plan")
        self._capabilities().require(capability)
        if self._call("prepare", plan) is None:
            hook = "failslow_prepare_" + capability.removesuffix("s")
            raise Unsupported(capability, f"no plugin implements {hook}")

    def schedule(self, plan: Plan, step: int, *, now: int) -> None:
        """Apply ``plan`` at step boundary ``step`` (after the current step ``now``); every rank
        must call this with the same arguments. Checks the plan at once."""
        if step <= now:
            raise ValueError(f"failslow: step {step} already passed (at {now})")
        self.prepare(plan)
        self._scheduled[step] = plan

    def scheduled_until(self, step: int) -> list[tuple[int, Plan]]:
        """The scheduled plans due at ``step`` or earlier, as ``(step, plan)`` (not taken)."""
        return [(s, plan) for s, plan in sorted(self._scheduled.items()) if s <= step]

    def scheduled(self, step: int) -> Plan | None:
        """The plan scheduled for ``step``, taken off the schedule."""
        return self._scheduled.pop(step, None)

    def apply(self, plan: Plan, step: int) -> bool:
        """Switch every rank to ``plan`` at ``step``, or none (rolled back); True if applied."""
        error = ""
        try:
            if not self._call("apply", plan, step):
                error = f"no plugin applied the {type(plan).__name__}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if not self._all_ranks_ok(not error):
            # every rank goes back to the plan in effect before (also one that failed halfway)
            try:
                self._roll_back(plan, step)
            except Exception:  # never into training; the plan in effect is then unknown
                log.exception("failslow: rank %d could not roll back at step %d", self.rank, step)
            detail = f"rank {self.rank}: {error}" if error else "another rank failed to apply it"
            log.warning("failslow: plan at step %d rolled back: %s", step, detail)
            self.hooks.failslow_on_plan_result(
                plan=plan, step=step, outcome=PlanResult.ROLLED_BACK, detail=detail
            )
            return False
        self.current = plan
        self.hooks.failslow_on_plan_result(
            plan=plan, step=step, outcome=PlanResult.APPLIED, detail=""
        )
        return True

    def _roll_back(self, plan: Plan, step: int) -> None:
        """Back to the state before ``plan``: a micro-batch plan by re-applying the counts in
        effect before (or the even split), a topology plan by the adapter's revert."""
        if isinstance(plan, TopologyPlan):
            self.hooks.failslow_revert_topology_plan(plan=plan, step=step)
            return
        previous = self.current
        if previous is None or type(previous) is not type(plan):
            previous = self._even_plan() if isinstance(plan, MicroBatchPlan) else None
        if previous is not None:
            self._call("apply", previous, step)

    def _call(self, phase: str, plan: Plan, step: int = -1) -> Any:
        """The adapter hook of ``phase`` ("prepare" or "apply") for ``plan``'s kind."""
        hooks = self.hooks
        if isinstance(plan, MicroBatchPlan):
            if phase == "prepare":
                return hooks.failslow_prepare_microbatch_plan(plan=plan, rank=self.rank)
            return hooks.failslow_apply_microbatch_plan(plan=plan, step=step)
        if isinstance(plan, TopologyPlan):
            if phase == "prepare":
                return hooks.failslow_prepare_topology_plan(plan=plan, rank=self.rank)
            return hooks.failslow_apply_topology_plan(plan=plan, step=step)
        raise Unsupported(type(plan).__name__, "no adapter hook applies this kind of plan")
