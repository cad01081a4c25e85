"""Ski-rental multi-level mitigation, as an online object (greyhound 5.1, Algorithm 1, Table 2).

A fail-slow of unknown duration is a ski-rental problem: every slow iteration "rents" (costs
``t_slow - t_healthy`` seconds), a mitigation "buys" (costs its one-off overhead, then the rent
drops to what remains of the slowdown). Algorithm 1 starts with S1 (ignore) and switches to
the next, more effective and more expensive strategy when the cumulative slow impact since the
onset reaches that strategy's overhead - the deterministic break-even rule, 2-competitive for a
single buy option.

What this object adds to the paper's loop, each as a rule a user can read here:

- **Candidates** are the strategies whose root-cause set contains the diagnosis' kind (Table
  2: S2 mitigates compute only; S3 and S4 mitigate both), each built into a concrete plan for
  this diagnosis, sorted by the plan's *estimated* overhead. Overheads come from the plans
  (measured solve times, pause + bytes / bandwidth, restart time); nothing here assumes one.
- **Escalation only pays if it helps**: a candidate whose plan estimates a step time no better
  than what is being observed now (by ``min_gain``) is skipped - the current strategy is then
  not "ineffective" relative to it. A plan that also carries its model's estimate for the
  configuration it replaces (``baseline_step_s``) is judged by the model's relative gain
  applied to the observed step time, not by its absolute estimate. A strategy that proved
  ineffective keeps the impact accumulating at the old rate, so the next one is bought exactly
  when Alg. 1 says.
- **Relief** reverts the applied plans, newest first (a restart cannot be reverted).
- **Compound events**: a new onset while an event is active re-plans with the new diagnosis
  and keeps the accumulated impact, so cheap strategies are re-applied at once for the new
  straggler, expensive ones still wait for their break-even point.
- **Restart is last**: a strategy flagged ``last_resort`` is always sorted after the others;
  applying a non-revertible one (a restart rebuilds the job) supersedes the plans before it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from failslow.core.diagnosis.record import Diagnosis, Kind
from failslow.core.planner.plans import Plan
from failslow.errors import FailslowError

ALL_KINDS = frozenset(Kind)
COMPUTE_ONLY = frozenset({Kind.COMPUTE, Kind.BOTH})


@dataclass(frozen=True)
class Strategy:
    """One mitigation level: which root causes it helps (Table 2) and how to plan it.

    ``build`` returns the concrete plan for a diagnosis, with its estimated ``overhead_s`` and
    ``step_time_s``, or None when the strategy has nothing to offer for it.
    """

    name: str
    handles: frozenset[Kind]
    build: Callable[[Diagnosis], Plan | None]
    last_resort: bool = False
    revertible: bool = True


@dataclass(frozen=True)
class Decision:
    action: str  # "apply" or "revert"
    strategy: str
    plan: Plan
    reason: str


@dataclass
class _Candidate:
    strategy: Strategy
    plan: Plan


@dataclass
class _Event:
    healthy_step_s: float
    diagnosis: Diagnosis
    candidates: list[_Candidate]
    next_index: int = 0
    impact_s: float = 0.0
    slow_steps: int = 0
    applied: list[_Candidate] = field(default_factory=list)
    recent: list[float] = field(default_factory=list)


class MultiLevelPlanner:
    """Feed it onsets, per-iteration step times and reliefs; it answers with decisions."""

    def __init__(
        self,
        strategies: Sequence[Strategy],
        *,
        min_gain: float = 0.05,
        recent_window: int = 5,
    ) -> None:
        names = [s.name for s in strategies]
        if len(set(names)) != len(names):
            raise FailslowError(f"planner: strategy names must be unique, got {names}")
        if not 0.0 <= min_gain < 1.0:
            raise FailslowError(f"planner: min_gain must be in [0, 1), got {min_gain}")
        self._strategies = tuple(strategies)
        self._min_gain = min_gain
        self._recent_window = max(1, recent_window)
        self._event: _Event | None = None

    @property
    def active(self) -> bool:
        return self._event is not None

    @property
    def impact_s(self) -> float:
        """Cumulative slow impact (seconds lost) of the current event."""
        return self._event.impact_s if self._event else 0.0

    @property
    def applied(self) -> tuple[str, ...]:
        return tuple(c.strategy.name for c in self._event.applied) if self._event else ()

    def candidates(self) -> tuple[tuple[str, float], ...]:
        """(strategy, estimated overhead) of the current event, in the order they are bought."""
        if self._event is None:
            return ()
        return tuple((c.strategy.name, c.plan.overhead_s) for c in self._event.candidates)

    def _build(self, diagnosis: Diagnosis) -> list[_Candidate]:
        out = []
        for strategy in self._strategies:
            if diagnosis.kind not in strategy.handles:
                continue
            plan = strategy.build(diagnosis)
            if plan is None:
                continue
            if not plan.overhead_s >= 0.0:
                raise FailslowError(
                    f"planner: strategy {strategy.name!r} estimated overhead {plan.overhead_s}"
                )
            out.append(_Candidate(strategy, plan))
        out.sort(key=lambda c: (c.strategy.last_resort, c.plan.overhead_s))
        return out

    def onset(self, diagnosis: Diagnosis, *, healthy_step_s: float) -> list[Decision]:
        """A fail-slow was detected and diagnosed; returns the decisions due right away."""
        if not healthy_step_s > 0.0:
            raise FailslowError(f"planner: healthy step time must be > 0, got {healthy_step_s}")
        candidates = self._build(diagnosis)
        if self._event is None:
            self._event = _Event(healthy_step_s, diagnosis, candidates)
        else:
            event = self._event
            event.diagnosis, event.candidates, event.next_index = diagnosis, candidates, 0
        return self._buy()

    def observe(self, step_time_s: float) -> list[Decision]:
        """One finished iteration's time; returns the decisions it triggers (usually none)."""
        event = self._event
        if event is None:
            return []
        excess = step_time_s - event.healthy_step_s
        if excess > 0.0:
            event.impact_s += excess
            event.slow_steps += 1
        event.recent.append(step_time_s)
        del event.recent[: -self._recent_window]
        return self._buy()

    def relief(self) -> list[Decision]:
        """The fail-slow is over: revert what can be reverted, newest first; end the event."""
        event, self._event = self._event, None
        if event is None:
            return []
        return [
            Decision("revert", c.strategy.name, c.plan, "fail-slow relieved")
            for c in reversed(event.applied)
            if c.strategy.revertible
        ]

    def _buy(self) -> list[Decision]:
        event = self._event
        assert event is not None
        decisions = []
        while event.next_index < len(event.candidates):
            candidate = event.candidates[event.next_index]
            if event.impact_s < candidate.plan.overhead_s:
                break
            event.next_index += 1
            current = statistics.median(event.recent) if event.recent else None
            expected = candidate.plan.step_time_s
            baseline = candidate.plan.baseline_step_s
            if current is not None and expected is not None and baseline:
                expected = current * expected / baseline  # the model's relative gain
            if (
                current is not None
                and expected is not None
                and expected > current * (1.0 - self._min_gain)
            ):
                continue  # would not beat what is observed now: not worth its overhead
            if not candidate.strategy.revertible:
                event.applied.clear()  # a restart rebuilds the job: earlier plans are moot
            event.applied.append(candidate)
            event.recent.clear()
            decisions.append(
                Decision(
                    "apply",
                    candidate.strategy.name,
                    candidate.plan,
                    f"slow impact {event.impact_s:.1f} s over {event.slow_steps} slow steps "
                    f">= overhead {candidate.plan.overhead_s:.1f} s",
                )
            )
        return decisions


def hindsight_cost(
    duration_steps: int,
    healthy_step_s: float,
    slow_step_s: float,
    options: Sequence[tuple[float, float]],
) -> float:
    """Offline optimum of one event: the best single buy at the onset, knowing the duration.

    ``options`` are (overhead_s, step_time_s after applying); doing nothing is always an
    option. Used by the ski-rental benchmark as the denominator of the competitive ratio.
    """
    best = duration_steps * (slow_step_s - healthy_step_s)
    for overhead, step in options:
        best = min(best, overhead + duration_steps * max(0.0, step - healthy_step_s))
    return best
