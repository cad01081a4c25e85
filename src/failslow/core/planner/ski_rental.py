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
- **Relief** reverts the applied plans, newest first (a restart cannot be reverted); so does a
  new diagnosis for the plans whose root cause it no longer contains.
- **Compound events**: a new onset while an event is active re-plans with the new diagnosis
  and keeps the accumulated impact, so cheap strategies are re-applied at once for the new
  straggler, expensive ones still wait for their break-even point.
- **Restart is last**: a strategy flagged ``last_resort`` is always sorted after the others, and
  its plan is made again when it is bought (what a restart can do - the standbys free - may
  have changed since the onset; no plan then: nothing is bought). A
  restart does not supersede the plans before it: the job resumes from its in-memory snapshot,
  which carries the S2 split and the layout in force, so relief still reverts them.
- **What was measured beats what was predicted** (DESIGN.md, the closed loop): the mitigator
  tells the planner a plan's measured step time once it was in effect a few steps
  (:meth:`MultiLevelPlanner.measured`); from then on this event judges that strategy by it,
  so a plan that did not pay is not bought again on its prediction. A strategy whose plan
  could not take effect in this job is disabled with its reason
  (:meth:`MultiLevelPlanner.disable`) and never planned again; one reverted for not paying
  leaves the event's applied plans (:meth:`MultiLevelPlanner.dropped`); a plan rebuilt from
  newer measurements replaces its strategy's (:meth:`MultiLevelPlanner.rebuild`).
- **A restart pays off what came before it**: it removes the diagnosed hosts, so the slow impact
  (and the fail-slow's age) count anew after it. A slowdown seen after the restart - another
  host, or a noisy re-validation - must pay for its own restart: never a storm of restarts on
  impact the first one already answered.

Two buy rules (``rule=``):

- :class:`BreakEven` is Algorithm 1 as published: candidate ``j`` is bought when the impact
  reaches its overhead ``B_j``, cheapest first. It treats every fail-slow as adversarial.
- :class:`ExpectedCost` (the default of :class:`~failslow.core.planner.planner.Planner`) uses
  what is known about fail-slows (:mod:`failslow.core.planner.duration_prior`): after every
  observed step it compares, for each candidate, the expected rent it saves over the
  fail-slow's expected remaining duration (the prior's mean residual life at the time already
  elapsed, so a fail-slow that has lasted long is expected to last longer) with its overhead,
  and buys the candidate with the largest expected saving. While that one's earliest point
  (below) is not reached, a lesser one is bought meanwhile only if the rent it saves until
  then pays for its overhead. Rent is counted per wall second,
  ``1 - healthy / step``. Two bounds keep the worst case: a candidate is never bought before
  the impact reaches ``earliest * B_j`` (an adversary that ends the fail-slow at once costs at
  most ``1 + 1 / earliest`` times the hindsight optimum: 3x at the default 0.5), and a
  candidate that is not the last resort is bought at the latest when the impact reaches
  ``B_j``, as Algorithm 1 does (its 2-competitive bound for S2 and S3). A last resort (S4,
  a restart) is bought only when the expected remaining duration pays for it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from failslow.core.diagnosis.record import Diagnosis, Kind
from failslow.core.planner.duration_prior import DurationPriors
from failslow.core.planner.plans import Plan, same_change
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


@dataclass(frozen=True)
class BreakEven:
    """greyhound Algorithm 1: buy each candidate, cheapest first, when the impact reaches its
    overhead (deterministic, 2-competitive for one buy option)."""


@dataclass(frozen=True)
class ExpectedCost:
    """Buy the candidate that saves the most expected rent over the fail-slow's expected
    remaining duration, within the worst-case bounds described in the module docstring."""

    priors: DurationPriors
    earliest: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.earliest <= 1.0:
            raise FailslowError(f"planner: earliest must be in (0, 1], got {self.earliest}")


BuyRule = BreakEven | ExpectedCost


@dataclass
class _Event:
    healthy_step_s: float
    diagnosis: Diagnosis
    candidates: list[_Candidate]
    next_index: int = 0
    impact_s: float = 0.0
    slow_steps: int = 0
    elapsed_s: float = 0.0
    """Seconds the fail-slow has lasted: its age at the diagnosis plus the steps since."""
    applied: list[_Candidate] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)
    """Strategy -> the step time its plan gave while in effect (what it is judged by now)."""
    recent: list[float] = field(default_factory=list)
    bought: set[int] = field(default_factory=set)
    """Indices into ``candidates`` bought for the current diagnosis (ExpectedCost)."""
    purchases: int = 0
    """Plans bought in this event, under any diagnosis of it."""


