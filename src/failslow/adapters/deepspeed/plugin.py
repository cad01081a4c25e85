"""The DeepSpeed engine as a failslow plugin: topology, capabilities, micro-batch plans (S2).

Translates only. Per-replica micro-batch counts (greyhound 5.2) map onto DeepSpeed as:

- non-pipeline engines, ZeRO 0/1: :meth:`DeepSpeedAdapter.train_batch` runs this replica's
  count of micro-steps and drives ``set_gradient_accumulation_boundary`` so the gradient
  all-reduce and the optimizer step happen after its last one. ``engine.backward`` divides
  every micro-loss by the configured G = M / D, so replica r contributes
  ``sum(its losses) / G`` and the DP mean is ``sum(all M losses) / (D * G)``: the even split's
  gradient, i.e. weight ``m_r * D / M`` on the replica's mean, with no extra scaling;
- pipeline engine: ``engine.micro_batches`` is the count of this replica (all its stages);
  DeepSpeed scales by 1/G the same way.

ZeRO 2/3 reduce (and partition) gradients inside every micro-step's backward, so replicas must
run equal counts: plans are declared unsupported there.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from failslow import hookimpl
from failslow.capabilities import SUPPORTED, Capabilities
from failslow.core.planner.plans import MicroBatchPlan
from failslow.core.topology import Topology
from failslow.data import ShareSampler, check_counts, share_loader
from failslow.errors import ConfigError

NOT_YET = "not implemented for DeepSpeed yet (in-memory checkpoints: issue 7)"
NO_REGROUP = "DeepSpeed cannot rebuild its process groups in place"


def _is_pipeline(engine: Any) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


class DeepSpeedAdapter:
    """One engine's plugin; ``attach`` registers it on a :class:`failslow.session.Session`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.session: Any = None
        self.pipeline = _is_pipeline(engine)
        if self.pipeline:
            grid = engine.grid
            coord = (
                grid.get_slice_parallel_rank(),
                grid.get_data_parallel_id(),
                grid.get_stage_id(),
            )
            self.dp, pp = grid.data_parallel_size, grid.pipe_parallel_size
        else:
            mpu = engine.mpu
            tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
            dp_rank = mpu.get_data_parallel_rank() if mpu is not None else dist.get_rank()
            coord, self.dp, pp = (tp_rank, dp_rank, 0), engine.dp_world_size, 1
        self.replica = coord[1]
        self.micro_batches = engine.gradient_accumulation_steps() * self.dp
        self.counts: tuple[int, ...] = (self.micro_batches // self.dp,) * self.dp
        self.samplers: list[ShareSampler] = []
        self._data_iter: Iterator[Any] | None = None
        world = dist.get_world_size()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (socket.gethostname(), coord))
        self.topology = Topology(
            tp=world // (self.dp * pp),
            dp=self.dp,
            pp=pp,
            coords=tuple(tuple(c) for _, c in gathered),
            hosts=tuple(h for h, _ in gathered),
            micro_batches=self.micro_batches,
            micro_batch_size=engine.train_micro_batch_size_per_gpu(),
        )

    # ---- hooks -------------------------------------------------------------------------------
    @hookimpl
    def failslow_report_topology(self) -> Topology:
        return self.topology

    @hookimpl
    def failslow_capabilities(self) -> Capabilities:
        stage = self.engine.zero_optimization_stage()
        microbatch = SUPPORTED
        if stage >= 2:
            microbatch = (
                f"DeepSpeed ZeRO stage {stage} reduces gradients inside every micro-step's "
                "backward, so all DP replicas must run the same number of micro-batches; "
                "use ZeRO stage 0 or 1, or the pipeline engine"
            )
        elif not self.pipeline and not self.engine.managed_gradient_accumulation():
            microbatch = "managed_gradient_accumulation=false is not handled yet"
        return Capabilities(
            microbatch_plans=microbatch,
            topology_plans=NO_REGROUP,
            snapshots=NOT_YET,
            hot_update=NOT_YET,
        )

    @hookimpl
    def failslow_prepare_microbatch_plan(self, plan: MicroBatchPlan, rank: int) -> bool:
        self.failslow_capabilities().require("microbatch_plans")
        counts = check_counts(plan.counts, replicas=self.dp, micro_batches=self.micro_batches)
        if min(counts) < 1:
            raise ConfigError(
                f"micro-batch counts {list(counts)}: every DP replica of a DeepSpeed job must "
                "run at least 1 micro-batch per step"
            )
        return True

    @hookimpl
    def failslow_apply_microbatch_plan(self, plan: MicroBatchPlan, step: int) -> bool:
        self.counts = tuple(plan.counts)
        if self.pipeline:
            self.engine.micro_batches = self.counts[self.replica]
        for sampler in self.samplers:
            sampler.set_counts(self.counts, step=step)
        return True

    # ---- data --------------------------------------------------------------------------------
    def dataloader(
        self,
        dataset: Any,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        **loader_kwargs: Any,
    ) -> torch.utils.data.DataLoader[Any]:
        """A loader of this replica's exact share of every global batch (failslow.data),
        numbered by the engine's global steps and kept in step with applied plans."""
        loader = share_loader(
            dataset,
            micro_batch_size=self.topology.micro_batch_size,
            micro_batches=self.micro_batches,
            replica=self.replica,
            replicas=self.dp,
            counts=self.counts,
            shuffle=shuffle,
            seed=seed,
            start_step=self.engine.global_steps,
            collate_fn=collate_fn,
            **loader_kwargs,
        )
        self.track(loader.batch_sampler)  # type: ignore[arg-type]
        from deepspeed.utils import RepeatingLoader

        if self.pipeline:
            self.engine.set_dataloader(RepeatingLoader(loader))
        else:
            self.engine.training_dataloader = loader
            self._data_iter = iter(RepeatingLoader(loader))
        return loader

    def track(self, sampler: ShareSampler) -> None:
        """Keep a user-built :class:`ShareSampler` (steps numbered like the engine's
        ``global_steps``) in step with the plans applied here."""
        self.samplers.append(sampler)

    # ---- training ----------------------------------------------------------------------------
    def train_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One global step: the session's step boundary, then this replica's micro-batches.

        Pipeline engine: ``PipelineEngine.train_batch``. Otherwise each item of ``data_iter``
        (default: the loader from :meth:`dataloader`) is one micro-batch; the model returns
        the loss (called with ``*batch`` for a tuple/list, ``**batch`` for a dict), or with
        ``loss_fn`` the loss is ``loss_fn(engine(batch[0]), batch[1])``. Returns the mean of
        this replica's micro-batch losses (no collective). It sets the engine's gradient
        accumulation boundary itself: do not mix it with a hand-written backward/step loop.
        """
        engine = self.engine
        if self.session is not None:
            self.session.step_boundary(engine.global_steps)
        if self.pipeline:
            return type(engine).train_batch(engine, data_iter)
        it = data_iter if data_iter is not None else self._data_iter
        if it is None:
            raise ConfigError("train_batch: pass data_iter, or build the engine with training_data")
        count = self.counts[self.replica]
        total = torch.zeros(())
        for i in range(count):
            batch = next(it)
            engine.set_gradient_accumulation_boundary(i == count - 1)
            if loss_fn is not None:
                loss = loss_fn(engine(batch[0]), batch[1])
            elif isinstance(batch, dict):
                loss = engine(**batch)
            elif isinstance(batch, tuple | list):
                loss = engine(*batch)
            else:
                loss = engine(batch)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        return total / count

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
