"""FSDP2, HSDP and DDP jobs as a failslow plugin (greyhound 5.2, S2; byterobust 6.3, snapshots).

Translates only; the bookkeeping is the adapter kit's (:mod:`failslow.adapters.common`). The
unit of a micro-batch plan (S2) is a data-parallel replica, and what a replica is depends on
how the model is wrapped:

- **DDP** (``DistributedDataParallel``): every rank is a replica. Its non-final micro-batches
  run without the gradient all-reduce (DDP's ``require_backward_grad_sync``, what ``no_sync()``
  sets), so each rank reduces once per step whatever its count;
- **HSDP** (``fully_shard`` on a 2-D mesh, dims (replicate, shard)): a replicate coordinate is
  a replica, and all shard ranks of one replica run its count, each on its own part of every
  micro-batch (:class:`~failslow.adapters.common.data.ShareSampler` ``parts``). All-gathers and
  reduce-scatters stay inside the shard group (equal counts there); the all-reduce across
  replicas (``set_requires_all_reduce``) runs once, on the last micro-batch. The topology reports
  the shard group where the planner expects the heavy, per-layer traffic (its ``tp``);
- **FSDP** (``fully_shard`` on a 1-D mesh: one shard group over every rank): every rank is a
  replica, but its all-gathers run per layer in every micro-batch's forward and backward and
  its reduce-scatter in every micro-batch's backward, so every rank must run the same count:
  plans take the **size form** (issue 46) - every replica runs the even split's ``G``
  micro-batches, and a plan changes how many samples they hold (the share-aware loader's
  ``by_size``: replica r's ``counts[r] * B`` samples of the step cut into ``G``), with the
  usual sharded memory. ``unshard_once=True`` is the opt-in for the count form instead:
  parameters are gathered in the step's first forward and stay unsharded until the last
  backward (``set_reshard_after_forward(False)``; per micro-batch
  ``set_requires_gradient_sync(last)`` and ``set_reshard_after_backward(last)``), so every rank
  issues one all-gather and one reduce-scatter per module per step - DDP-like memory for
  parameters and gradients, whole micro-batches moved, shapes kept.

The weight: the gradient reduction averages over all ``W`` ranks, and every micro-loss is
scaled by ``1 / G`` (:attr:`FSDPAdapter.loss_scale`, ``G = M / D`` the even split's count per
replica - the usual gradient-accumulation scaling). A replica that runs ``m_r`` micro-batches
thus contributes ``m_r / G`` times its mean, which is the kit's weight ``w_r = m_r * D / M``:
the even split's gradient, with no per-plan rescaling. In the size form ``loss_scale`` is
also multiplied by the micro-batch's samples over ``B`` (1 under the even split), so a loss
that is the mean over its micro-batch weighs every sample as the even split does.

Snapshots are per rank and issue no collective: local shards of the parameters and of the
optimizer state (:mod:`.shards`), the scheduler, the RNGs, the optimizer-step count, the
loaders' positions and the rank's mesh role. The optimizer step waits for the pending
snapshot's copy.

The topology swap (S3, greyhound 5.2) is HSDP's: per-layer traffic runs in the shard groups,
one all-reduce per step in the replicate groups, so a placement that puts a slow link between
two replicas instead of inside a shard group hides it. In place, at one step boundary: each
role's shards go peer to peer to the process taking the role (the kit's
:func:`~failslow.adapters.common.swap.exchange_state`), a new mesh is built whose groups list
processes in role order (:func:`mesh_for`), ``model_factory(mesh)`` builds the model and
optimizer on it, the user's objects adopt the new ones, and the shards are restored - no
process restarts. DDP and pure FSDP have one gradient group over every rank, so no placement
helps there: declared, with that reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from failslow import hookimpl
from failslow.adapters.common import swap
from failslow.adapters.common.loop import call_model
from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.adapters.common.state import restore_rng_state, rng_state, wait_for_snapshot_before
from failslow.adapters.common.topology import gather_topology
from failslow.adapters.fsdp.shards import (
    local_model_state,
    local_optimizer_state,
    restore_model_state,
    restore_optimizer_state,
)
from failslow.capabilities import SUPPORTED, Capabilities
from failslow.core.planner.plans import MicroBatchPlan
from failslow.core.topology import Topology
from failslow.errors import ConfigError, FailslowError
from failslow.runtime.agreement import all_ranks_ok

ONE_GROUP = (
    "every rank is in the job's one gradient group ({flavor}), so no placement moves traffic "
    "off a link; an HSDP job (2-D mesh) can swap"
)
NO_FACTORY = (
    "a topology swap rebuilds the model on a new mesh through model_factory; pass "
    "failslow.fsdp.attach(..., model_factory=f), f(mesh) -> (model, optimizer[, scheduler])"
)


def flavor_of(model: Any, mesh: Any, source: str = "failslow.fsdp.attach") -> str:
    """``"ddp"``, ``"fsdp"`` (1-D mesh) or ``"hsdp"`` (2-D mesh: replicate, shard); errors
    name ``source``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if isinstance(model, FSDPModule):
        if mesh is None or mesh.ndim not in (1, 2):
            raise ConfigError(
                f"{source}: pass mesh=, the DeviceMesh the model was fully_shard-ed "
                "on (1-D: FSDP; 2-D (replicate, shard): HSDP)"
            )
        return "fsdp" if mesh.ndim == 1 else "hsdp"
    if source != "failslow.fsdp.attach":
        raise ConfigError(
            f"{source}: the prepared model is a {type(model).__name__}, not distributed (DDP "
            "or FSDP2); run more than one process (accelerate launch --num_processes N)"
        )
    raise ConfigError(
        f"{source}: the model is a {type(model).__name__}; attach after "
        "fully_shard(model, mesh=...) (FSDP2/HSDP) or DistributedDataParallel(model)"
    )


