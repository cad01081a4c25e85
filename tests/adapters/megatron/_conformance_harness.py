"""The Megatron-core harness of the conformance suite (:mod:`failslow.conformance`).

Four CPU ranks on gloo, the GPT job of :mod:`failslow.demo.megatron_job` (GPTModel with the
local layer spec, 4 layers, hidden 64, Megatron DDP, Adam through ``get_megatron_optimizer``,
``OptimizerParamScheduler``) trained by the Megatron-LM loop with ``fs.forward_backward``, in
four layouts: TP1 x PP2 x DP2 and TP2 x PP1 x DP2, each with and without the distributed
optimizer. M = 8 micro-batches of 2 sequences per global step (4 per replica).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from failslow.conformance import AdapterHarness, AdapterJob, Collective

LAYOUTS: dict[str, tuple[int, int, bool]] = {
    "tp1_pp2_dp2": (1, 2, False),
    "tp1_pp2_dp2_distopt": (1, 2, True),
    "tp2_pp1_dp2": (2, 1, False),
    "tp2_pp1_dp2_distopt": (2, 1, True),
}
"""Layout name -> (TP, PP, distributed optimizer)."""
MICRO_BATCHES_PER_REPLICA = 4


class MegatronJob(AdapterJob):
    def __init__(self, layout: str, seed: int, settings: Mapping[str, Any] | None) -> None:
        from megatron.core import parallel_state as ps

        import failslow.megatron
        from failslow.demo.megatron_job import build_gpt

        tp, pp, distopt = LAYOUTS[layout]
        self.job = build_gpt(tp, pp, seed=seed, distributed_optimizer=distopt)
        self.forwards = 0
        self.distributed = distopt
        self.param_bytes = _buffer_bytes(
            [p.numel() for p in self.job.model[0].module.parameters()],
            ps.get_data_parallel_world_size(),
            distopt,
        )
        self.job.model[0].module.register_forward_pre_hook(self._count_forward)
        self.adapter = failslow.megatron.attach(
            self.job.model,
            self.job.optimizer,
            self.job.scheduler,
            model_provider=self.job.extra["model_provider"],
            config={**(settings or {}), "capture": True},
            num_microbatches=MICRO_BATCHES_PER_REPLICA,
            micro_batch_size=self.job.shape.micro_batch_size,
        )
        self.session = self.adapter.session
        self.data = self.adapter.data_iterator(self.job.dataset, seed=seed)

    def _count_forward(self, module: Any, args: Any) -> None:
        self.forwards += 1

    def run_step(self, step: int) -> None:
        from failslow.demo.megatron_job import train_step

        if self.adapter.iteration != step:
            raise AssertionError(f"adapter at iteration {self.adapter.iteration}, not {step}")
        train_step(self.job, self.adapter, self.data)

    def micro_batches_run(self) -> int:
        return self.forwards

    def parameters(self) -> dict[str, np.ndarray]:
        """This rank's parameters (its tensor-parallel shard: the suite compares rank by rank)."""
        return {
            name: p.detach().float().cpu().numpy().copy()
            for name, p in self.job.model[0].module.named_parameters()
        }

    def expected_collectives(self, step: int) -> Sequence[Collective] | None:
        """What one Megatron-core step issues on CPU/gloo, from the model and the grid alone.

        ``m = 4`` micro-batches, activations ``A = seq * mbs * hidden * 4`` bytes.
        Pipeline (PP group, peer the neighbour stage): per micro-batch the first stage sends
        its activations and receives their gradient, the last stage the reverse. Tensor
        parallelism (TP group, only when TP > 1): per micro-batch and layer one all-reduce of
        A in the forward (attention projection and MLP output, row-parallel) and one in the
        backward (QKV and MLP input, column-parallel), plus the vocab-parallel embedding's
        forward on the first stage and the output layer's input gradient on the last. The
        vocab-parallel cross entropy (last stage) all-reduces three ``seq * mbs`` float
        tensors per micro-batch over the TP group even when it has one rank. Gradients over
        DP: one coalesced all-reduce of the stage's parameter bytes ``P``, or with the
        distributed optimizer a coalesced reduce-scatter of ``P`` (the buffer padded as
        Megatron pads it) and an all-gather of this rank's ``P / DP``. The gradient norm
        (computed although clipping is off): a 4-byte all-reduce over the model-parallel
        group (TP x PP), with the distributed optimizer over every rank holding a shard of
        the stage (model-parallel x DP).
        """
        from megatron.core import parallel_state as ps

        shape = self.job.shape
        m, act, fp32 = MICRO_BATCHES_PER_REPLICA, shape.seq * shape.micro_batch_size, 4
        A = act * shape.hidden * fp32
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        tp = _ranks(ps.get_tensor_model_parallel_group())
        pp = _ranks(ps.get_pipeline_model_parallel_group())
        dp = _ranks(ps.get_data_parallel_group())
        out: list[Collective] = []
        if len(pp) > 1:
            stage = ps.get_pipeline_model_parallel_rank()
            if not last:
                out += [Collective("SEND", pp, A, pp[stage + 1]),
                        Collective("RECV", pp, A, pp[stage + 1])] * m  # fmt: skip
            if not first:
                out += [Collective("RECV", pp, A, pp[stage - 1]),
                        Collective("SEND", pp, A, pp[stage - 1])] * m  # fmt: skip
        if len(tp) > 1:
            layers = len(self.job.model[0].module.decoder.layers)
            out += [Collective("ALLREDUCE", tp, A)] * (m * (4 * layers + first + last))
        if last:
            out += [Collective("ALLREDUCE", tp, act * fp32)] * (3 * m)
        P = self.param_bytes
        if self.distributed:
            out += [Collective("REDUCE_SCATTER_COALESCED", dp, P),
                    Collective("ALLGATHER_COALESCED", dp, P // len(dp)),
                    Collective("ALLREDUCE", tuple(range(_world())), fp32)]  # fmt: skip
        else:
            model_parallel = _ranks(ps.get_model_parallel_group())
            out += [Collective("ALLREDUCE_COALESCED", dp, P),
                    Collective("ALLREDUCE", model_parallel, fp32)]  # fmt: skip
        return out

    def close(self) -> None:
        self.adapter.close()


def _ranks(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _buffer_bytes(numels: Sequence[int], dp: int, distributed: bool) -> int:
    """Bytes of Megatron's fp32 gradient buffer: with the distributed optimizer each parameter
    starts at a multiple of 64 elements and the buffer ends at a multiple of lcm(DP, 128)."""
    if not distributed:
        return 4 * sum(numels)
    total = 0
    for n in numels:
        total = -(-total // 64) * 64 + n
    unit = math.lcm(dp, 128)
    return 4 * (-(-total // unit) * unit)


class MegatronHarness(AdapterHarness):
    world_size = 4
    world_timeout_s = 600.0  # a bound for a hung world, not a speed target (CI is slow)

    def layouts(self) -> Sequence[str]:
        return list(LAYOUTS)

    def build(
        self, layout: str, seed: int, failslow: Mapping[str, Any] | None = None
    ) -> MegatronJob:
        return MegatronJob(layout, seed, failslow)
