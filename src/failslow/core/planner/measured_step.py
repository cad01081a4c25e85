"""An S2 plan's step time from what the ranks measured (greyhound 5.2; odyssey IV's per-replica
step model with the parts measured instead of profiled).

Under a micro-batch plan, DP replica ``r`` runs ``m_r`` micro-batches. The replicas meet twice
per step: at the gradient reduction, which the slowest replica's micro-batches decide, and
(ZeRO, distributed optimizers, FSDP's next all-gather) after the optimizer step, which the
slowest optimizer decides. So the step is ``max_r (rest_r + m_r * t_r) + max_r post_r``:
``t_r`` the replica's time per micro-batch, ``rest_r`` the rest of its step before the
optimizer (the last backward, the reduction; on a pipeline its fill and drain), ``post_r`` the
optimizer step on. All come from the ranks' step profiles
(:class:`failslow.runtime.step_profile.StepProfile`, published in their progress records):

- a replica with a diagnosed rank runs as it does now: its time per call, rest and post over its
  last few steps (it is the slowest, so its steps hold no wait for another replica; its longer
  window may still hold steps from before the slowdown);
- every other replica runs like one healthy representative: its rest and optimizer part from
  its newest block of steps before the slowdown (the profile's ``blocks``, the one whose step
  was the job's healthy step: its recent steps include the waits for the slowed one), else the
  low quantiles of its long window; its time per call its recent one - or, where the slowed
  replica is a single rank, the block's (on ranks that share cores a replica's speed depends
  on how busy the others are: a throttled rank frees nothing under a plan, so every rank is as
  busy as before the slowdown, while a slowed pipeline's other stages idle with it under a
  plan as they do now; on dedicated devices the two are the same).

In S2's size form (the Trainer, Lightning: every replica runs the loop's micro-batches and a
plan changes how many samples they hold) a micro-batch's time is not proportional to its
samples: a part per call does not shrink (30% of a micro-batch on the Trainer and Lightning
demos). One count cannot tell the two apart, so until a replica measured a second count its
cost per unit is a linear guess (:attr:`MeasuredSteps.calibrated` False), the planner's first
plan is a probe (:func:`failslow.core.planner.planner.probe_counts`), and what the replica
measures under it gives its part per call and per unit (:func:`_size_fit`): the split is then
sized from two measured counts.

Replica times scatter from step to step and every step waits for the slowest, so the
reduction comes at the *expected maximum* of the replicas' times (:func:`expected_max`, with
the spread each profile measured, the micro-batches' part of it scaled to the new count as a
sum of independent micro-batches): above the largest mean when a plan balances the
replicas, as S2 plans do.

Where the optimizer step is close to free and local (DDP), the second meeting does not exist,
and the model errs high by the slowed replica's optimizer time.

The same model sizes the plan (:meth:`MeasuredSteps.best_counts`): the counts that minimize
``max_r (rest_r + m_r t_r)``, from what each replica's step measured. The validation GEMM's
slowdown is only the first guess, where no rank published a profile yet: it is not the job's
slowdown (the GEMM runs alone in a pause; a rank stopped 75% of every 20 ms fits a short GEMM
into its running quarter and showed 2.4x where its training ran 4x slower).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from failslow.core.topology import Topology


@dataclass(frozen=True)
class ReplicaStep:
    """One replica's step as a function of its micro-batch count."""

    per_microbatch_s: float
    rest_s: float
    """Before the optimizer step, beyond the micro-batches."""
    post_s: float = 0.0
    """From the optimizer step to the next step."""
    rest_var: float = 0.0
    """Step-to-step variance of the part before the optimizer beyond the micro-batches (s^2)."""
    per_microbatch_var: float = 0.0
    """Step-to-step variance of the micro-batches' time, per micro-batch (s^2)."""
    linear_guess: bool = False
    """S2's size form before a second count was measured: the time per unit is the step's
    micro-batches over its units, as if a micro-batch's time were proportional to its
    samples (it is not: see :func:`_size_fit`)."""

    def until_optimizer_s(self, microbatches: int) -> float:
        return self.rest_s + microbatches * self.per_microbatch_s

    def until_optimizer_sd(self, microbatches: int) -> float:
        return math.sqrt(self.rest_var + microbatches * self.per_microbatch_var)