def pin_bucket_layout(ddp: Any) -> None:
    """Fix DDP's gradient buckets now, in the layout DDP starts with, for the whole run.

    DDP lays its buckets out by parameter order at construction and rebuilds them once, after
    the first synchronised backward, in the order gradients became ready. The all-reduce sums
    each element in an order that depends on its place in the flattened bucket, so a process
    that restarts from a snapshot (its first step on the construction layout) would differ
    from the uninterrupted run (on the rebuilt one) by float rounding. Rebuilding at once with
    every parameter in the construction order makes both runs use one layout (what DDP keeps
    under ``find_unused_parameters=True``); the cost is the ready-order layout's earlier start
    of the first bucket's all-reduce in a multi-bucket model. One broadcast, at attach."""
    if getattr(ddp, "_failslow_pinned", False):
        return
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()
    ddp._failslow_pinned = True


def mesh_for(topology: Topology, like: Any) -> Any:
    """The HSDP mesh (dims replicate, shard) for ``topology``'s roles: entry ``[r][s]`` is the
    process running replica ``r``, shard ``s``. Its groups list their processes in that order
    (``new_group(sort_ranks=False)``): FSDP2 shards by group rank and DTensor by mesh
    coordinate, and the two must agree. Every rank calls it (it creates every group)."""
    import torch

    grid = [[-1] * topology.tp for _ in range(topology.dp)]
    for process, (shard, replica, _) in enumerate(topology.coords):
        grid[replica][shard] = process
    rows = [dist.new_group(row, sort_ranks=False) for row in grid]
    columns = [dist.new_group(list(col), sort_ranks=False) for col in zip(*grid, strict=True)]
    rank = dist.get_rank()
    replica = next(r for r, row in enumerate(grid) if rank in row)
    shard = grid[replica].index(rank)
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(
        [columns[shard], rows[replica]],
        like.device_type,
        mesh=torch.tensor(grid),
        mesh_dim_names=like.mesh_dim_names,
    )


