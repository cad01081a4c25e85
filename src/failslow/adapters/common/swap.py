"""A topology swap on the ranks (greyhound 5.2, S3): who takes which role, and the state move.

A :class:`~failslow.core.planner.plans.TopologyPlan` says on which host each role runs next
(``plan.hosts[i]`` for the role at index ``i`` of the current topology). Processes never move:
process ``p`` stays on its host and keeps its torch.distributed rank; what moves is the role -
its coordinates in the parallel grid and its training state. This module is the framework-free
part every adapter that swaps in place shares:

- :meth:`Topology.placement <failslow.core.topology.Topology.placement>` (core: the controller
  needs it too) turns the host-level plan into process-level moves ``dest``, and
  :meth:`Topology.moved <failslow.core.topology.Topology.moved>` is the topology afterwards,
  indexed by process as before;
- :func:`exchange_state` moves every role's state to its new process peer to peer over the
  default group (one send and one receive per moving process, all hosts at once - greyhound
  Fig. 19: the pause depends on the state per GPU, not on the job's size), in the snapshot
  format (:mod:`failslow.core.checkpoint.blob`), so what arrives is verified and bitwise;
- :func:`together` runs one phase and agrees with every rank
  (:func:`~failslow.runtime.agreement.all_ranks_ok`) that it worked
  everywhere: nothing is torn down unless every rank holds its new role's state;
- :class:`InPlaceSwap` is the hooks' flow (snapshot, move, become, revert), and
  :func:`built` / :func:`adopt` turn the user's builder's result into the objects the loop
  already holds.

:func:`~failslow.core.topology.host_name` is the host a rank reports: the hostname, or
``FAILSLOW_HOST`` where one machine stands for several (the CPU demo and the tests give each rank
its own host).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from failslow import hookimpl
from failslow.core.topology import inverse_placement
from failslow.errors import FailslowError
from failslow.runtime.agreement import all_ranks_ok

T = TypeVar("T")


def exchange_state(state: Any, dest: Sequence[int], *, rank: int, step: int) -> Any:
    """Send this process's ``state`` (its role's) to ``dest[rank]`` and return the state of the
    role this process takes, verified; a process that keeps its role gets ``state`` back.

    Every rank of the default group calls it with the same ``dest``. The copy is the snapshot
    format: a buffer that fails its checksum raises :class:`CorruptSnapshot`."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from failslow.core.checkpoint import blob

    to, source = dest[rank], inverse_placement(dest)[rank]
    if to == rank:
        if source != rank:
            raise FailslowError(f"rank {rank}: placement {list(dest)} is not a permutation")
        return state
    layout = blob.plan(state)
    out = bytearray(layout.total_bytes)
    blob.write_payload(memoryview(out), layout, step)
    blob.seal(memoryview(out))
    sizes = torch.tensor([len(out)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    _wait(dist.isend(sizes[0], to), dist.irecv(sizes[1], source))
    incoming = torch.empty(int(sizes[1].item()), dtype=torch.uint8)
    outgoing = torch.from_numpy(np.frombuffer(out, dtype=np.uint8))
    _wait(dist.isend(outgoing, to), dist.irecv(incoming, source))
    got_step, received = blob.read(memoryview(incoming.numpy()))
    if got_step != step:
        raise FailslowError(f"rank {rank}: received the state of step {got_step}, not {step}")
    return received


def _wait(*works: Any) -> None:
    for work in works:
        work.wait()


def together(phase: Callable[[], T], elsewhere: str) -> T:
    """Run ``phase`` on this rank, then agree with every rank that it worked
    everywhere: its result, else this rank's own error, else FailslowError(``elsewhere``)."""
    error: BaseException | None = None
    result: T | None = None
    try:
        result = phase()
    except Exception as exc:
        error = exc
    import torch.distributed as dist

    if not all_ranks_ok(error is None, dist.get_world_size()):
        if error is not None:
            raise error
        raise FailslowError(elsewhere)
    return result  # type: ignore[return-value]


def built(result: Any, what: str) -> tuple[Any, Any, Any]:
    """``(model, optimizer, scheduler)`` from what the user's builder (``what``) returned:
    ``(model, optimizer)`` or ``(model, optimizer, scheduler)``, else FailslowError."""
    if not isinstance(result, tuple | list) or len(result) not in (2, 3):
        raise FailslowError(
            f"{what} must return (model, optimizer) or (model, optimizer, scheduler), built on "
            f"the current process groups; got {type(result).__name__}"
        )
    return (*result, None) if len(result) == 2 else tuple(result)  # type: ignore[return-value]


def adopt(old: Any, new: Any, what: str) -> None:
    """Make the object the user holds (``old``) the rebuilt one: both share ``new``'s attribute
    dictionary from now on, so the training loop's references stay valid after a swap."""
    if type(old) is not type(new):
        raise FailslowError(
            f"{what} built a {type(new).__name__} where the job has a {type(old).__name__}"
        )
    object.__setattr__(old, "__dict__", new.__dict__)


class InPlaceSwap:
    """The S3 hooks of an adapter that swaps in place; the adapter supplies :meth:`_become`.

    At the plan's step boundary every rank snapshots its role and agrees, moves the state to
    the role's new process (:func:`exchange_state`) and agrees again - nothing is torn down
    unless every rank holds its new role's state - then becomes its new role. The pre-swap
    state and topology are kept until the plan is confirmed on every rank, for
    ``failslow_revert_topology_plan`` (a rank that failed to build or restore rolls every
    rank back). The adapter has ``rank``, ``topology``, ``failslow_capabilities()`` and
    ``failslow_snapshot_state(step)``."""

    _undo: tuple[Any, Any] | None = None

    def _become(self, topology: Any, state: Any, step: int, *, split: bool) -> None:
        """Run this process's role under ``topology`` from ``state`` (rebuild the framework's
        groups and objects, restore; ``split``: the loaders' positions from ``state`` too)."""
        raise NotImplementedError

    @hookimpl
    def failslow_prepare_topology_plan(self, plan: Any, rank: int) -> bool:
        self.failslow_capabilities().require("topology_plans")  # type: ignore[attr-defined]
        self.topology.placement(plan.hosts)  # type: ignore[attr-defined]  # must fit
        return True

    @hookimpl
    def failslow_apply_topology_plan(self, plan: Any, step: int) -> bool:
        self.failslow_capabilities().require("topology_plans")  # type: ignore[attr-defined]
        topology = self.topology  # type: ignore[attr-defined]
        dest, own = together(
            lambda: (topology.placement(plan.hosts), self.failslow_snapshot_state(step)),  # type: ignore[attr-defined]
            f"topology plan at step {step}: another rank could not snapshot its role",
        )
        received = together(
            lambda: exchange_state(own, dest, rank=self.rank, step=step),  # type: ignore[attr-defined]
            f"topology plan at step {step}: another rank's state move failed",
        )
        self._undo = (own, topology)
        self._become(topology.moved(dest), received, step, split=False)
        return True

    @hookimpl
    def failslow_revert_topology_plan(self, plan: Any, step: int) -> bool:
        """Back to the placement and state before ``plan`` (a rank failed to apply it)."""
        if self._undo is None:
            return False  # it failed before anything was torn down: nothing to undo
        own, topology = self._undo
        self._undo = None
        self._become(topology, own, step, split=False)
        return True

    @hookimpl
    def failslow_on_plan_result(self, plan: Any, step: int, outcome: str, detail: str) -> None:
        from failslow.core.control.plan_channel import PlanResult
        from failslow.core.planner.plans import TopologyPlan

        if isinstance(plan, TopologyPlan) and outcome == PlanResult.APPLIED:
            self._undo = None  # every rank switched: the pre-swap state can go