HEALTHY_BLOCK = 1.1
"""A block of a waiting replica's steps is from before the slowdown when its median step is
within this factor of the job's healthy step."""


def _healthy_block(profile: Mapping[str, Any], healthy_step_s: float | None) -> list[Any] | None:
    """The newest block of ``profile["blocks"]`` (``[steps, calls, spacing, rest, post, step,
    units]``) measured before the slowdown: its median step within :data:`HEALTHY_BLOCK` of
    ``healthy_step_s``, with its count recorded (its time per unit is its own)."""
    if not healthy_step_s or healthy_step_s <= 0:
        return None
    try:
        for block in reversed(profile.get("blocks") or []):
            steps, step, units = int(block[0]), float(block[5]), block[6]
            if steps > 0 and isinstance(units, int) and units > 0:
                if 0 < step <= HEALTHY_BLOCK * healthy_step_s:
                    return list(block)
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    return None


def _size_fit(
    profile: Mapping[str, Any], now: tuple[float, float, float]
) -> tuple[float, float] | None:
    """S2's size form: a replica's ``(per unit, fixed)`` until its optimizer step, from two
    counts it ran - ``now`` (``calls``, ``spacing``, ``rest`` of its last steps, at its
    ``units``) and its newest block at another count with the same calls. A micro-batch's time
    is not proportional to its samples (a part per call does not shrink with them: 30% of a
    micro-batch on the Trainer and Lightning demos), so one count cannot tell the two apart.

    The line is fitted to the time per call (its own work where the adapter stamps it); the
    rest is the one measured at the larger of the two counts, where the replica was the
    slowest and waited for no one (at the smaller it may wait for the others: Lightning meets
    them before every micro-batch). None without such a block, or where the two do not fit a
    rising line."""
    calls, spacing, rest = now
    units = profile.get("units")
    if not isinstance(units, int) or units <= 0:
        return None
    try:
        for block in reversed(profile.get("blocks") or []):
            if len(block) < 7 or int(block[1]) != int(calls):
                continue
            other = block[6]
            if not isinstance(other, int) or other <= 0 or other == units:
                continue
            per_call_unit = (float(block[2]) - spacing) / (other - units)
            if per_call_unit <= 0:
                return None
            per_call = max(0.0, spacing - units * per_call_unit)
            slowest_rest = float(block[3]) if other > units else rest
            return calls * per_call_unit, slowest_rest + calls * per_call
    except (IndexError, TypeError, ValueError):
        return None
    return None