def adopt_module(old: Any, new: Any) -> None:
    """:func:`~failslow.adapters.common.swap.adopt` for an FSDP2 root module: FSDP2 finds a
    module's state through a map keyed by the module object (``torch.distributed.
    _composable_state``), so the object the user holds is mapped to the rebuilt one's state
    too (its own old state goes with its old attributes)."""
    import weakref

    from torch.distributed import _composable_state as composable

    swap.adopt(old, new, "model_factory")
    state = composable._get_module_state(new)
    if state is not None:
        composable._module_state_mapping[old] = weakref.ref(state)


class FSDPAdapter(swap.InPlaceSwap):
    """One data-parallel job's plugin on a :class:`~failslow.runtime.session.Session`."""

    _micro = 0
    """Micro-batches of the step in progress begun so far."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        *,
        mesh: Any = None,
        scheduler: Any = None,
        model_factory: Callable[..., Any] | None = None,
        accumulation_steps: int = 1,
        micro_batch_size: int = 1,
        unshard_once: bool = False,
        iteration: int = 0,
        framework: str = "FSDP",
    ) -> None:
        for name, value in (("accumulation_steps", accumulation_steps),
                            ("micro_batch_size", micro_batch_size)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"failslow.{framework.lower()}: {name} must be an integer >= 1")
        self.flavor = flavor_of(model, mesh, "failslow.accelerate" if framework == "Accelerate"
                                else "failslow.fsdp.attach")  # fmt: skip
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.model_factory = model_factory
        self.mesh = mesh
        self.unshard_once = unshard_once and self.flavor == "fsdp"
        self.session: Any = None
        self.iteration = iteration
        """Optimizer steps taken: the global step the session's boundary numbers."""
        self._begun: int | None = None
        self.rank = rank = dist.get_rank()
        world = dist.get_world_size()
        if self.flavor == "hsdp":
            replica, shard = mesh.get_coordinate()
            replicas = mesh.size(0)
        else:
            replica, shard, replicas = rank, 0, world
        self.split = ReplicaSplit(
            replica=replica,
            replicas=replicas,
            micro_batches=accumulation_steps * replicas,
            framework=framework,
        )
        self.split.loader_hint = "build the training loader with fs.loader(dataset)"
        self.split.micro_loss_scale = lambda: self.replicas_scale
        if self.flavor == "fsdp" and not self.unshard_once:
            self.split.by_size = micro_batch_size  # every rank runs G micro-batches: by size
        self.micro_batch_size = micro_batch_size
        self.topology = gather_topology(
            (shard, replica, 0),
            dp=replicas,
            pp=1,
            micro_batches=accumulation_steps * replicas,
            micro_batch_size=micro_batch_size,
            sharded=self.flavor == "hsdp",
        )
        if self.unshard_once:
            model.set_reshard_after_forward(False)
        if self.flavor == "ddp":
            pin_bucket_layout(model)
        self._step_hook = optimizer.register_step_post_hook(self._stepped)

    # ---- hooks -------------------------------------------------------------------------------
    @hookimpl
    def failslow_report_topology(self) -> Topology:
        return self.topology

    @hookimpl
    def failslow_capabilities(self) -> Capabilities:
        return Capabilities(
            microbatch_plans=SUPPORTED,
            topology_plans=self._swap_reason(),
            snapshots=SUPPORTED,
            hot_update=SUPPORTED,
        )

    def _swap_reason(self) -> str:
        if self.flavor != "hsdp":
            one = "DDP" if self.flavor == "ddp" else "FSDP over a 1-D mesh"
            return ONE_GROUP.format(flavor=one)
        return NO_FACTORY if self.model_factory is None else SUPPORTED

    @hookimpl
    def failslow_prepare_microbatch_plan(self, plan: MicroBatchPlan, rank: int) -> bool:
        self.failslow_capabilities().require("microbatch_plans")
        self.split.ready(plan)
        return True

    @hookimpl
    def failslow_verify_microbatch_plan(
        self, plan: MicroBatchPlan, step: int, forwards: int
    ) -> str:
        return self.split.verify(plan, step, forwards)

    @hookimpl
    def failslow_microbatch_unit(self) -> int | None:
        return self.split.by_size

    @hookimpl
    def failslow_observed_coord(self) -> tuple[int, int, int]:
        """(shard, replica, 0) from the device mesh the model runs on now (HSDP); every rank
        its own replica under DDP and FSDP."""
        if self.flavor != "hsdp":
            return (0, self.rank, 0)
        replica, shard = self.mesh.get_coordinate()
        return (int(shard), int(replica), 0)

    @hookimpl
    def failslow_apply_microbatch_plan(self, plan: MicroBatchPlan, step: int) -> bool:
        self.split.apply(plan, step)
        return True

    @hookimpl
    def failslow_snapshot_state(self, step: int) -> dict[str, Any]:
        """This rank's shards by reference (the snapshotter copies them off the training
        thread; the optimizer step waits for the copy)."""
        return {
            "model": local_model_state(self.model),
            "optimizer": local_optimizer_state(self.optimizer),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rng_state(),
            "iteration": self.iteration,
            "split": self.split.state_dict(step),
            "coord": list(self._coord()),
            "step": step,
        }

    def _coord(self) -> tuple[int, int]:
        """This process's role: (shard, replica) in the mesh."""
        shard, replica, _ = self.topology.coords[self.rank]
        return shard, replica

    @hookimpl
    def failslow_restore_state(self, state: dict[str, Any], step: int) -> bool:
        """Every rank resumes together. A snapshot taken after a topology swap holds another
        role than this process's launch role (a restart in place): then every rank gathers the
        snapshots' roles once and rebuilds that placement before restoring."""
        coord = tuple(state.get("coord", self._coord()))
        if all_ranks_ok(coord == self._coord(), dist.get_world_size()):
            self._restore(state, split=True)
            return True
        self.failslow_capabilities().require("topology_plans")
        coords: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (coord[0], coord[1], 0))
        topology = replace(self.topology, coords=tuple(tuple(c) for c in coords))
        self._become(topology, state, step, split=True)
        return True

    def _restore(self, state: dict[str, Any], *, split: bool) -> None:
        """Put ``state`` back; ``split``: the loaders' positions too (not in a swap, where the
        live loaders already stand at this step boundary)."""
        if tuple(state.get("coord", self._coord())) != self._coord():
            raise FailslowError(
                f"the snapshot holds the state of mesh role {state['coord']}, this process "
                f"runs {list(self._coord())}"
            )
        restore_model_state(self.model, state["model"])
        restore_optimizer_state(self.optimizer, state["optimizer"])
        if state["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        restore_rng_state(state["rng"])
        self.iteration = int(state["iteration"])
        if split:
            self.split.load_state_dict(state["split"])

    # ---- S3: a topology swap in place (HSDP; the flow is the kit's InPlaceSwap) -----------
    def _become(self, topology: Topology, state: dict[str, Any], step: int, *, split: bool) -> None:
        """Run this process's role under ``topology`` from ``state``: mesh, objects, state,
        data share."""
        assert self.model_factory is not None
        mesh = mesh_for(topology, self.mesh)
        model, optimizer, scheduler = swap.built(self.model_factory(mesh), "model_factory(mesh)")
        self._step_hook = optimizer.register_step_post_hook(self._stepped)
        wait_for_snapshot_before(optimizer, "step", self)
        adopt_module(self.model, model)
        swap.adopt(self.optimizer, optimizer, "model_factory")
        if self.scheduler is not None and scheduler is not None:
            swap.adopt(self.scheduler, scheduler, "model_factory")
        self.mesh, self.topology = mesh, topology
        shard, replica = self._coord()
        self.split.set_replica(replica, step, part=shard)
        self._restore(state, split=split)

    @hookimpl
    def failslow_hot_update(self, code: dict[str, Any], step: int) -> bool:
        return True  # the process restarts outside; its state is in the committed snapshot

    def guard_optimizer_step(self) -> None:
        """Before the optimizer mutates the state, the pending snapshot's copy must be complete
        (byterobust 6.3)."""
        wait_for_snapshot_before(self.optimizer, "step", self)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.iteration += 1

    # ---- the step ----------------------------------------------------------------------------
    @property
    def replicas_scale(self) -> float:
        """``1 / G``, the even split's accumulation (see the module docstring: it is also right
        under an uneven count plan)."""
        return self.split.replicas / self.split.micro_batches

    @property
    def loss_scale(self) -> float:
        """The factor for the micro-loss of the micro-batch in progress: ``1 / G``, in the size
        form times its samples over ``B`` (see the module docstring)."""
        return self.replicas_scale * self.split.sample_share(max(self._micro - 1, 0))

    def begin_step(self) -> int:
        """The session's step boundary for the step the optimizer is at (once per step): plans
        due now apply before the step's first micro-batch. Returns the step."""
        if self._begun != self.iteration:
            self._begun = self.iteration
            self._micro = 0
            if self.session is not None:
                self.session.step_boundary(self.iteration)
        return self.iteration

    def set_boundary(self, last: bool) -> None:
        """Before a training micro-batch's forward: is it this replica's last of the step?"""
        self._micro += 1
        if self.session is not None:
            self.session.micro_batch()
        if self.flavor == "ddp":
            self.model.require_backward_grad_sync = last
        elif self.flavor == "hsdp":
            self.model.set_requires_all_reduce(last)
        elif self.unshard_once:
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def step_batches(self, data: Iterator[Any]) -> Iterator[Any]:
        """This replica's micro-batches of the next step from ``data``, for a loop of one's own::

            for batch in fs.step_batches(data):
                (loss_fn(model(batch)) * fs.loss_scale).backward()
            optimizer.step(); optimizer.zero_grad()

        The step boundary passes before the first; the gradient reduction happens in the last
        one's backward."""
        self.begin_step()
        for batch, last in self.split.step_batches(data):
            self.set_boundary(last)
            yield batch

    def train_step(
        self,
        data: Iterator[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One global step: this replica's micro-batches (the model returns the loss for
        ``model(*batch)``/``model(**batch)``, or ``loss_fn(model(batch[0]), batch[1])``), the
        optimizer step (and the scheduler's), zeroed gradients. Returns this replica's mean
        micro-batch loss (no collective)."""
        total = torch.zeros(())
        count = 0
        for batch in self.step_batches(data):
            loss = call_model(self.model, batch, loss_fn)
            (loss * self.loss_scale).backward()
            total += loss.detach().float()
            count += 1
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad()
        return total / max(count, 1)

    # ---- data --------------------------------------------------------------------------------
    def loader(
        self,
        dataset: Any,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        **loader_kwargs: Any,
    ) -> torch.utils.data.DataLoader[Any]:
        """A loader of this rank's exact share of every global batch (``micro_batch_size``
        samples per item; an HSDP shard rank its part of its replica's), steps numbered by
        the optimizer steps, in step with applied plans. One pass is one epoch."""
        return self.split.loader(
            dataset,
            micro_batch_size=self.micro_batch_size,
            start_step=self.iteration,
            shuffle=shuffle,
            seed=seed,
            part=self._coord()[0],  # an HSDP shard rank's part of its replica's micro-batches
            parts=self.topology.tp,
            collate_fn=collate_fn,
            **loader_kwargs,
        )

    def close(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self.session is not None:
            self.session.close()
            self.session = None
