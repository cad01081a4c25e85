"""Megatron-core as a failslow plugin: topology, capabilities, micro-batch plans (S2), snapshots.

Translates only; the bookkeeping is the adapter kit's (:mod:`failslow.adapters.common`).
Per-replica micro-batch counts (greyhound 5.2) map onto Megatron-core 0.16 as:

- the schedule: ``num_microbatches`` is an ordinary argument of the forward-backward function,
  so :meth:`MegatronAdapter.forward_backward` passes this replica's count ``m_r`` (every stage
  and TP rank of one replica runs the same count; the num-microbatches calculator stays at
  ``M / D``). 1F1B and the no-pipelining schedule run any count >= 1; the interleaved schedule
  needs ``microbatch_group_size_per_vp_stage <= m_r`` and a remainder of 0 or >= PP;
- the weight: the schedule divides each micro-loss by ``m_r`` and DDP averages over the ``D``
  replicas, so replica ``r`` is scaled by ``w_r = m_r * D / M`` through the config's
  ``grad_scale_func`` for the duration of the call (wrapping the optimizer's loss scale; the
  schedule applies it to the last stage's loss and to the MoE/MTP auxiliary-loss scales). In
  per-token loss mode (``calculate_per_token_loss``) ``finalize_model_grads`` divides by the
  tokens of all replicas, which is already the even split's gradient: the weight is 1;
- data: :meth:`MegatronAdapter.data_iterator` reads this replica's exact share of every global
  batch (first and last stages read it; TP ranks of a replica read the same indices); the
  loop's own ``iter(DataLoader(...))`` is taken over at its first training step and re-cut per
  plan where its sampler names its replica (:mod:`failslow.adapters.common.own_loader`), else
  micro-batch plans are declared unsupported with the reason.

Snapshots are per rank and issue no collective (byterobust 6.3): model chunks, the optimizer
(a distributed optimizer's own shard in its dp-reshardable form plus its common state), the
scheduler, the CPU/CUDA RNGs and the tensor-parallel RNG tracker's states, the iteration and
the num-microbatches calculator. The optimizer step waits for the pending snapshot's copy.
Each snapshot also records every tensor's layout-free identity, so a smaller world in another
DP x PP layout can go on from a larger one's snapshots (:mod:`.reshard`, odyssey III-IV).
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from failslow import hookimpl
from failslow.adapters.common import swap
from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.adapters.common.own_loader import LoaderRecut, take_over
from failslow.adapters.common.state import restore_rng_state, rng_state, wait_for_snapshot_before
from failslow.adapters.common.topology import gather_topology
from failslow.adapters.megatron import grid, reshard
from failslow.capabilities import SUPPORTED, Capabilities
from failslow.core.planner.plans import MicroBatchPlan
from failslow.core.topology import Topology
from failslow.errors import ConfigError, FailslowError
from failslow.runtime.agreement import all_ranks_ok

log = logging.getLogger(__name__)

NO_MODEL_PROVIDER = (
    "a topology swap rebuilds the model through model_provider; "
    "pass failslow.megatron.attach(..., model_provider=...)"
)


class MegatronAdapter(swap.InPlaceSwap):
    """One Megatron-core job's plugin on a :class:`~failslow.runtime.session.Session`."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        scheduler: Any = None,
        *,
        model_provider: Callable[..., Any] | None = None,
        num_microbatches: int | None = None,
        micro_batch_size: int | None = None,
        iteration: int = 0,
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        self.model = list(model) if isinstance(model, list | tuple) else [model]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.model_provider = model_provider
        self.config = get_model_config(self.model[0])
        self.session: Any = None
        self.iteration = iteration
        """Training iterations run (``forward_backward`` calls with gradients): the step the
        session's boundary numbers, carried by snapshots."""
        self.rank = torch.distributed.get_rank()
        self.ep = ps.get_expert_model_parallel_world_size()
        dp, pp = ps.get_data_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        coord = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
        num_microbatches, micro_batch_size = _batch_shape(num_microbatches, micro_batch_size)
        self._configured_count = num_microbatches
        """The count per replica the loop was written for (its ``num_microbatches``)."""
        self._layout: dict[str, Any] | None = None
        self.split = ReplicaSplit(
            replica=coord[1], replicas=dp, micro_batches=num_microbatches * dp,
            framework="Megatron-core",
        )  # fmt: skip
        self._observe_split()
        self.micro_batch_size = micro_batch_size
        # 1F1B and the no-pipelining schedule run any count; the interleaved one whole groups
        group = _vp_group(self.config, pp)
        self.topology = gather_topology(
            coord,
            dp=dp,
            pp=pp,
            micro_batches=num_microbatches * dp,
            micro_batch_size=micro_batch_size,
            microbatch_multiple=group if len(self.model) > 1 else 1,
        )
        self.topology = replace(self.topology, layers_per_stage=_layers_per_stage(self.config, pp))
        self.role_of = self.topology.megatron_ranks()
        """Megatron rank (role) each process runs: the identity until a topology swap."""
        self._grid_sizes = grid.grid_sizes()
        self._swap_refusal = grid.swap_refusal()

    def _observe_split(self) -> None:
        """What the kit checks a plan against after its apply step, from each training
        call: the forwards (one per model chunk and micro-batch), the micro-loss scale the
        call used, and whether its ``data_iterator`` is one failslow re-cuts."""
        self.split.loader_hint = "pass data_iterator=fs.data_iterator(dataset)"
        self.split.forwards_per_micro_batch = len(self.model)  # interleaved: once per chunk
        self.split.reads_data = lambda: self._step_data == "foreign"
        self.split.micro_loss_scale = lambda: self._step_scale
        self._step_data: str | None = None
        """Where the last training step's ``data_iterator`` came from: ``"own"`` (this
        adapter's :meth:`data_iterator`, whatever stage reads it), ``"none"`` or
        ``"foreign"`` (the loop's own, which failslow cannot re-cut)."""
        self._step_scale: float | None = None
        """What the last training step multiplied each micro-loss by (the schedule's ``1 /
        m_r`` times the replica's weight; None in per-token loss mode)."""
        self._own_iterators: list[Any] = []
        self._recuts: list[LoaderRecut] = []
        """The loop's own DataLoader iterators' re-cuts (the batch samplers they wrap)."""
        self._said_broken = False

    # ---- hooks -------------------------------------------------------------------------------
    @hookimpl
    def failslow_report_topology(self) -> Topology:
        return self.topology

    @hookimpl
    def failslow_capabilities(self) -> Capabilities:
        return Capabilities(
            microbatch_plans=self._microbatch_reason(),
            topology_plans=self._topology_reason(),
            snapshots=SUPPORTED,
            hot_update=SUPPORTED,
        )

    def _topology_reason(self) -> str:
        if self.model_provider is None:
            return NO_MODEL_PROVIDER
        return self._swap_refusal

    def _microbatch_reason(self, count: int | None = None) -> str:
        config = self.config
        if self._step_data == "foreign":
            return self.split.loader_hint
        broken = next((r.broken for r in self._recuts if r.broken), "")
        if broken:
            return f"the loop's data iterator cannot be re-cut: {broken}"
        if self.ep > 1:
            return (
                f"expert parallelism ({self.ep}) routes tokens across DP replicas in every "
                "micro-batch, so all replicas must run the same count"
            )
        if getattr(config, "enable_cuda_graph", False) or getattr(
            config, "cuda_graph_impl", "none"
        ) not in ("none", None):
            return "CUDA graphs are captured for a fixed number of micro-batches"
        if len(self.model) > 1 and count is not None:
            group = _vp_group(config, self.topology.pp)
            remainder = count % group
            if group > count or 0 < remainder < self.topology.pp:
                return (
                    f"the interleaved schedule cannot run {count} micro-batches with "
                    f"microbatch_group_size_per_vp_stage={group} and pipeline size "
                    f"{self.topology.pp}"
                )
        return SUPPORTED

    @hookimpl
    def failslow_prepare_microbatch_plan(self, plan: MicroBatchPlan, rank: int) -> bool:
        self.failslow_capabilities().require("microbatch_plans")
        counts = self.split.ready(plan)
        reason = self._microbatch_reason(counts[self.split.replica])
        if reason:
            raise ConfigError(f"micro-batch counts {list(counts)}: {reason}")
        return True

    @hookimpl
    def failslow_apply_microbatch_plan(self, plan: MicroBatchPlan, step: int) -> bool:
        self.split.apply(plan, step)
        return True

    @hookimpl
    def failslow_verify_microbatch_plan(
        self, plan: MicroBatchPlan, step: int, forwards: int
    ) -> str:
        return self.split.verify(plan, step, forwards)

    @hookimpl
    def failslow_observed_coord(self) -> tuple[int, int, int]:
        """(tp, dp, pp) ranks of this process in Megatron's current process groups."""
        from megatron.core import parallel_state as ps

        return (
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )

    # ---- S3: the swap in place (its flow is the kit's InPlaceSwap) -----------------------------
    def _become(self, topology: Topology, state: dict[str, Any], step: int, *, split: bool) -> None:
        """Run this process's role under ``topology`` from ``state`` (greyhound 5.2, S3):
        Megatron's groups rebuilt for the permuted grid, model/DDP/optimizer/scheduler rebuilt
        through ``model_provider``, the user's objects adopting them
        (:func:`~failslow.adapters.common.swap.adopt`), the state restored, the data share
        switched (``split``: the loaders' positions from ``state`` too, see :meth:`_restore`).
        A ``model_provider`` failing on one rank *before* a collective it issues on the others
        (Megatron's ``get_megatron_optimizer`` all-gathers over every rank) leaves them in that
        collective until the process group's timeout: the one failure the swap's rollback
        cannot undo."""
        from megatron.core.utils import get_model_config

        assert self.model_provider is not None
        role_of = topology.megatron_ranks()
        grid.rebuild_grid(role_of, self._grid_sizes)
        model, optimizer, scheduler = swap.built(self.model_provider(), "model_provider()")
        chunks = list(model) if isinstance(model, list | tuple) else [model]
        wait_for_snapshot_before(optimizer, "step", self)
        for old, new in zip(self.model, chunks, strict=True):
            swap.adopt(old, new, "model_provider()")
        swap.adopt(self.optimizer, optimizer, "model_provider()")
        if self.scheduler is not None and scheduler is not None:
            swap.adopt(self.scheduler, scheduler, "model_provider()")
        self.config = get_model_config(self.model[0])
        self.role_of, self.topology = role_of, topology
        self._layout = None
        self.split.set_replica(topology.coords[self.rank][1], step)
        self._restore(state, step, split=split)

    @hookimpl
    def failslow_snapshot_state(self, step: int) -> dict[str, Any]:
        """This rank's training state by reference (the snapshotter copies it off the training
        thread; the optimizer step waits for the copy)."""
        from megatron.core import tensor_parallel

        return {
            "model": [chunk.state_dict() for chunk in self.model],
            "optimizer": [_optimizer_state(opt) for opt in _optimizers(self.optimizer)],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rng_state(),
            "tp_rng": {
                name: state.clone()
                for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()
            },
            "iteration": self.iteration,
            "calculator": _calculator_state(),
            "split": self.split.state_dict(step),
            "role": self.role_of[self.rank],
            "step": step,
            "layout": self._layout_record(),
        }

    def _layout_record(self) -> dict[str, Any] | None:
        """Each tensor's layout-free identity (:mod:`.reshard`), once per layout; None where the
        state cannot be resharded anyway."""
        optimizers = _optimizers(self.optimizer)
        if self._layout is None and not reshard.refusal(optimizers):
            self._layout = reshard.layout_record(self.model, optimizers)
        return self._layout

    @hookimpl
    def failslow_restore_state(self, state: dict[str, Any], step: int) -> bool:
        """Every rank resumes together. A snapshot taken after a topology swap holds another
        role than this process's launch role (a restart in place): then every rank gathers the
        snapshots' roles once and rebuilds that placement before restoring."""
        import torch.distributed as dist

        role = int(state.get("role", self.role_of[self.rank]))
        if all_ranks_ok(role == self.role_of[self.rank], len(self.role_of)):
            self._restore(state, step, split=True)
            return True
        self.failslow_capabilities().require("topology_plans")
        roles: list[int | None] = [None] * len(self.role_of)
        dist.all_gather_object(roles, role)
        role_of = tuple(int(r) for r in roles)  # type: ignore[arg-type]
        coords = dict(zip(self.role_of, self.topology.coords, strict=True))
        topology = replace(self.topology, coords=tuple(coords[r] for r in role_of))
        self._become(topology, state, step, split=True)
        return True

    def _restore(self, state: dict[str, Any], step: int, *, split: bool) -> None:
        """Put ``state`` back; ``split``: the loaders' positions too (not in a swap, where the
        live loaders already stand at this step boundary)."""
        from megatron.core import tensor_parallel

        mine = self.role_of[self.rank]
        if state.get("role", mine) != mine:
            raise FailslowError(
                f"the snapshot of step {step} holds Megatron rank {state['role']}'s state, "
                f"this process runs rank {mine}"
            )

        for chunk, chunk_state in zip(self.model, state["model"], strict=True):
            chunk.load_state_dict(chunk_state)
        for opt, opt_state in zip(_optimizers(self.optimizer), state["optimizer"], strict=True):
            _load_optimizer_state(opt, opt_state)
        if state["scheduler"] is not None and self.scheduler is not None:
            _load_scheduler(self.scheduler, state["scheduler"])
        restore_rng_state(state["rng"])
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {name: s.clone() for name, s in state["tp_rng"].items()}
        )
        self.iteration = int(state["iteration"])
        _restore_calculator(state["calculator"])
        if split:
            self.split.load_state_dict(state["split"])
            self.topology = replace(self.topology, micro_batches=self.split.micro_batches)

    @hookimpl
    def failslow_restore_resharded(
        self, states: list[dict[str, Any]], step: int, old_rank: int | None
    ) -> bool:
        """A larger old world's step in this world's layout (odyssey III-IV): every model and
        optimizer tensor gathered by its identity (:mod:`.reshard`), the old global batch of
        ``M`` micro-batches split as evenly as it goes over this layout's ``D`` replicas, each
        weighted ``m_r * D / M`` (as S2 plans are), so the gradient is the old world's."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        self.failslow_capabilities().require("snapshots")
        optimizers = _optimizers(self.optimizer)
        why = reshard.refusal(optimizers) or next(
            ("an old rank's snapshot has no layout record" for s in states if not s["layout"]),
            "",
        )
        if why:
            raise ConfigError(why)
        reshard.load_resharded(self.model, optimizers, self._layout_record(), states)
        own = states[old_rank] if old_rank is not None else states[0]
        if states[0]["scheduler"] is not None and self.scheduler is not None:
            _load_scheduler(self.scheduler, states[0]["scheduler"])
        restore_rng_state(own["rng"])
        tp = reshard.tp_source(states, ps.get_tensor_model_parallel_rank())
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {name: s.clone() for name, s in tp["tp_rng"].items()}
        )
        self.iteration = int(states[0]["iteration"])
        micro_batches = sum(int(c) for c in states[0]["split"]["counts"])
        self.split.keep_global_batch(micro_batches)
        self.topology = replace(self.topology, micro_batches=micro_batches)
        return True

    @hookimpl
    def failslow_hot_update(self, code: dict[str, Any], step: int) -> bool:
        return True  # the process restarts outside; its state is in the committed snapshot

    def guard_optimizer_step(self) -> None:
        """Before the optimizer mutates the state, the pending snapshot's copy must be complete
        (byterobust 6.3)."""
        wait_for_snapshot_before(self.optimizer, "step", self)

    def global_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's model tensors by a name no layout changes (``<global key>@<offset>``:
        Megatron's sharded identity), so runs in different DP x PP layouts compare tensor by
        tensor; DP replicas name theirs alike."""
        out = {}
        for chunk, ids in zip(self.model, reshard.model_identities(self.model), strict=True):
            state = chunk.state_dict()
            out.update({f"{key}@{offset}": state[name] for name, (key, offset) in ids.items()})
        return out

    # ---- data --------------------------------------------------------------------------------
    def data_iterator(
        self,
        dataset: Any,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        **loader_kwargs: Any,
    ) -> Iterator[Any]:
        """An endless iterator of this replica's micro-batches (``micro_batch_size`` samples
        each) of every global batch, steps numbered by :attr:`iteration`, in step with applied
        plans: the ``data_iterator`` for ``forward_backward`` on first and last stages."""
        loader = self.split.loader(
            dataset,
            micro_batch_size=self.micro_batch_size,
            start_step=self.iteration,
            shuffle=shuffle,
            seed=seed,
            collate_fn=collate_fn,
            **loader_kwargs,
        )
        iterator = itertools.chain.from_iterable(itertools.repeat(loader))
        self._own_iterators.append(iterator)
        return iterator

    def _data_source(self, data: Any) -> str:
        """``"own"``, ``"none"`` or ``"foreign"`` for a step's ``data_iterator`` (a list of
        them, one per model chunk, on the interleaved schedule). The loop's own DataLoader
        iterators are re-cut per plan where their sampler allows it
        (:mod:`failslow.adapters.common.own_loader`): those are failslow's from then on."""
        given = [d for d in (data if isinstance(data, list | tuple) else [data]) if d is not None]
        if not given:
            return "none"
        for d in given:
            if any(d is it for it in self._own_iterators):
                continue
            recut, why = take_over(d, self.split, start_step=self.iteration)  # or its recut
            if recut is None:
                self._foreign(why)
                return "foreign"
            if recut not in self._recuts:
                self._recuts.append(recut)
        return "own"

    def _foreign(self, why: str) -> None:
        """The loop feeds an iterator failslow cannot re-cut: plans are refused with ``why``
        from now on, and the controller is told (it plans no S2 for the job)."""
        hint = f"the loop's data iterator cannot be re-cut: {why}; pass data_iterator="
        hint += "fs.data_iterator(dataset)"
        if self.split.loader_hint != hint:
            self.split.loader_hint = hint
            log.warning("failslow: %s", hint)
            if self.session is not None:
                self.session.capabilities_changed()

    # ---- training ----------------------------------------------------------------------------
    def forward_backward(self, **kwargs: Any) -> Any:
        """``get_forward_backward_func()(**kwargs)`` for this replica: the session's step
        boundary, then this replica's count of micro-batches with its gradient weight.

        ``num_microbatches`` is the even split's ``M / D`` (what the calculator says); a call
        with ``forward_only=True`` (evaluation) runs unchanged and is not a training step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        run = get_forward_backward_func()
        if kwargs.get("forward_only", False):
            return run(**kwargs)
        if self.session is not None:
            self.session.step_boundary(self.iteration)
        even = self.split.micro_batches // self.split.replicas
        asked = kwargs.get("num_microbatches")
        if asked == self._configured_count:  # the loop's own count: the split's even one
            asked = even
        if self.split.counts != (even,) * self.split.replicas and asked != even:
            raise FailslowError(
                f"forward_backward(num_microbatches={asked}): a micro-batch plan for "
                f"{self.split.micro_batches} micro-batches per step is in effect (even split "
                f"{even}); the global batch size must not change while it is"
            )
        kwargs["num_microbatches"] = self.split.count if asked == even else asked
        if self.session is not None and "forward_step_func" in kwargs:
            kwargs["forward_step_func"] = _announced(kwargs["forward_step_func"], self.session)
        weight = 1.0 if self.config.calculate_per_token_loss else self.split.weight
        self._step_data = self._data_source(kwargs.get("data_iterator"))
        self._step_scale = (
            None if self.config.calculate_per_token_loss else weight / kwargs["num_microbatches"]
        )
        scale = self.config.grad_scale_func
        if weight != 1.0:
            self.config.grad_scale_func = _weighted(scale, weight)
        try:
            result = run(**kwargs)
        finally:
            self.config.grad_scale_func = scale
        self.iteration += 1
        if not self._said_broken and any(r.broken for r in self._recuts):
            self._said_broken = True  # found while reading: the controller plans from it
            log.warning("failslow: %s", self._microbatch_reason())
            if self.session is not None:
                self.session.capabilities_changed()
        return result

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def _layers_per_stage(config: Any, pp: int) -> tuple[int, ...]:
    """Megatron's even split of the transformer layers over ``pp`` stages; () where the job
    splits them otherwise (first/last stage sizes, a layout string, virtual stages), which
    failslow does not rebuild on another pipeline split."""
    uneven = (
        getattr(config, "num_layers_in_first_pipeline_stage", None),
        getattr(config, "num_layers_in_last_pipeline_stage", None),
        getattr(config, "pipeline_model_parallel_layout", None),
        getattr(config, "virtual_pipeline_model_parallel_size", None),
    )
    if any(u is not None for u in uneven) or config.num_layers % pp:
        return ()
    return (config.num_layers // pp,) * pp


def _vp_group(config: Any, pp: int) -> int:
    """Micro-batches the interleaved schedule runs per virtual stage in a row (default PP)."""
    return config.microbatch_group_size_per_vp_stage or pp


def _announced(forward_step_func: Callable[..., Any], session: Any) -> Callable[..., Any]:
    """``forward_step_func`` that first tells the session a micro-batch (or, interleaved, a
    model chunk of one) starts; Megatron reads its parameters, so the signature is kept."""

    @functools.wraps(forward_step_func)
    def announced(*args: Any, **kwargs: Any) -> Any:
        session.micro_batch()
        return forward_step_func(*args, **kwargs)

    return announced


def _weighted(scale: Callable[[Any], Any] | None, weight: float) -> Callable[[Any], Any]:
    def weighted(loss: Any) -> Any:
        return (scale(loss) if scale is not None else loss) * weight

    return weighted


def _batch_shape(num_microbatches: int | None, micro_batch_size: int | None) -> tuple[int, int]:
    """Micro-batches per replica and samples per micro-batch: given, else the calculator's."""
    from megatron.core import num_microbatches_calculator as calc

    if num_microbatches is None or micro_batch_size is None:
        if calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
            raise ConfigError(
                "failslow.megatron.attach: pass num_microbatches= and micro_batch_size= (per "
                "DP replica), or initialize Megatron's num-microbatches calculator first"
            )
        num_microbatches = num_microbatches or calc.get_num_microbatches()
        micro_batch_size = micro_batch_size or calc.get_micro_batch_size()
    return int(num_microbatches), int(micro_batch_size)


