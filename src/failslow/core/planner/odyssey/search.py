"""Execution-plan search for dynamic parallelism (odyssey IV-A, Algorithm 1).

``get_parallel_strategy`` enumerates candidate layouts: a DP degree from a window around the
old one (the paper: the new DP degree rarely differs by 2 or more) and the pipeline lengths
as an integer partition of the node count. For each candidate, ``split_layers`` picks each
pipeline's layer split (even split, every placement of the remainder, plus an extras-aware
min-max split; OOM-filtered by Eq. 14; fastest by the estimator), ``distribute_batch``
balances micro-batches across pipelines, and the time estimator (Eq. 10-11 plus the coloured
DP synchronisation) scores it. The fastest candidate wins.

Deviation, stated: Algorithm 1 distributes the batch before splitting layers; here layers are
split first (with the node-proportional batch share as the estimate) so that the batch can be
balanced on the pipelines' real per-micro-batch times rather than their node counts.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from failslow.core.planner.allocation import allocate_microbatches
from failslow.core.planner.odyssey.memory import fits_in_memory, peak_memory
from failslow.core.planner.odyssey.model import ModelProfile
from failslow.core.planner.odyssey.step_time import pipeline_time, step_time_plan
from failslow.errors import ConfigError, FailslowError


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """A dynamic-parallelism plan: each pipeline's layers per stage and micro-batches."""

    pipelines: tuple[tuple[int, ...], ...]
    micro_batches: tuple[int, ...]
    step_time_s: float
    peak_memory_bytes: float

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def nodes(self) -> int:
        return sum(len(p) for p in self.pipelines)

    @property
    def is_symmetric(self) -> bool:
        return len(set(self.pipelines)) == 1


