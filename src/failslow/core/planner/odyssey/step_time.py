"""Step time of a 1F1B pipeline: Eq. 9 (symmetric), Eq. 12-13 (data rerouting) and the
dynamic-programming simulation of Eq. 10-11 (asymmetric pipelines), odyssey IV-C.

All times are seconds. ``micro_batches`` is ``N_m``, the micro-batches one pipeline (one DP
replica) runs per step. None of the closed forms includes DP gradient synchronisation or the
optimizer step; :func:`step_time_plan` adds the synchronisation of :mod:`.coloring`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from failslow.core.planner.odyssey.coloring import dp_sync_time
from failslow.core.planner.odyssey.model import ModelProfile
from failslow.errors import ConfigError, FailslowError


def step_time_1f1b(
    num_stages: int, micro_batches: int, forward_s: float, backward_s: float
) -> float:
    """Eq. 9: ``(N_pp + N_m - 1) * (Tf + Tb)``.

    ``forward_s``/``backward_s`` are one stage's forward/backward time for one micro-batch
    (every stage equal). Pipeline compute only: no p2p transfer, no DP all-reduce, no
    optimizer step.
    """
    _positive("num_stages", num_stages)
    _positive("micro_batches", micro_batches)
    return (num_stages + micro_batches - 1) * (forward_s + backward_s)


def step_time_reroute(
    num_stages: int,
    micro_batches: int,
    dp: int,
    failed_per_stage: Sequence[int],
    forward_s: float,
    backward_s: float,
) -> float:
    """Eq. 13: 1F1B step time when the survivors of each stage take the failed nodes' work.

    ``(N_pp + N_m - 1 + sum_i [F_i > 0] * N_m * F_i / (N_dp - F_i)) * (Tf + Tb)``, with
    ``failed_per_stage[i] = F_i`` and the per-stage times of Eq. 9. One failure is Eq. 12.
    Raises :class:`FailslowError` when a stage has lost all of its ``dp`` replicas (the paper:
    the training cannot be recovered by rerouting).
    """
    _positive("dp", dp)
    if len(failed_per_stage) != num_stages:
        raise ConfigError(
            f"odyssey: failed_per_stage has {len(failed_per_stage)} entries, "
            f"expected {num_stages} stages"
        )
    extra = 0.0
    for i, f in enumerate(failed_per_stage):
        if f < 0:
            raise ConfigError(f"odyssey: failed_per_stage[{i}] = {f} is negative")
        if f >= dp:
            raise FailslowError(
                f"odyssey: stage {i} lost {f} of its {dp} replicas; rerouting cannot recover it"
            )
        if f > 0:
            extra += micro_batches * f / (dp - f)
    return step_time_1f1b(num_stages, micro_batches, forward_s, backward_s) + extra * (
        forward_s + backward_s
    )


def simulate_1f1b(
    forward: Sequence[Sequence[float]],
    backward: Sequence[Sequence[float]],
    p2p_s: float = 0.0,
    *,
    slowdown: Sequence[float] | None = None,
) -> float:
    """Step time of one 1F1B pipeline by the dynamic programme of Eq. 11 (odyssey IV-C).

    ``forward[s][j]``/``backward[s][j]`` are stage ``s``'s forward/backward seconds for
    micro-batch ``j`` (all stages run the same micro-batches). Stage ``s`` of ``S`` runs
    ``min(S - s - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards. An operation starts when the previous operation of its
    stage ends and, per Eq. 11, when the same micro-batch has left the neighbouring stage
    (the previous stage for a forward, the next for a backward) plus ``p2p_s`` seconds of
    transfer. ``slowdown[s]`` multiplies every time of stage ``s`` (a fail-slow stage).

    Returns the time from the first forward's start to the last backward's end: pipeline
    compute and p2p only, no DP all-reduce, no optimizer step. Equals Eq. 9 for uniform times
    and ``p2p_s = 0``.
    """
    num_stages = len(forward)
    if len(backward) != num_stages:
        raise ConfigError(
            f"odyssey: forward has {num_stages} stages but backward has {len(backward)}"
        )
    if num_stages == 0:
        return 0.0
    m = len(forward[0])
    for s in range(num_stages):
        if len(forward[s]) != m or len(backward[s]) != m:
            raise ConfigError(
                f"odyssey: stage {s} has {len(forward[s])} forward and {len(backward[s])} "
                f"backward times, expected {m} of each"
            )
    if slowdown is None:
        factors: Sequence[float] = [1.0] * num_stages
    elif len(slowdown) != num_stages:
        raise ConfigError(
            f"odyssey: slowdown has {len(slowdown)} entries, expected {num_stages} stages"
        )
    else:
        factors = slowdown
    if any(f < 0 for f in factors) or p2p_s < 0:
        raise ConfigError("odyssey: slowdowns and p2p_s must be non-negative")
    if m == 0:
        return 0.0

    # Each stage's 1F1B order: (is_forward, micro-batch).
    orders: list[list[tuple[bool, int]]] = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, m)
        order = [(True, j) for j in range(warm)]
        for k in range(m - warm):
            order += [(True, warm + k), (False, k)]
        order += [(False, j) for j in range(m - warm, m)]
        orders.append(order)

    nan = math.nan
    f_end = [[nan] * m for _ in range(num_stages)]
    b_end = [[nan] * m for _ in range(num_stages)]
    clock = [0.0] * num_stages
    position = [0] * num_stages
    remaining = 2 * m * num_stages
    while remaining:
        progressed = False
        for s in range(num_stages):
            order = orders[s]
            while position[s] < len(order):
                is_fwd, j = order[position[s]]
                if is_fwd:
                    dep = f_end[s - 1][j] + p2p_s if s > 0 else 0.0
                else:
                    dep = b_end[s + 1][j] + p2p_s if s < num_stages - 1 else f_end[s][j]
                if math.isnan(dep):
                    break
                start = max(clock[s], dep)
                duration = (forward[s][j] if is_fwd else backward[s][j]) * factors[s]
                clock[s] = start + duration
                (f_end if is_fwd else b_end)[s][j] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B cannot deadlock
            raise RuntimeError("1F1B simulation made no progress")
    return max(clock)


def pipeline_time(
    profile: ModelProfile,
    layers_per_stage: Sequence[int],
    micro_batches: int,
    *,
    slowdown: Sequence[float] | None = None,
) -> float:
    """``t_p`` of one pipeline (Eq. 11) from the profile: stage times are layers x Tf/Tb plus
    the first/last stage extras, transfers take ``profile.p2p_s``."""
    n = len(layers_per_stage)
    fwd = [
        [profile.stage_forward_s(layers, s, n)] * micro_batches
        for s, layers in enumerate(layers_per_stage)
    ]
    bwd = [
        [profile.stage_backward_s(layers, s, n)] * micro_batches
        for s, layers in enumerate(layers_per_stage)
    ]
    return simulate_1f1b(fwd, bwd, profile.p2p_s, slowdown=slowdown)


def step_time_plan(
    profile: ModelProfile,
    pipelines: Sequence[Sequence[int]],
    micro_batches: Sequence[int],
    *,
    slowdowns: Mapping[tuple[int, int], float] | None = None,
) -> float:
    """Eq. 10 plus DP synchronisation: ``max_p t_p`` + the coloured all-reduce rounds.

    ``pipelines[p]`` is pipeline ``p``'s layers per stage, ``micro_batches[p]`` its
    micro-batches, ``slowdowns[(p, s)]`` an optional slowdown of stage ``s`` of pipeline ``p``.
    """
    if len(pipelines) != len(micro_batches):
        raise ConfigError(
            f"odyssey: {len(pipelines)} pipelines but {len(micro_batches)} micro-batch counts"
        )
    if not pipelines:
        raise FailslowError("odyssey: an execution plan needs at least one pipeline")
    slow = slowdowns or {}
    cache: dict[tuple[tuple[int, ...], int, tuple[float, ...]], float] = {}
    worst = 0.0
    for p, (split, m) in enumerate(zip(pipelines, micro_batches, strict=True)):
        factors = tuple(slow.get((p, s), 1.0) for s in range(len(split)))
        key = (tuple(split), m, factors)
        if key not in cache:
            cache[key] = pipeline_time(profile, split, m, slowdown=factors)
        worst = max(worst, cache[key])
    return worst + dp_sync_time(profile, pipelines)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"odyssey: {name} must be a positive integer, got {value!r}")
