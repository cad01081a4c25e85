"""The job's parallel layout as the planner sees it (DESIGN.md, Contracts: Topology).

An adapter reports this; the planner, the simulator and the tests work on it and never on a
framework object. A *role* is a global rank number together with its coordinates
``(tp, dp, pp)``; ``hosts[r]`` is the node that currently runs role ``r``. Topology plans
(greyhound 5.2, S3) change which host runs which role, never the roles themselves.

:meth:`Topology.megatron` builds Megatron-core's default rank order (``tp-cp-ep-dp-pp``: TP
varies fastest, then DP, then PP), which DeepSpeed's pipeline engine also uses.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from failslow import envvars
from failslow.errors import ConfigError


def host_name() -> str:
    """This process's host as failslow reports it: ``FAILSLOW_HOST``, else the hostname (one
    machine may stand for several: the CPU demo gives each rank its own host)."""
    return os.environ.get(envvars.HOST) or socket.gethostname()


def inverse_placement(dest: Sequence[int]) -> tuple[int, ...]:
    """``src[p]``: the index whose role process ``p`` takes under ``dest``
    (:meth:`Topology.placement`)."""
    src = [-1] * len(dest)
    for i, p in enumerate(dest):
        src[p] = i
    return tuple(src)


Coord = tuple[int, int, int]
"""(tp, dp, pp) coordinates of one role."""


def megatron_rank(coord: Sequence[int], *, tp: int, dp: int) -> int:
    """Megatron-core's global rank of the role at ``(tp, dp, pp)`` in its default order
    ``tp-cp-ep-dp-pp`` with CP = EP = 1: rank = tp + TP * (dp + DP * pp)."""
    t, d, p = coord
    return t + tp * (d + dp * p)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """TP/DP/PP sizes, each role's coordinates and host, and the step's batch layout.

    ``micro_batches`` is M, the number of micro-batches in one global batch (all DP replicas
    together); ``layers_per_stage[p]`` is the number of transformer layers on stage ``p``;
    ``microbatch_multiple`` the granularity of a replica's count under a micro-batch plan, as
    the framework's schedule needs it (0: greyhound's rule, footnote 4 - a multiple of PP for a
    1F1B pipeline; Megatron-core's 1F1B runs any count, its interleaved schedule whole groups).
    ``sharded``: the ``tp`` dimension is a shard group of FSDP/HSDP (every rank of a replica
    holds a shard of every layer; per-layer all-gathers and reduce-scatters run in it, and it
    may span hosts), not tensor parallelism (which stays inside a host).
    """

    tp: int
    dp: int
    pp: int
    coords: tuple[Coord, ...]
    hosts: tuple[str, ...]
    micro_batches: int
    micro_batch_size: int = 1
    layers_per_stage: tuple[int, ...] = ()
    microbatch_multiple: int = 0
    sharded: bool = False
    _index: dict[Coord, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "micro_batches", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"topology: {name} must be a positive integer, got {value!r}")
        n = self.tp * self.dp * self.pp
        if len(self.coords) != n or len(self.hosts) != n:
            raise ConfigError(
                f"topology: tp*dp*pp = {n} roles, but {len(self.coords)} coords and "
                f"{len(self.hosts)} hosts were given"
            )
        index = self._index
        for rank, (t, d, p) in enumerate(self.coords):
            if not (0 <= t < self.tp and 0 <= d < self.dp and 0 <= p < self.pp):
                raise ConfigError(f"topology: rank {rank} has coords {(t, d, p)} out of range")
            if (t, d, p) in index:
                raise ConfigError(
                    f"topology: ranks {index[(t, d, p)]} and {rank} share coords {(t, d, p)}"
                )
            index[(t, d, p)] = rank
        if not isinstance(self.microbatch_multiple, int) or self.microbatch_multiple < 0:
            raise ConfigError(
                "topology: microbatch_multiple must be an integer >= 0, got "
                f"{self.microbatch_multiple!r}"
            )
        if self.layers_per_stage and len(self.layers_per_stage) != self.pp:
            raise ConfigError(
                f"topology: layers_per_stage has {len(self.layers_per_stage)} entries, "
                f"expected pp = {self.pp}"
            )

    @classmethod
    def megatron(
        cls,
        *,
        tp: int,
        dp: int,
        pp: int,
        gpus_per_host: int,
        micro_batches: int,
        micro_batch_size: int = 1,
        layers_per_stage: Sequence[int] = (),
    ) -> Topology:
        """Megatron's default order: rank = tp + TP * (dp + DP * pp); hosts fill in rank order."""
        if gpus_per_host < 1:
            raise ConfigError(f"topology: gpus_per_host must be >= 1, got {gpus_per_host}")
        grid = itertools.product(range(tp), range(dp), range(pp))
        coords = tuple(sorted(grid, key=lambda c: megatron_rank(c, tp=tp, dp=dp)))
        hosts = tuple(f"node{r // gpus_per_host:05d}" for r in range(len(coords)))
        return cls(
            tp=tp,
            dp=dp,
            pp=pp,
            coords=coords,
            hosts=hosts,
            micro_batches=micro_batches,
            micro_batch_size=micro_batch_size,
            layers_per_stage=tuple(layers_per_stage),
        )

    @property
    def world_size(self) -> int:
        return len(self.coords)

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return self._index[(tp, dp, pp)]

    def replica_of(self, rank: int) -> int:
        """DP replica (model copy) that ``rank`` belongs to."""
        return self.coords[rank][1]

    def stage_of(self, rank: int) -> int:
        return self.coords[rank][2]

    def replica_ranks(self, dp: int) -> list[int]:
        """All ranks of DP replica ``dp`` (its TP x PP grid)."""
        return [self.rank_of(t, dp, p) for p in range(self.pp) for t in range(self.tp)]

    def dp_group(self, tp: int, pp: int) -> list[int]:
        """Ranks that all-reduce gradients together (same tp and pp), in dp order."""
        return [self.rank_of(tp, d, pp) for d in range(self.dp)]

    def pp_group(self, tp: int, dp: int) -> list[int]:
        """Ranks of one pipeline (same tp and dp), in stage order."""
        return [self.rank_of(tp, dp, p) for p in range(self.pp)]

    def tp_group(self, dp: int, pp: int) -> list[int]:
        return [self.rank_of(t, dp, pp) for t in range(self.tp)]

    @cached_property
    def host_names(self) -> tuple[str, ...]:
        """Distinct hosts in order of first appearance."""
        return tuple(dict.fromkeys(self.hosts))

    @cached_property
    def _ranks_by_host(self) -> dict[str, list[int]]:
        index: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            index.setdefault(host, []).append(rank)
        return index

    def ranks_on(self, host: str) -> list[int]:
        """Ranks placed on ``host`` (an index built once, O(ranks on host) per call)."""
        return list(self._ranks_by_host.get(host, ()))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (published by rank 0 for the controller)."""
        return {
            "tp": self.tp,
            "dp": self.dp,
            "pp": self.pp,
            "coords": [list(c) for c in self.coords],
            "hosts": list(self.hosts),
            "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "layers_per_stage": list(self.layers_per_stage),
            "microbatch_multiple": self.microbatch_multiple,
            "sharded": self.sharded,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        try:
            return cls(
                tp=int(data["tp"]),
                dp=int(data["dp"]),
                pp=int(data["pp"]),
                coords=tuple((int(t), int(d), int(p)) for t, d, p in data["coords"]),
                hosts=tuple(str(h) for h in data["hosts"]),
                micro_batches=int(data["micro_batches"]),
                micro_batch_size=int(data.get("micro_batch_size", 1)),
                layers_per_stage=tuple(int(n) for n in data.get("layers_per_stage", ())),
                microbatch_multiple=int(data.get("microbatch_multiple", 0)),
                sharded=bool(data.get("sharded", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"topology: malformed record ({exc!r}): {dict(data)}") from exc

    def placement(self, hosts: Sequence[str]) -> tuple[int, ...]:
        """``dest[i]``: the process (index) that runs the role now at index ``i`` once roles
        move to ``hosts`` (a topology plan's, greyhound 5.2 S3). Processes stay on their hosts;
        the ``k``-th role a host receives, in index order, goes to its ``k``-th process, so the
        roles of one host slot move together and keep their order. ConfigError (one line) for
        hosts that do not fit: another count, an unknown host, a host given more or fewer
        roles than it has processes."""
        hosts = tuple(hosts)
        if len(hosts) != self.world_size:
            raise ConfigError(
                f"topology plan: {len(hosts)} roles placed, the job has {self.world_size}"
            )
        unknown = sorted(set(hosts) - set(self.host_names))
        if unknown:
            raise ConfigError(
                f"topology plan: unknown hosts {unknown}; the job runs on {list(self.host_names)}"
            )
        dest = [-1] * len(hosts)
        for host in self.host_names:
            processes = self.ranks_on(host)
            roles = [i for i, h in enumerate(hosts) if h == host]
            if len(roles) != len(processes):
                raise ConfigError(
                    f"topology plan: host {host} would run {len(roles)} roles but has "
                    f"{len(processes)} processes"
                )
            for i, p in zip(roles, processes, strict=True):
                dest[i] = p
        return tuple(dest)

    def moved(self, dest: Sequence[int]) -> Topology:
        """The topology once the role at index ``i`` runs on process ``dest[i]``, indexed by
        process as before: ``coords`` follow the roles, ``hosts`` stay (diagnoses name
        processes, and a later plan starts from this placement)."""
        src = inverse_placement(dest)
        return replace(self, coords=tuple(self.coords[src[p]] for p in range(self.world_size)))

    def megatron_ranks(self) -> tuple[int, ...]:
        """Megatron's rank (:func:`megatron_rank`) of the role each process runs."""
        return tuple(megatron_rank(c, tp=self.tp, dp=self.dp) for c in self.coords)

    def with_hosts(self, hosts: Sequence[str]) -> Topology:
        """The same layout with roles placed on other hosts (the result of a topology plan)."""
        return Topology(
            tp=self.tp,
            dp=self.dp,
            pp=self.pp,
            coords=self.coords,
            hosts=tuple(hosts),
            micro_batches=self.micro_batches,
            micro_batch_size=self.micro_batch_size,
            layers_per_stage=self.layers_per_stage,
            microbatch_multiple=self.microbatch_multiple,
            sharded=self.sharded,
        )