def _calculator_state() -> dict[str, Any] | None:
    from megatron.core import num_microbatches_calculator as calc

    c = calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    return None if c is None else {k: copy.copy(v) for k, v in vars(c).items()}


def _restore_calculator(state: dict[str, Any] | None) -> None:
    from megatron.core import num_microbatches_calculator as calc

    c = calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if state is not None and c is not None:
        vars(c).update(state)


def _load_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """Put a scheduler's state back on a live scheduler. Megatron's OptimizerParamScheduler
    loads by stepping ``num_steps`` forward from where it stands (it expects a fresh one): a
    rollback in place from step 56 to a snapshot of step 32 landed at 88, and every later
    learning rate with it (seen preparing the GPU check, benchmarks/gpu). Start it from 0."""
    if hasattr(scheduler, "num_steps") and ("num_steps" in state or "num_iters" in state):
        scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _distributed(opt: Any) -> bool:
    return hasattr(opt, "get_parameter_state_dp_reshardable")


def _optimizer_state(opt: Any) -> dict[str, Any]:
    """One Megatron optimizer's state on this rank, without collectives."""
    if not _distributed(opt):
        return {"state": opt.state_dict()}
    # the common state (lr, step, loss scale); the inner optimizer has none before its first step
    common = opt.state_dict() if opt.optimizer.state else None
    return {"common": common, "shard": opt.get_parameter_state_dp_reshardable()}


def _load_optimizer_state(opt: Any, state: dict[str, Any]) -> None:
    if not _distributed(opt):
        opt.load_state_dict(state["state"])
        return
    if state["common"] is not None:
        opt.load_state_dict(state["common"])
        # without Apex/TE, a freshly allocated state shares one "step" tensor among all
        # parameters (Adam would then count it once per parameter): give each its own
        for param_state in opt.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()
    shard = state["shard"]
    for key, per_dtype in shard.items():
        if isinstance(key, int):  # mark this rank's own entries as data (its loader's format)
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    with torch.no_grad():  # fp32 main shards are views of the model's parameters
        opt.load_parameter_state_from_dp_reshardable(shard)
