"""Odyssey's reroute-or-reconfigure for a framework that builds only rigid layouts (odyssey III
Eq. 8 with Algorithm 1's candidates restricted; Megatron-core's grid).

A Megatron-core job runs symmetric DP x PP grids with the layers split evenly over the stages,
at a fixed tensor-parallel degree; its replicas may run different micro-batch counts (S2's
weights keep the gradient). After ranks are lost with no standby left, the candidates are:

- **reroute**: the layout kept, the replicas that lost a rank dropped; the survivors take their
  micro-batches (odyssey Eq. 12-13 at the granularity of a pipeline: a replica missing a stage
  cannot run, so its other ranks stand by - as warm standbys for the next loss);
- **reconfigure**: every other grid ``pp' x dp'`` the survivors can fill, ``pp'`` dividing the
  layers and holding at most ``max_stage_layers`` layers per rank (the memory bound: Eq. 14
  with the model's per-layer memory, given here as a count of layers).

Each candidate's step comes from odyssey's estimator (Eq. 10-11: the 1F1B pipeline of the
most-loaded replica, :func:`~.step_time.pipeline_time`) with a per-layer time measured on the
old layout (its ranks' time per micro-batch over their stage's layers, forward:backward 1:2)
plus the optimizer's part, which scales with the layers a rank holds. Both options restart
from memory (the same restart), so Eq. 8's horizon cancels and the fastest step wins; ties go to
the reroute (no weights move). With no step measured (no rank's note has a profile) every
estimate is 0 and says nothing: the candidate that keeps the most ranks wins instead (ties,
again, the reroute) - a reroute would stand healthy ranks by on no evidence. O(divisors of the
layer count) candidates.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from failslow.core.planner.allocation import even_counts
from failslow.core.planner.odyssey.model import ModelProfile
from failslow.core.planner.odyssey.step_time import pipeline_time
from failslow.core.topology import Coord, megatron_rank
from failslow.errors import ConfigError, FailslowError


@dataclass(frozen=True, kw_only=True, slots=True)
class RigidJob:
    """The old layout and what its ranks measured."""

    tp: int
    dp: int
    pp: int
    num_layers: int
    micro_batches: int
    """M, the global batch in micro-batches (kept by the new layout)."""
    coords: tuple[Coord, ...]
    """Each old rank's ``(tp, dp, pp)``."""
    per_microbatch_s: float = 0.0
    """A stage's time per micro-batch in the 1F1B steady state (its forward and backward)."""
    post_s: float = 0.0
    """The optimizer's part of a step on one rank."""

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "num_layers", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"odyssey: {name} must be a positive integer, got {value!r}")
        if len(self.coords) != self.tp * self.dp * self.pp:
            raise ConfigError(
                f"odyssey: {len(self.coords)} coordinates for a {self.tp}x{self.dp}x{self.pp} grid"
            )
        if self.num_layers % self.pp:
            raise ConfigError(f"odyssey: {self.num_layers} layers do not split over {self.pp}")
        for name in ("per_microbatch_s", "post_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"odyssey: {name} must be >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RigidChoice:
    choice: str
    """``reroute`` or ``reconfigure``."""
    pp: int
    dp: int
    tp: int
    keep: tuple[int, ...]
    """The old ranks that go on, in their new rank order (Megatron's ``tp-dp-pp`` order)."""
    counts: tuple[int, ...]
    """Micro-batches per new replica."""
    step_time_s: float
    before_s: float
    """The old layout's step, by the same estimator."""
    alternatives: dict[str, float] = field(default_factory=dict)
    """Every candidate's estimated step, by ``PPxDP`` name."""

    @property
    def name(self) -> str:
        return f"PP{self.pp}xDP{self.dp}"


def _estimate(job: RigidJob, pp: int, dp: int) -> float:
    layers = job.num_layers // pp
    per_layer = job.per_microbatch_s / (job.num_layers // job.pp)
    profile = ModelProfile(
        num_layers=job.num_layers, forward_s=per_layer / 3, backward_s=2 * per_layer / 3
    )
    slowest = max(even_counts(job.micro_batches, dp))
    optimizer = job.post_s * layers / (job.num_layers // job.pp)
    return pipeline_time(profile, (layers,) * pp, slowest) + optimizer


def choose_rigid_layout(
    job: RigidJob,
    lost: Collection[int],
    *,
    min_ranks: int = 1,
    max_stage_layers: int | None = None,
) -> RigidChoice:
    """The layout the job goes on in after losing old ranks ``lost``: the fastest candidate
    (see the module), at least ``min_ranks`` ranks. FailslowError when none can run."""
    gone = set(lost)
    unknown = gone - set(range(len(job.coords)))
    if not gone or unknown:
        raise ConfigError(f"odyssey: lost ranks {sorted(gone)} are not ranks of the old layout")
    survivors = [r for r in range(len(job.coords)) if r not in gone]
    cap = job.num_layers if max_stage_layers is None else max_stage_layers
    broken = {job.coords[r][1] for r in gone}
    candidates: list[tuple[float, int, str, int, int]] = []
    if len(broken) < job.dp and job.num_layers // job.pp <= cap:
        dp = job.dp - len(broken)
        candidates.append((_estimate(job, job.pp, dp), 0, "reroute", job.pp, dp))
    for pp in range(1, job.num_layers + 1):
        if job.num_layers % pp or job.num_layers // pp > cap:
            continue
        dp = min(len(survivors) // (pp * job.tp), job.micro_batches)
        if dp < 1 or dp * pp * job.tp < min_ranks:
            continue
        if candidates and (pp, dp) == candidates[0][3:]:
            continue  # the reroute's own grid
        candidates.append((_estimate(job, pp, dp), 1, "reconfigure", pp, dp))
    candidates = [c for c in candidates if c[3] * c[4] * job.tp >= min_ranks]
    if not candidates:
        raise FailslowError(
            f"odyssey: {len(survivors)} ranks admit no {job.num_layers}-layer layout at TP "
            f"{job.tp} with at least {min_ranks} ranks and at most {cap} layers per rank"
        )
    if job.per_microbatch_s > 0:
        step, _, choice, pp, dp = min(candidates)
    else:  # nothing measured: keep the most ranks
        step, _, choice, pp, dp = min(candidates, key=lambda c: (-c[3] * c[4], c[1]))
    return RigidChoice(
        choice=choice,
        pp=pp,
        dp=dp,
        tp=job.tp,
        keep=_keep(job, survivors, broken if choice == "reroute" else set(), pp, dp),
        counts=even_counts(job.micro_batches, dp),
        step_time_s=step,
        before_s=_estimate(job, job.pp, job.dp),
        alternatives={f"PP{c[3]}xDP{c[4]}": c[0] for c in candidates},
    )


def _keep(
    job: RigidJob, survivors: Sequence[int], broken: Collection[int], pp: int, dp: int
) -> tuple[int, ...]:
    """The old ranks in new rank order. A reroute keeps each survivor's stage and TP rank (its
    own weights), replicas renumbered densely; a reconfiguration takes the survivors in old
    rank order (every state is gathered from all old ranks anyway)."""
    if broken:
        replicas = sorted({job.coords[r][1] for r in survivors} - set(broken))
        new = {d: i for i, d in enumerate(replicas)}
        placed = {
            megatron_rank((t, new[d], p), tp=job.tp, dp=dp): r
            for r in survivors
            for t, d, p in [job.coords[r]]
            if d in new
        }
        return tuple(placed[i] for i in range(len(placed)))
    return tuple(survivors[: pp * dp * job.tp])


def rigid_job_from_notes(notes: Sequence[Mapping[str, Any]], world: int) -> RigidJob | None:
    """The old layout from its ranks' layout notes (each ``{"rank", "tp", "dp", "pp",
    "layers", "micro_batches", "coord", "profile"}``, what the snapshot service writes). A rank
    without a note (its machine's memory is gone) sits where Megatron's default order puts it,
    if every note is where that order puts it, or in the one cell no note covers. None when
    the notes do not describe one rigid grid of ``world`` ranks."""
    try:
        first = notes[0]
        tp, dp, pp = int(first["tp"]), int(first["dp"]), int(first["pp"])
        layers, m = int(first["layers"]), int(first["micro_batches"])
        coords: dict[int, Coord] = {}
        for n in notes:
            t, d, p = (int(c) for c in n["coord"])
            coords[int(n["rank"])] = (t, d, p)
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    if (
        tp * dp * pp != world
        or layers < 1
        or layers % pp
        or len(set(coords.values())) < len(coords)
    ):
        return None
    grid = [(t, d, p) for p in range(pp) for d in range(dp) for t in range(tp)]  # rank order
    missing = [r for r in range(world) if r not in coords]
    if all(0 <= r < world and grid[r] == c for r, c in coords.items()):
        coords.update({r: grid[r] for r in missing})
    elif len(missing) == 1:
        coords[missing[0]] = next(c for c in grid if c not in set(coords.values()))
    else:
        return None
    if sorted(coords) != list(range(world)):
        return None
    spacings, posts = [], []
    for n in notes:
        profile = n.get("profile")
        if isinstance(profile, Mapping) and float(profile.get("spacing") or 0) > 0:
            spacings.append(float(profile["spacing"]))
            posts.append(float(profile.get("post_low", profile.get("post")) or 0.0))
    return RigidJob(
        tp=tp,
        dp=dp,
        pp=pp,
        num_layers=layers,
        micro_batches=m,
        coords=tuple(coords[r] for r in range(world)),
        per_microbatch_s=max(spacings) if spacings else 0.0,
        post_s=sorted(posts)[len(posts) // 2] if posts else 0.0,
    )