class MultiLevelPlanner:
    """Feed it onsets, per-iteration step times and reliefs; it answers with decisions."""

    def __init__(
        self,
        strategies: Sequence[Strategy],
        *,
        min_gain: float = 0.05,
        recent_window: int = 5,
        rule: BuyRule | None = None,
    ) -> None:
        names = [s.name for s in strategies]
        if len(set(names)) != len(names):
            raise FailslowError(f"planner: strategy names must be unique, got {names}")
        if not 0.0 <= min_gain < 1.0:
            raise FailslowError(f"planner: min_gain must be in [0, 1), got {min_gain}")
        self._strategies = tuple(strategies)
        self._min_gain = min_gain
        self._recent_window = max(1, recent_window)
        self._rule: BuyRule = rule if rule is not None else BreakEven()
        self._event: _Event | None = None
        self.disabled: dict[str, str] = {}
        """Strategy -> why it cannot take effect in this job (never planned again)."""
        self.passed_over: dict[str, str] = {}
        """Strategy -> why the newest diagnosis got no plan from it."""

    @property
    def rule(self) -> BuyRule:
        return self._rule

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

    @property
    def bought_nothing(self) -> bool:
        """An event is on and no plan was bought in it yet (none paid off so far, or no level
        had a plan for its diagnosis)."""
        return self._event is not None and self._event.purchases == 0

    def candidates(self) -> tuple[tuple[str, float], ...]:
        """(strategy, estimated overhead) of the current event, in the order they are bought."""
        if self._event is None:
            return ()
        return tuple((c.strategy.name, c.plan.overhead_s) for c in self._event.candidates)

    def _build(self, diagnosis: Diagnosis) -> list[_Candidate]:
        out = []
        self.passed_over = {}
        for strategy in self._strategies:
            if diagnosis.kind not in strategy.handles:
                self.passed_over[strategy.name] = (
                    f"it does not mitigate a {diagnosis.kind.value} fail-slow"
                )
                continue
            if strategy.name in self.disabled:
                self.passed_over[strategy.name] = f"disabled: {self.disabled[strategy.name]}"
                continue
            plan = strategy.build(diagnosis)
            if plan is None:
                self.passed_over[strategy.name] = "no plan changes anything for this diagnosis"
                continue
            if not plan.overhead_s >= 0.0:
                raise FailslowError(
                    f"planner: strategy {strategy.name!r} estimated overhead {plan.overhead_s}"
                )
            out.append(_Candidate(strategy, plan))
        out.sort(key=lambda c: (c.strategy.last_resort, c.plan.overhead_s))
        return out

    def options(self, diagnosis: Diagnosis) -> list[tuple[str, Plan, bool]]:
        """(strategy, plan, revertible) of every level that has a plan for ``diagnosis``, in
        the order the rule considers them; planning only (the state of the event is kept).
        The simulator's hindsight oracle chooses among these."""
        return [(c.strategy.name, c.plan, c.strategy.revertible) for c in self._build(diagnosis)]

    def onset(
        self, diagnosis: Diagnosis, *, healthy_step_s: float, age_s: float = 0.0
    ) -> list[Decision]:
        """A fail-slow was detected and diagnosed; returns the decisions due right away.

        ``age_s``: how long the fail-slow had lasted when it was diagnosed, for steps the
        caller does not feed to :meth:`observe` (the detection latency); ExpectedCost reads
        the duration prior at the fail-slow's true age."""
        if not healthy_step_s > 0.0:
            raise FailslowError(f"planner: healthy step time must be > 0, got {healthy_step_s}")
        if not (math.isfinite(age_s) and age_s >= 0.0):
            raise FailslowError(f"planner: fail-slow age must be >= 0 seconds, got {age_s}")
        candidates = self._build(diagnosis)
        stale: list[Decision] = []
        if self._event is None:
            self._event = _Event(healthy_step_s, diagnosis, candidates, elapsed_s=age_s)
        else:
            event = self._event
            event.diagnosis, event.candidates, event.next_index = diagnosis, candidates, 0
            event.bought = set()
            # a plan for a root cause the new diagnosis no longer has (S2 after the slow GPU
            # recovered while a link stays slow) is undone, as at relief
            for c in reversed(event.applied):
                if c.strategy.revertible and diagnosis.kind not in c.strategy.handles:
                    reason = f"the {diagnosis.kind.value} fail-slow left is not one it mitigates"
                    stale.append(Decision("revert", c.strategy.name, c.plan, reason))
            gone = {id(d.plan) for d in stale}
            event.applied = [c for c in event.applied if id(c.plan) not in gone]
        return stale + self._buy()

    def reconsider(self, diagnosis: Diagnosis) -> list[Decision]:
        """The event's fail-slow diagnosed again: its plans built anew from ``diagnosis`` (and
        whatever the builders measure now), its impact and age kept; the decisions due."""
        if self._event is None:
            return []
        return self.onset(diagnosis, healthy_step_s=self._event.healthy_step_s)

    def observe(self, step_time_s: float) -> list[Decision]:
        """One finished iteration's time; returns the decisions it triggers (usually none)."""
        event = self._event
        if event is None:
            return []
        self._accrue(event, step_time_s)
        return self._buy()

    def catch_up(self, step_times: Sequence[float]) -> list[Decision]:
        """The iterations since the fail-slow began that the diagnosis came after: their
        impact counts (Alg. 1), but what to buy is decided once, now, on the newest of them -
        a strategy is not judged (and passed over for good) against the step time of a moment
        long gone (seen in the ladder demo: the first slow steps were a noisy onset's, S2's
        plan for the slowed rank looked no better than them, and the restart was bought
        without S2 ever tried)."""
        event = self._event
        if event is None:
            return []
        for step_time_s in step_times:
            self._accrue(event, step_time_s)
        return self._buy()

    def _accrue(self, event: _Event, step_time_s: float) -> None:
        excess = step_time_s - event.healthy_step_s
        event.elapsed_s += max(step_time_s, 0.0)
        if excess > 0.0:
            event.impact_s += excess
            event.slow_steps += 1
        event.recent.append(step_time_s)
        del event.recent[: -self._recent_window]

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

    # ---- what the job showed (the closed loop) -------------------------------------------------
    def disable(self, name: str, reason: str) -> None:
        """Strategy ``name`` cannot take effect in this job (``reason``): never plan it again;
        its plan leaves the event (it was rolled back)."""
        self.disabled[name] = reason
        event = self._event
        if event is None:
            return
        event.applied = [c for c in event.applied if c.strategy.name != name]
        kept = [c for c in event.candidates if c.strategy.name != name]
        if len(kept) != len(event.candidates):  # indices move: keep what was bought
            bought = [event.candidates[i] for i in event.bought]
            done = event.candidates[: event.next_index]
            event.candidates = kept
            event.bought = {i for i, c in enumerate(kept) if any(c is b for b in bought)}
            event.next_index = sum(1 for c in kept if any(c is d for d in done))

    def measured(self, name: str, step_s: float) -> None:
        """Strategy ``name``'s plan gave ``step_s`` per step while in effect: this event judges
        it by that from now on, not by its prediction."""
        if self._event is not None and step_s > 0.0:
            self._event.measured[name] = step_s

    def dropped(self, name: str) -> None:
        """Strategy ``name``'s plan was reverted (it did not pay): no longer applied; it is
        not bought again in this event unless a new diagnosis makes its plan anew."""
        if self._event is not None:
            self._event.applied = [c for c in self._event.applied if c.strategy.name != name]

    def rebuild(self, name: str, reason: str) -> Decision | None:
        """Build strategy ``name``'s plan again for the current diagnosis (newer measurements);
        a Decision to apply it when it differs from the one applied, else None."""
        event = self._event
        if event is None or name in self.disabled:
            return None
        applied = next((c for c in event.applied if c.strategy.name == name), None)
        if applied is None:
            return None
        plan = applied.strategy.build(event.diagnosis)
        if plan is None or same_change(plan, applied.plan):
            return None
        fresh = _Candidate(applied.strategy, plan)
        event.applied = [fresh if c is applied else c for c in event.applied]
        event.candidates = [fresh if c.strategy.name == name else c for c in event.candidates]
        event.measured.pop(name, None)  # the new plan is judged by its own prediction
        return Decision("apply", name, plan, reason)

    def _buy(self) -> list[Decision]:
        if isinstance(self._rule, ExpectedCost):
            return self._buy_expected(self._rule)
        return self._buy_break_even()

    def _expected_step(self, candidate: _Candidate, current: float) -> float | None:
        """The step time ``candidate`` is expected to give, on the observed scale: what its
        strategy measured in this event, else its plan's prediction."""
        event = self._event
        if event is not None and candidate.strategy.name in event.measured:
            return event.measured[candidate.strategy.name]
        expected = candidate.plan.step_time_s
        baseline = candidate.plan.baseline_step_s
        if expected is not None and baseline:
            return current * expected / baseline  # the model's relative gain
        return expected

    def _apply(self, candidate: _Candidate, why: str) -> Decision | None:
        event = self._event
        assert event is not None
        if candidate.strategy.last_resort:  # planned as it is bought: with the hosts free now
            plan = candidate.strategy.build(event.diagnosis)
            if plan is None:
                return None
            candidate = _Candidate(candidate.strategy, plan)
        event.purchases += 1
        event.applied.append(candidate)  # a restart resumes from the snapshot, which carries
        # the plans in force (the S2 split, the swapped layout): relief must still undo them
        event.recent.clear()
        if not candidate.strategy.revertible:  # a restart without the diagnosed hosts
            event.impact_s, event.slow_steps, event.elapsed_s = 0.0, 0, 0.0
        return Decision("apply", candidate.strategy.name, candidate.plan, why)

    def _buy_expected(self, rule: ExpectedCost) -> list[Decision]:
        event = self._event
        assert event is not None
        if not event.recent:
            return []  # nothing observed since the onset or the last buy: wait for a step
        current = statistics.median(event.recent)
        healthy = event.healthy_step_s
        rent = max(0.0, 1.0 - healthy / current)  # seconds lost per wall second now
        remaining = rule.priors.of(event.diagnosis.kind).mean_residual(event.elapsed_s)
        best: tuple[float, int, str] | None = None
        scored: list[tuple[int, float, str]] = []  # (index, rent per second after, why)
        for index, candidate in enumerate(event.candidates):
            overhead = candidate.plan.overhead_s
            if index in event.bought:
                continue
            expected = self._expected_step(candidate, current)
            if expected is not None and expected > current * (1.0 - self._min_gain):
                continue  # would not beat what is observed now: not worth its overhead
            after = 0.0 if expected is None else max(0.0, 1.0 - healthy / max(expected, healthy))
            saving = (rent - after) * remaining - overhead
            late = not candidate.strategy.last_resort and event.impact_s >= overhead
            if saving <= 0.0 and not late:
                continue
            why = (
                f"expected saving {saving:.1f} s over ~{remaining:.0f} s still to come"
                if saving > 0.0
                else f"slow impact {event.impact_s:.1f} s >= overhead {overhead:.1f} s"
            )
            scored.append((index, after, why))
            if best is None or saving > best[0]:
                best = (saving, index, why)
        if best is None:
            return []
        _, index, why = best
        due = rule.earliest * event.candidates[index].plan.overhead_s
        if event.impact_s < due:
            # The best buy is not due yet. A lesser one is bought meanwhile only if the rent
            # it saves until then pays for it (S2, nearly free, always does).
            wait_s = (due - event.impact_s) / rent if rent > 0.0 else math.inf
            bridge = [
                ((rent - after) * wait_s - event.candidates[i].plan.overhead_s, i, reason)
                for i, after, reason in scored
                if i != index
                and event.impact_s >= rule.earliest * event.candidates[i].plan.overhead_s
            ]
            bridge = [b for b in bridge if b[0] > 0.0]
            if not bridge:
                return []
            _, index, why = max(bridge)
        event.bought.add(index)
        decision = self._apply(event.candidates[index], why)
        return [decision] if decision is not None else []

    def _buy_break_even(self) -> list[Decision]:
        event = self._event
        assert event is not None
        decisions = []
        while event.next_index < len(event.candidates):
            candidate = event.candidates[event.next_index]
            if event.impact_s < candidate.plan.overhead_s:
                break
            event.next_index += 1
            if event.recent:
                current = statistics.median(event.recent)
                expected = self._expected_step(candidate, current)
                if expected is not None and expected > current * (1.0 - self._min_gain):
                    continue  # would not beat what is observed now: not worth its overhead
            decision = self._apply(
                candidate,
                f"slow impact {event.impact_s:.1f} s over {event.slow_steps} slow steps "
                f">= overhead {candidate.plan.overhead_s:.1f} s",
            )
            if decision is not None:
                decisions.append(decision)
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