def _part(
    record: Mapping[str, Any] | None,
    now_count: int,
    *,
    waits: bool,
    healthy_step_s: float | None = None,
    busy_before: bool = False,
) -> ReplicaStep | None:
    profile = (record or {}).get("profile")
    if not profile or now_count <= 0:
        return None
    # a diagnosed replica's parts as they are now (its window may still hold healthy steps:
    # the onset came a few steps ago); a waiting one's own rest and optimizer from before the
    # slowdown: the medians of its newest block of healthy steps where the job's healthy step
    # is known (typical parts), else the low quantiles of its long window. Its time per
    # micro-batch is its recent one, or with ``busy_before`` the block's: on ranks that share
    # cores it depends on how busy the others are, and under a plan a slowed replica of one
    # rank frees nothing (it ran throttled before too: the machine is as busy as before the
    # slowdown), where a slowed replica's other ranks (pipeline stages, shards) idle with it
    # under a plan as they do now - on dedicated devices the two are the same
    now = "" if waits or "spacing_now" not in profile else "_now"
    block = _healthy_block(profile, healthy_step_s) if waits else None
    try:
        calls, spacing = float(profile["calls"]), float(profile["spacing" + now])
        rest = float(profile["rest_low" if waits else "rest" + now])
        post = float(profile.get("post_low" if waits else "post" + now, 0.0))
        per_unit = calls / now_count * spacing
        if block is not None:  # its own rest and optimizer, typical (the quantile is low)
            rest, post = float(block[3]), float(block[4])
            if busy_before:  # and its time per unit from when every rank was busy
                per_unit = float(block[1]) * float(block[2]) / int(block[6])
        work_sd = float(profile.get("work_sd", 0.0))
        pre_sd = float(profile.get("pre_sd", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    if calls <= 0 or spacing <= 0 or rest < 0 or post < 0 or not min(work_sd, pre_sd) >= 0:
        return None
    guess = False
    if not waits and profile.get("by_size"):  # the size form: a part per call, measured
        fit = _size_fit(profile, (calls, spacing, rest))
        if fit is not None:
            per_unit, rest = fit
        guess = fit is None
    return ReplicaStep(
        per_microbatch_s=per_unit,
        rest_s=rest,
        post_s=post,
        # a waiting replica's spread before the optimizer is mostly the wait: its own
        # micro-batches' spread only; the slowed replica's rest scatters too
        rest_var=0.0 if waits else max(0.0, pre_sd**2 - work_sd**2),
        per_microbatch_var=work_sd**2 / now_count,
        linear_guess=guess,
    )


_STANDARD = NormalDist()


def expected_max(parts: Sequence[tuple[float, float]]) -> float:
    """E[max] of independent normal times ``(mean, sd)``, by Clark's moment matching (Clark
    1961, "The greatest of a finite set of random variables"): pairwise, the max of two normals
    replaced by the normal with its first two moments. Equal to ``max(means)`` when every sd
    is 0; above it when the largest means are close and scatter."""
    mean, var = parts[0][0], parts[0][1] ** 2
    for m2, s2 in parts[1:]:
        theta = math.sqrt(var + s2 * s2)
        if theta <= 1e-12 * max(abs(mean), abs(m2), 1e-12):
            mean, var = max(mean, m2), 0.0
            continue
        a = (mean - m2) / theta
        p, q, d = _STANDARD.cdf(a), _STANDARD.cdf(-a), _STANDARD.pdf(a)
        first = mean * p + m2 * q + theta * d
        second = (mean * mean + var) * p + (m2 * m2 + s2 * s2) * q + (mean + m2) * theta * d
        mean, var = first, max(0.0, second - first * first)
    return mean


@dataclass(frozen=True)
class MeasuredSteps:
    """Per-replica step models; :meth:`step_s` is a plan's step time."""

    replicas: tuple[ReplicaStep, ...]

    @property
    def calibrated(self) -> bool:
        """False where a replica's cost per unit is the size form's linear first guess: a
        plan sized from it is a probe, and the counts come from what it measures."""
        return not any(r.linear_guess for r in self.replicas)

    def step_s(self, counts: Sequence[int]) -> float:
        """The expected step under ``counts``: the expected slowest replica at the reduction
        (:func:`expected_max`), then the slowest optimizer part."""
        parts = [
            (r.until_optimizer_s(m), r.until_optimizer_sd(m))
            for r, m in zip(self.replicas, counts, strict=True)
        ]
        return expected_max(parts) + max(r.post_s for r in self.replicas)

    def best_counts(self, total: int, *, multiple_of: int = 1, minimum: int = 1) -> tuple[int, ...]:
        """The counts (multiples of ``multiple_of``, each at least ``minimum``, summing to
        ``total``) that minimize ``max_r (rest_r + m_r t_r)``, exactly, and among those the
        closest to the even split (moving micro-batches has costs the model does not see: on
        shared machines the receivers slow down).

        Units of ``u = multiple_of`` micro-batches: the ``K`` units beyond the minimum go, one
        by one, to the replica that would finish its next unit first. The finish times
        ``rest_r + k u t_r`` rise with ``k``, so that takes the ``K`` smallest of them, and
        the ``K``-th, ``T*``, is a lower bound on any allocation's slowest replica (greyhound
        Eq. 1 with each replica's measured fixed part). Then each replica may run up to
        ``cap_r`` units within ``T*``, and the counts are ``clip(lam, low, cap_r)`` for the
        largest ``lam`` that does not overshoot, the rest one unit each to the replicas with
        room, the fastest first. O(K log D) for ``K`` units."""
        unit = max(1, multiple_of)
        low = max(minimum, unit)
        low -= low % unit
        d = len(self.replicas)
        if total % unit or total < d * low:
            raise ValueError(
                f"best_counts: {total} micro-batches do not split into multiples of {unit} with "
                f"at least {low} for each of {d} replicas"
            )
        units, low_units = total // unit, low // unit
        counts = [low_units] * d
        heap = [
            (r.until_optimizer_s((low_units + 1) * unit), i) for i, r in enumerate(self.replicas)
        ]
        heapq.heapify(heap)
        optimum = max(r.until_optimizer_s(low) for r in self.replicas)
        for _ in range(units - d * low_units):
            finish, i = heapq.heappop(heap)
            optimum = max(optimum, finish)
            counts[i] += 1
            heapq.heappush(heap, (self.replicas[i].until_optimizer_s((counts[i] + 1) * unit), i))
        slack = optimum * (1.0 + 1e-12)
        caps = [
            max(low_units, int((slack - r.rest_s) / (unit * r.per_microbatch_s)))
            if r.per_microbatch_s > 0
            else units
            for r in self.replicas
        ]
        lam = low_units
        while lam < units and sum(min(max(lam + 1, low_units), c) for c in caps) <= units:
            lam += 1
        even = [min(max(lam, low_units), c) for c in caps]
        left = units - sum(even)
        for i in sorted(range(d), key=lambda i: (self.replicas[i].per_microbatch_s, i)):
            if left <= 0:
                break
            if even[i] < caps[i]:
                even[i] += 1
                left -= 1
        if left:  # float edge: keep the greedy's optimum
            even = counts
        return tuple(c * unit for c in even)

    @classmethod
    def from_records(
        cls,
        topology: Topology,
        counts_now: Sequence[int],
        records: Mapping[int, Mapping[str, Any] | None],
        diagnosed: Collection[int],
        *,
        healthy_step_s: float | None = None,
    ) -> MeasuredSteps | None:
        """From the progress records of the ``diagnosed`` ranks and one rank of a replica
        without any (``records`` by rank; see :func:`ranks_to_read`), with ``counts_now`` the
        counts the measurements ran under, ``healthy_step_s`` the job's step before the
        slowdown (where known: the healthy replica's parts come from its steps of then). None
        when a needed record has no profile."""
        slow = {topology.replica_of(r) for r in diagnosed}
        healthy = [r for r in records if topology.replica_of(r) not in slow]
        representative = None
        if healthy:
            rep = min(healthy)
            representative = _part(
                records[rep],
                counts_now[topology.replica_of(rep)],
                waits=True,
                healthy_step_s=healthy_step_s,
                busy_before=all(len(topology.replica_ranks(r)) == 1 for r in slow),
            )
        replicas: list[ReplicaStep] = []
        for replica in range(topology.dp):
            if replica not in slow:
                if representative is None:
                    return None
                replicas.append(representative)
                continue
            parts = [
                _part(records.get(r), counts_now[replica], waits=False)
                for r in diagnosed
                if topology.replica_of(r) == replica
            ]
            known = [p for p in parts if p is not None]
            if not known:
                return None
            m = counts_now[replica]
            replicas.append(max(known, key=lambda p: p.until_optimizer_s(m) + p.post_s))
        return cls(tuple(replicas))


def resized_step_s(
    profiles: Sequence[Mapping[str, Any] | None],
    old_counts: Sequence[int],
    new_counts: Sequence[int],
) -> tuple[float, float] | None:
    """The step of a data-parallel job before and after it went on with fewer replicas (odyssey
    Eq. 12-13, the survivors taking the lost replicas' micro-batches), from the old ranks' step
    profiles (one per old replica, their snapshots'): every replica like the median one, the
    reduction at the expected slowest. None without two measured profiles."""
    parts = [
        _part({"profile": p}, count, waits=True)
        for p, count in zip(profiles, old_counts, strict=True)
    ]
    known = sorted((p for p in parts if p is not None), key=lambda p: p.per_microbatch_s)
    if len(known) < 2:
        return None
    typical = known[len(known) // 2]
    before = MeasuredSteps((typical,) * len(old_counts)).step_s(old_counts)
    after = MeasuredSteps((typical,) * len(new_counts)).step_s(new_counts)
    return before, after


def ranks_to_read(topology: Topology, diagnosed: Collection[int]) -> list[int]:
    """The progress records :meth:`MeasuredSteps.from_records` needs: the diagnosed ranks and
    the lowest rank of a replica without one (O(diagnosed), not O(world))."""
    slow = {topology.replica_of(r) for r in diagnosed}
    ranks = sorted(set(diagnosed))
    for replica in range(topology.dp):
        if replica not in slow:
            ranks.append(min(topology.replica_ranks(replica)))
            break
    return ranks
