"""What became of each committed plan: its effect on the ranks, then its outcome in step time.

DESIGN.md, "The closed loop" (a Kubernetes controller's spec and status): a plan the plan
channel committed is the spec. The mitigator (:mod:`.mitigator`) calls it in effect only from
what was observed, in two stages this module watches:

1. **effect** - after the apply step every rank checks what it ran against the plan and reports
   (:meth:`~failslow.core.control.plan_channel.PlanReceiver.report_effect`). The plan is in
   effect when every rank ran it; not in effect when a rank did not (its reason), or when not
   every rank had reported :attr:`ClosedLoop.grace_s` after rank 0 was seen past the apply step
   (a rank that died, an adapter that cannot check). Two counter reads per plan and tick.
2. **outcome** - a plan in effect is watched for :data:`OUTCOME_STEPS` steps from
   :data:`OUTCOME_FIRST` steps after its apply step (the first steps carry the switch): their
   median is its measured step time, set against its prediction on the same scale
   (:func:`predicted_step_s`) and the steps before it. :func:`judge` calls a plan short when
   it saved less than half of what it predicted; the mitigator then re-plans from the measured
   per-replica costs or reverts, and the planner judges the strategy by what it measured.
3. **kept** - a plan that paid is not left alone after its verdict: a load that arrives later,
   or a fault that changes, can take its saving away. Its steps are judged again in windows of
   :data:`KEEP_STEPS` against the same before-time and prediction; :data:`KEEP_STRIKES`
   windows in a row that fall short mean it *stopped paying* (:meth:`ClosedLoop.drifts`), and
   the mitigator re-plans from the profiles measured now, keeps it where those say the even
   split would be slower still, or reverts it. One window is not enough: a validation pause or
   a checkpoint can sit in one.

Step times are rank 0's (a synchronous job has one step time), as the mitigator reads them:
nothing here grows with the world size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from failslow.core.control import keys
from failslow.core.control.plan_channel import PlanResult, read_effect
from failslow.core.control.store import Store
from failslow.core.planner.plans import Plan

OUTCOME_FIRST = 2
"""Steps after the apply step before the outcome is measured (the apply step and the next carry
the switch: loaders reading ahead, a validation pause's tail)."""
OUTCOME_STEPS = 5
"""Steps the outcome's median is taken over."""
BEFORE_STEPS = 5
"""Steps before the apply step whose median is the step time the plan set out to improve."""
PAYS_SHARE = 0.5
"""A plan pays when its measured saving is at least this share of the predicted one."""
KEEP_STEPS = 10
"""Steps per window a plan that paid is judged again over, after its verdict (the default of
``planner.keep_steps``)."""
KEEP_STRIKES = 2
"""Windows in a row that fall short before a plan that paid is said to have stopped paying."""
STOPPED_PAYING = "stopped paying"
"""The verdict of a kept plan whose later windows fell short (:meth:`ClosedLoop.drifts`)."""

StepTimes = Mapping[int, tuple[float, float]]
"""step -> (seconds, wall time the controller first saw it): the mitigator's record."""


def median_before(steps: StepTimes, apply_step: int) -> float | None:
    """The median of the :data:`BEFORE_STEPS` steps before ``apply_step`` (None: none known)."""
    before = [steps[s][0] for s in range(apply_step - BEFORE_STEPS, apply_step) if s in steps]
    return statistics.median(before) if before else None


def predicted_step_s(plan: Plan, before_s: float | None) -> float | None:
    """The step time ``plan`` predicts on the observed scale: its own estimate, or, for a model
    that only knows relative gains (``baseline_step_s``), that gain applied to ``before_s`` -
    the same reading the ski-rental planner buys by."""
    if plan.step_time_s is None:
        return None
    if plan.baseline_step_s and before_s is not None:
        return before_s * plan.step_time_s / plan.baseline_step_s
    return plan.step_time_s


@dataclass(frozen=True)
class Outcome:
    """A plan's measured effect, beside what it predicted."""

    apply_step: int
    before_s: float | None
    predicted_s: float | None
    measured_s: float
    verdict: str
    """``"pays"``, ``"short"`` (saved less than :data:`PAYS_SHARE` of the prediction) or
    ``"unknown"`` (nothing to compare with)."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(before_s: float | None, predicted_s: float | None, measured_s: float) -> tuple[str, str]:
    """``(verdict, reason)`` for a plan that measured ``measured_s`` per step after
    ``before_s``, having predicted ``predicted_s``."""
    if before_s is None:
        return "unknown", f"measured {measured_s:.3f} s per step; nothing to compare with"
    if predicted_s is None:
        return "unknown", (
            f"measured {measured_s:.3f} s per step against {before_s:.3f} s before (no prediction)"
        )
    promised = before_s - predicted_s
    saved = before_s - measured_s
    text = (
        f"measured {measured_s:.3f} s per step against {before_s:.3f} s before and "
        f"{predicted_s:.3f} s predicted"
    )
    if promised <= 0.0:
        return "unknown", text + " (it predicted no saving)"
    if saved < PAYS_SHARE * promised:
        return "short", f"{text}: saved {saved:.3f} s of the {promised:.3f} s it promised"
    return "pays", f"{text}: saved {saved:.3f} s of the {promised:.3f} s it promised"


@dataclass
class Awaited:
    """A committed plan waiting for the ranks' reports."""

    action: Any
    """The mitigator's :class:`~failslow.core.control.mitigator.Action`."""
    epoch: int
    apply_step: int
    passed_wall: float | None = None
    """When rank 0 was first seen past the apply step (its step time known)."""


@dataclass
class Watched:
    """A plan in effect whose step time is being measured."""

    action: Any
    apply_step: int
    before_s: float | None
    predicted_s: float | None


@dataclass
class Kept:
    """A plan that paid, watched after its verdict, window by window."""

    action: Any
    apply_step: int
    before_s: float | None
    predicted_s: float | None
    verdict_s: float
    """What it measured at its verdict."""
    next_step: int
    """The first step of its next window."""
    strikes: int = 0
    """Windows in a row that fell short."""
    short: list[float] = field(default_factory=list)
    """Those windows' medians."""


class ClosedLoop:
    """The committed plans awaiting their effect and the plans in effect awaiting their
    outcome. ``world_size()`` is the job's now (a job that went on with fewer ranks counts
    those)."""

    def __init__(
        self,
        store: Store,
        *,
        world_size: Callable[[], int],
        prefix: str = keys.PLANS,
        grace_s: float = 10.0,
        keep_steps: int = KEEP_STEPS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.world_size = world_size
        self.prefix = prefix
        self.grace_s = grace_s
        """How long after rank 0 passed a plan's apply step every rank must have reported
        (their poll threads send within a poll or two; generous for loaded machines)."""
        self.keep_steps = keep_steps
        """Steps per window of a kept plan (0: plans are not watched after their verdict)."""
        self._clock = clock
        self.awaiting: list[Awaited] = []
        self.watching: list[Watched] = []
        self.kept: list[Kept] = []

    def committed(self, action: Any, epoch: int, apply_step: int) -> None:
        """``action``'s plan was committed as plan ``epoch``, to take effect at ``apply_step``."""
        self.awaiting.append(Awaited(action, epoch, apply_step))

    def effects(self, steps: StepTimes) -> list[tuple[Awaited, str, str]]:
        """The plans whose effect is known now: ``(awaited, "in effect" | "not in effect",
        reason)``, each once."""
        done = []
        world = None
        for awaited in list(self.awaiting):
            if world is None:
                world = self.world_size()
            effect = read_effect(self.store, awaited.epoch, prefix=self.prefix)
            state, why = effect.state(world), effect.why
            if state == "pending":
                if awaited.passed_wall is None:
                    passed = [wall for s, (_, wall) in steps.items() if s >= awaited.apply_step]
                    awaited.passed_wall = min(passed) if passed else None
                if awaited.passed_wall is None or (
                    self._clock() - awaited.passed_wall < self.grace_s
                ):
                    continue
                state = PlanResult.NOT_IN_EFFECT
                why = (
                    f"only {effect.ran} of {world} ranks reported running it {self.grace_s:g} s "
                    f"after step {awaited.apply_step}"
                )
            self.awaiting.remove(awaited)
            done.append((awaited, state, why))
        return done

    def watch(
        self, action: Any, apply_step: int, steps: StepTimes, *, before_s: float | None = None
    ) -> Watched:
        """Measure the outcome of ``action``'s plan, in effect from ``apply_step``, against
        ``before_s`` (default: the steps right before it; a re-plan's is its strategy's
        before it was bought - it is judged as the strategy, not as a step from the plan it
        replaced)."""
        before = before_s if before_s is not None else median_before(steps, apply_step)
        watched = Watched(action, apply_step, before, predicted_step_s(action.plan, before))
        self.watching.append(watched)
        return watched

    def outcomes(self, steps: StepTimes) -> list[tuple[Watched, Outcome]]:
        """The watched plans whose :data:`OUTCOME_STEPS` steps are all known now, each once."""
        done = []
        for watched in list(self.watching):
            first = watched.apply_step + OUTCOME_FIRST
            window = range(first, first + OUTCOME_STEPS)
            if not all(s in steps for s in window):
                continue
            measured = statistics.median(steps[s][0] for s in window)
            verdict, reason = judge(watched.before_s, watched.predicted_s, measured)
            self.watching.remove(watched)
            outcome = Outcome(
                watched.apply_step, watched.before_s, watched.predicted_s, measured, verdict,
                reason,
            )  # fmt: skip
            done.append((watched, outcome))
        return done

    def keep(self, watched: Watched, outcome: Outcome) -> Kept | None:
        """Go on watching ``watched``'s plan after ``outcome`` (it paid): from the step after
        its outcome window, against the same before-time and prediction (None: not watched,
        ``keep_steps`` is 0)."""
        if self.keep_steps <= 0:
            return None
        kept = Kept(
            watched.action, watched.apply_step, outcome.before_s, outcome.predicted_s,
            outcome.measured_s, watched.apply_step + OUTCOME_FIRST + OUTCOME_STEPS,
        )  # fmt: skip
        self.kept.append(kept)
        return kept

    def drifts(self, steps: StepTimes) -> list[tuple[Kept, Outcome]]:
        """The kept plans that stopped paying: :data:`KEEP_STRIKES` complete windows of
        :attr:`keep_steps` in a row whose median :func:`judge` calls short. Each once, with an
        outcome of verdict :data:`STOPPED_PAYING` measured over the last window; no longer
        kept. O(plans kept) per call, each window's steps read once."""
        done = []
        for kept in list(self.kept):
            window = range(kept.next_step, kept.next_step + self.keep_steps)
            while all(s in steps for s in window):
                measured = statistics.median(steps[s][0] for s in window)
                verdict, reason = judge(kept.before_s, kept.predicted_s, measured)
                kept.next_step += self.keep_steps
                if verdict != "short":
                    kept.strikes, kept.short = 0, []
                else:
                    kept.strikes += 1
                    kept.short.append(measured)
                if kept.strikes >= KEEP_STRIKES:
                    self.kept.remove(kept)
                    first = kept.next_step - KEEP_STRIKES * self.keep_steps
                    why = (
                        f"{reason} over steps {first}-{kept.next_step - 1} "
                        f"(medians {', '.join(f'{m:.3f}' for m in kept.short)} s), after "
                        f"{kept.verdict_s:.3f} s at its verdict"
                    )
                    outcome = Outcome(
                        kept.apply_step, kept.before_s, kept.predicted_s, measured,
                        STOPPED_PAYING, why,
                    )  # fmt: skip
                    done.append((kept, outcome))
                    break
                window = range(kept.next_step, kept.next_step + self.keep_steps)
        return done

    def unmeasured(self, before_step: int | None = None) -> list[Watched]:
        """Stop watching the plans whose window is not complete before ``before_step`` (a
        newer plan's apply step, a restart's; None: all of them - the fail-slow is over): their
        steps from then on are another plan's or a healthy job's, no outcome of theirs. Returns
        them, each once, for the record. The kept plans in effect before ``before_step`` are
        no longer kept (they have their outcome)."""
        self.kept = [
            k for k in self.kept if before_step is not None and k.apply_step >= before_step
        ]
        gone = [
            w for w in self.watching
            if before_step is None or before_step < w.apply_step + OUTCOME_FIRST + OUTCOME_STEPS
        ]  # fmt: skip
        self.watching = [w for w in self.watching if w not in gone]
        return gone
