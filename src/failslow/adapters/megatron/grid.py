"""Megatron-core's process groups for a permuted rank grid (greyhound 5.2, S3 in place).

Megatron builds every group from the global rank: ``initialize_model_parallel`` enumerates the
grid in rank space (``tp-cp-ep-dp-pp``: rank = tp + TP * (dp + DP * pp)) and keeps the groups
whose rank lists contain ``torch.distributed.get_rank()``. After a topology swap process ``p``
runs the *role* ``role_of[p]``, so :func:`rebuild_grid` runs Megatron's own initialization in
role space (:func:`~failslow.core.topology.megatron_rank`) and maps it onto processes:

- while it runs, ``torch.distributed.get_rank()`` answers the role, and ``new_group`` gets each
  role list mapped to processes with ``sort_ranks=False`` (position in the list is the group
  rank, so a process's TP/DP/PP rank is its role's - torch sorts otherwise, and a pipeline
  would run its stages in process order);
- afterwards the rank lists Megatron keeps (pipeline, embedding, data-parallel, ...) are mapped
  to processes, which is what its point-to-point calls and ``is_rank_in_embedding_group``
  compare against at run time.

The old groups are destroyed first (every process, in the same order; the default group stays).
The two ``torch.distributed`` functions are replaced module-wide for the duration of Megatron's
initialization, on the training thread at a step boundary (no validation task runs then, and
the capture's ring is already open under the process's own rank).
Sizes come from the grid in place (TP, PP, virtual PP, expert TP; other arguments of
``initialize_model_parallel`` take their defaults). Context and expert parallelism are not
swapped (the topology record has no CP/EP coordinates): :func:`swap_refusal` says so.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def swap_refusal() -> str:
    """Why this grid cannot be swapped in place ("" if it can)."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() > 1:
        return "context parallelism > 1: the topology record has no CP coordinates to move"
    if ps.get_expert_model_parallel_world_size() > 1:
        return "expert parallelism > 1: the topology record has no EP coordinates to move"
    return ""


def grid_sizes() -> dict[str, Any]:
    """The arguments of ``initialize_model_parallel`` that rebuild the grid in place."""
    from megatron.core import parallel_state as ps

    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
    }


def destroy_grid() -> None:
    """Forget Megatron's groups and destroy them. ``destroy_model_parallel`` only forgets them:
    each gloo group it leaves keeps its connection loop thread, two worker threads and a socket
    per peer, and a process that rebuilds its grid piles them up (the conformance world, which
    builds the grid ~30 times per rank, held 1,250 threads and 2,000 descriptors per rank by its
    last layout, whose steps then ran 4-10x slower than in a fresh process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    old = [g for g in (ps._global_process_group_list or []) if g is not None]
    ps.destroy_model_parallel()
    for group in old:
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def rebuild_grid(role_of: Sequence[int], sizes: dict[str, Any]) -> None:
    """Destroy Megatron's groups and build them again with process ``p`` in role ``role_of[p]``;
    every process calls it with the same arguments."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    destroy_grid()
    process_of = [0] * len(role_of)
    for process, role in enumerate(role_of):
        process_of[role] = process
    with _in_role_space(role_of[dist.get_rank()], process_of):
        ps.initialize_model_parallel(**sizes)
    for name, value in list(vars(ps).items()):
        if name.startswith("_") and "RANKS" in name and isinstance(value, list):
            setattr(ps, name, _to_processes(value, process_of))


def _to_processes(ranks: Any, process_of: Sequence[int]) -> Any:
    if isinstance(ranks, list):
        return [_to_processes(r, process_of) for r in ranks]
    return process_of[ranks]


@contextmanager
def _in_role_space(role: int, process_of: Sequence[int]) -> Iterator[None]:
    import torch.distributed as dist

    get_rank, new_group = dist.get_rank, dist.new_group

    def role_rank(group: Any = None) -> int:
        return role if group is None else get_rank(group)

    def process_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ranks is not None:
            ranks = [process_of[r] for r in ranks]
            kwargs["sort_ranks"] = False
        return new_group(ranks, *args, **kwargs)

    dist.get_rank, dist.new_group = role_rank, process_group  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.get_rank, dist.new_group = get_rank, new_group  # type: ignore[assignment]
