"""The job's layout, gathered from every rank (DESIGN.md, Contracts: Topology).

Every rank knows its own coordinates in the parallel grid (TP rank, DP replica, PP stage) and
its host (:func:`~failslow.core.topology.host_name`); the planner needs all of them.
:func:`gather_topology` collects them with one ``all_gather_object`` at attach time (never per
step) and builds the :class:`~failslow.core.topology.Topology` the adapter reports.
"""

from __future__ import annotations

from failslow.core.topology import Topology, host_name


def gather_topology(
    coord: tuple[int, int, int],
    *,
    dp: int,
    pp: int,
    micro_batches: int,
    micro_batch_size: int,
    microbatch_multiple: int = 0,
    sharded: bool = False,
    group: object = None,
) -> Topology:
    """The job's :class:`Topology` from this rank's ``(tp, dp, pp)`` coordinates; every rank
    of the default group (or ``group``) calls it. TP size is the world over ``dp * pp``;
    ``microbatch_multiple``: the granularity the framework's schedule needs of a replica's
    count (0: the planner's default); ``sharded``: TP is an FSDP shard group
    (:attr:`Topology.sharded`)."""
    import torch.distributed as dist

    world = dist.get_world_size(group=group)
    gathered: list[tuple[str, tuple[int, int, int]] | None] = [None] * world
    dist.all_gather_object(gathered, (host_name(), tuple(coord)), group=group)
    return Topology(
        tp=world // (dp * pp),
        dp=dp,
        pp=pp,
        coords=tuple(tuple(c) for _, c in gathered),  # type: ignore[misc]
        hosts=tuple(h for h, _ in gathered),  # type: ignore[misc]
        micro_batches=micro_batches,
        micro_batch_size=micro_batch_size,
        microbatch_multiple=microbatch_multiple,
        sharded=sharded,
    )
