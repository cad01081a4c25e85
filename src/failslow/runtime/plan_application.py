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
  from before the swap);
- :meth:`PlanApplication.check`, at the next step boundary, compares what the rank ran in the
  apply step with the plan (DESIGN.md, the closed loop): a micro-batch plan through the
  adapter's ``failslow_verify_microbatch_plan`` (forwards counted by the step profile, the
  share-aware loader's reads, the framework's loss scale), a topology plan by the role the
  framework's own groups give this process (``failslow_observed_coord``) against the one the
  plan moves it to. ``failslow_on_plan_result`` then reports ``"in effect"`` or ``"not in
  effect"`` with what the rank ran; the session sends it to the controller, which calls a plan
  in effect only when every rank did.

Each plan kind maps to its capability and its pair of hooks in one place
(:meth:`PlanApplication._call`), with the hook calls written out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from failslow.capabilities import Capabilities, Unsupported
from failslow.core.control.plan_channel import PlanResult
from failslow.core.planner.plans import MicroBatchPlan, Plan, TopologyPlan
from failslow.core.topology import Topology

log = logging.getLogger(__name__)

CAPABILITY = {MicroBatchPlan: "microbatch_plans", TopologyPlan: "topology_plans"}
"""The capability each plan kind needs."""


@dataclass(frozen=True)
class Applied:
    """A plan this rank switched to at ``step``, not checked yet."""

    plan: Plan
    step: int
    role: tuple[int, ...] | None = None
    """A topology plan's: the coordinates it moves this process to."""


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
        topology: Callable[[], Topology] | None = None,
    ) -> None:
        self.hooks = hooks
        self.rank = rank
        self._capabilities = capabilities
        self._even_plan = even_plan
        self._all_ranks_ok = all_ranks_ok
        self._topology = topology
        self.current: Plan | None = None
        """The plan switched to last (None: the framework's own even split)."""
        self._scheduled: dict[int, Plan] = {}
        self.unchecked: Applied | None = None
        """The plan switched to at the last plan step, until :meth:`check` looked at what ran."""
        self.rolled_back = ""
        """Why the last :meth:`apply` rolled back ("" when it applied)."""

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
        """Switch every rank to ``plan`` at ``step``, or none (rolled back, the reason in
        :attr:`rolled_back`); True if applied."""
        role = self._role_after(plan)
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
            self.rolled_back = detail
            log.warning("failslow: plan at step %d rolled back: %s", step, detail)
            self.hooks.failslow_on_plan_result(
                plan=plan, step=step, outcome=PlanResult.ROLLED_BACK, detail=detail
            )
            return False
        self.current = plan
        self.rolled_back = ""
        self.unchecked = Applied(plan, step, role)
        self.hooks.failslow_on_plan_result(
            plan=plan, step=step, outcome=PlanResult.APPLIED, detail=""
        )
        return True

    def _role_after(self, plan: Plan) -> tuple[int, ...] | None:
        """The coordinates a topology plan moves this process to (None: another kind, or no
        topology to compute them from - the check then says so)."""
        if not isinstance(plan, TopologyPlan) or self._topology is None:
            return None
        try:
            topology = self._topology()
            return tuple(topology.moved(topology.placement(plan.hosts)).coords[self.rank])
        except Exception:  # prepare checked the plan; apply reports what goes wrong
            return None

    def check(self, step: int, forwards: int) -> tuple[Applied, str] | None:
        """At step boundary ``step``: if a plan was switched to at an earlier boundary and not
        checked yet, what this rank ran in that step against the plan - ``(applied, "")`` when
        it ran the plan, else the reason - reported through ``failslow_on_plan_result``.
        ``forwards``: the training forwards the step profile counted since the last boundary.
        None when nothing waits for a check."""
        applied = self.unchecked
        if applied is None or step <= applied.step:
            return None
        self.unchecked = None
        try:
            reason = self._observe(applied, step, forwards)
        except Exception as exc:  # an adapter that cannot look: not in effect, said why
            reason = f"the check failed: {type(exc).__name__}: {exc}"
        outcome = PlanResult.NOT_IN_EFFECT if reason else PlanResult.IN_EFFECT
        if reason:
            log.warning(
                "failslow: rank %d: plan of step %d not in effect: %s", self.rank, applied.step,
                reason,
            )  # fmt: skip
        self.hooks.failslow_on_plan_result(
            plan=applied.plan, step=applied.step, outcome=outcome, detail=reason
        )
        return applied, reason

    def _observe(self, applied: Applied, step: int, forwards: int) -> str:
        plan = applied.plan
        if step != applied.step + 1:
            return f"step {applied.step + 1}, the plan's first full step, was never seen"
        if isinstance(plan, MicroBatchPlan):
            reason = self.hooks.failslow_verify_microbatch_plan(
                plan=plan, step=applied.step, forwards=forwards
            )
            if reason is None:
                return "no plugin reports what the rank ran (failslow_verify_microbatch_plan)"
            return str(reason)
        if isinstance(plan, TopologyPlan):
            role = self.hooks.failslow_observed_coord()
            if role is None:
                return "no plugin reports the role this process runs (failslow_observed_coord)"
            if applied.role is None:
                return "the role the plan gives this process is unknown (no topology)"
            if tuple(role) != applied.role:
                return (
                    f"runs the role at coordinates {list(role)} (tp, dp, pp), the plan gives it "
                    f"{list(applied.role)}"
                )
            return ""
        return f"a {type(plan).__name__} is not checked on the rank"

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