def integer_partition(
    total: int, parts: int, lengths: tuple[int, int], *, max_spread: int | None = None
) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` pipeline lengths in ``[lo, hi]``.

    Lengths are returned non-increasing (pipelines are interchangeable); ``max_spread`` bounds
    longest minus shortest (None: no bound).
    """
    lo, hi = max(lengths[0], 1), lengths[1]
    out: list[tuple[int, ...]] = []
    if parts < 1 or lo > hi:
        return out

    def fill(values: list[int], k: int, left: int, prefix: tuple[int, ...]) -> None:
        # ``values`` longest first; choose how many pipelines get values[0]. Depth is the
        # number of distinct lengths, never the number of pipelines.
        v = values[0]
        if len(values) == 1:
            if k >= 1 and left == k * v:
                out.append(prefix + (v,) * k)
            return
        shortest, next_longest = values[-1], values[1]
        for c in range(min(k, left // v), -1, -1):
            k2, left2 = k - c, left - c * v
            if k2 * shortest <= left2 <= k2 * next_longest:
                fill(values[1:], k2, left2, prefix + (v,) * c)

    # The shortest length is fixed and used at least once, so each partition appears once.
    for shortest in range(lo, hi + 1):
        top = hi if max_spread is None else min(hi, shortest + max_spread)
        fill(list(range(top, shortest - 1, -1)), parts, total, ())
    return out


def get_parallel_strategy(
    nodes: int,
    *,
    dp_range: tuple[int, int],
    pp_range: tuple[int, int],
    max_length_spread: int | None = 2,
    max_idle_nodes: int = 0,
) -> list[tuple[int, ...]]:
    """Candidate layouts (Alg. 1, lines 1-7): pipeline lengths using ``nodes - i`` nodes for
    ``i`` in ``[0, max_idle_nodes]``, DP degree in ``dp_range``, each length in ``pp_range``.

    ``max_length_spread`` limits how much pipelines may differ in length; it bounds the search
    at thousands of nodes (the paper limits its ranges for the same reason).
    """
    out: list[tuple[int, ...]] = []
    for used in range(nodes, max(nodes - max_idle_nodes, 1) - 1, -1):
        for dp in range(max(dp_range[0], 1), dp_range[1] + 1):
            out += integer_partition(used, dp, pp_range, max_spread=max_length_spread)
    return out


def distribute_batch(total: int, times_per_microbatch: Sequence[float]) -> list[int]:
    """Micro-batches per pipeline (Alg. 1 line 13): at least one each, slowest pipeline's
    ``count * time`` minimal (the allocator of greyhound S2)."""
    if total < len(times_per_microbatch):
        raise FailslowError(
            f"odyssey: {total} micro-batches cannot feed {len(times_per_microbatch)} pipelines"
        )
    return allocate_microbatches(times_per_microbatch, total, minimum=1)


def _splits_to_try(
    profile: ModelProfile, num_stages: int, max_enumerated: int
) -> Iterator[tuple[int, ...]]:
    base, rest = divmod(profile.num_layers, num_stages)
    if math.comb(num_stages, rest) <= max_enumerated:
        for extra in itertools.combinations(range(num_stages), rest):
            chosen = set(extra)
            yield tuple(base + (s in chosen) for s in range(num_stages))
    greedy = _minmax_split(profile, num_stages)
    if greedy is not None:
        yield greedy


def _minmax_split(profile: ModelProfile, num_stages: int) -> tuple[int, ...] | None:
    """One layer per stage, then each further layer to the stage that stays fastest with it
    (and still fits): the min-max split when the first/last stages carry extra work."""
    layers = [1] * num_stages
    per_layer = profile.forward_s + profile.backward_s

    def cost(s: int) -> float:
        extra = profile.stage_forward_s(0, s, num_stages) + profile.stage_backward_s(
            0, s, num_stages
        )
        return (layers[s] + 1) * per_layer + extra

    heap = [(cost(s), s) for s in range(num_stages)]
    heapq.heapify(heap)
    for _ in range(profile.num_layers - num_stages):
        while heap:
            _, s = heapq.heappop(heap)
            layers[s] += 1
            if fits_in_memory(profile, layers):
                heapq.heappush(heap, (cost(s), s))
                break
            layers[s] -= 1  # this stage is full; drop it from the heap
        else:
            return None
    return tuple(layers)


def split_layers(
    profile: ModelProfile, num_stages: int, micro_batches: int, *, max_enumerated: int = 1024
) -> tuple[int, ...] | None:
    """Layers per stage of one pipeline (Alg. 1 line 14), or None when nothing fits.

    Candidates: the even split with every placement of the remainder (one extra layer per
    stage; skipped when there are more than ``max_enumerated`` placements) and the
    extras-aware min-max split. Those that pass the Eq. 14 OOM filter are scored by
    :func:`pipeline_time` at ``micro_batches``; ties go to the lower peak memory.
    """
    if num_stages < 1 or num_stages > profile.num_layers:
        return None
    best: tuple[float, float, tuple[int, ...]] | None = None
    for split in _splits_to_try(profile, num_stages, max_enumerated):
        if not fits_in_memory(profile, split):
            continue
        key = (pipeline_time(profile, split, micro_batches), peak_memory(profile, split), split)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def bottleneck_s(profile: ModelProfile, split: Sequence[int]) -> float:
    """Forward plus backward time of the slowest stage for one micro-batch."""
    n = len(split)
    return max(
        profile.stage_forward_s(layers, s, n) + profile.stage_backward_s(layers, s, n)
        for s, layers in enumerate(split)
    )


def evaluate_candidate(
    profile: ModelProfile,
    lengths: Sequence[int],
    global_batch_microbatches: int,
    *,
    max_enumerated: int = 1024,
    _splits: dict[tuple[int, int], tuple[int, ...] | None] | None = None,
) -> ExecutionPlan | None:
    """Alg. 1 lines 13-15 for one candidate (pipeline lengths): None if it cannot run."""
    total = global_batch_microbatches
    if len(lengths) > total:
        return None
    nodes = sum(lengths)
    cache = {} if _splits is None else _splits
    splits: list[tuple[int, ...]] = []
    for length in lengths:
        hint = max(1, round(total * length / nodes))
        key = (length, hint)
        if key not in cache:
            cache[key] = split_layers(profile, length, hint, max_enumerated=max_enumerated)
        split = cache[key]
        if split is None:
            return None
        splits.append(split)
    times = [bottleneck_s(profile, s) for s in splits]
    if min(times) <= 0:  # a model profiled at zero time: balance by node count
        times = [1.0 / len(s) for s in splits]
    batch = distribute_batch(total, times)
    return ExecutionPlan(
        pipelines=tuple(splits),
        micro_batches=tuple(batch),
        step_time_s=step_time_plan(profile, splits, batch),
        peak_memory_bytes=max(peak_memory(profile, s) for s in splits),
    )


def search_execution_plan(
    profile: ModelProfile,
    nodes: int,
    *,
    global_batch_microbatches: int,
    dp_range: tuple[int, int],
    pp_range: tuple[int, int] | None = None,
    max_length_spread: int | None = 2,
    max_idle_nodes: int = 0,
    max_enumerated_splits: int = 1024,
) -> ExecutionPlan:
    """Algorithm 1 (``get_execution_plan``): the candidate with the lowest estimated step time.

    ``nodes`` healthy nodes; ``global_batch_microbatches`` is the global batch in micro-batches
    (all pipelines together); ``pp_range`` defaults to ``(1, num_layers)``. Ties go to the
    plan listed first (more nodes used, smaller DP). Raises :class:`FailslowError` when no
    candidate can run, naming why.
    """
    if not isinstance(nodes, int) or nodes < 1:
        raise FailslowError(f"odyssey: no nodes left to train on (nodes = {nodes!r})")
    if not isinstance(global_batch_microbatches, int) or global_batch_microbatches < 1:
        raise ConfigError(
            "odyssey: global_batch_microbatches must be a positive integer, "
            f"got {global_batch_microbatches!r}"
        )
    lo, hi = pp_range if pp_range is not None else (1, profile.num_layers)
    pp_range = (max(lo, 1), min(hi, profile.num_layers))
    if dp_range[0] > dp_range[1] or pp_range[0] > pp_range[1]:
        raise ConfigError(f"odyssey: empty range dp {dp_range} or pp {pp_range}")
    candidates = get_parallel_strategy(
        nodes,
        dp_range=dp_range,
        pp_range=pp_range,
        max_length_spread=max_length_spread,
        max_idle_nodes=max_idle_nodes,
    )
    if not candidates:
        raise FailslowError(
            f"odyssey: {nodes} nodes admit no layout with DP in {dp_range} and pipeline "
            f"lengths in {pp_range}"
        )
    splits: dict[tuple[int, int], tuple[int, ...] | None] = {}
    best: ExecutionPlan | None = None
    for lengths in candidates:
        plan = evaluate_candidate(
            profile,
            lengths,
            global_batch_microbatches,
            max_enumerated=max_enumerated_splits,
            _splits=splits,
        )
        if plan is not None and (best is None or plan.step_time_s < best.step_time_s):
            best = plan
    if best is None:
        raise FailslowError(
            f"odyssey: none of {len(candidates)} layouts of {nodes} nodes can run "
            f"{global_batch_microbatches} micro-batches within "
            f"{profile.memory_capacity_bytes:.3g} bytes per device"
        )
    return best
