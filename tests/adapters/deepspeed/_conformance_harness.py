"""The DeepSpeed harness of the conformance suite (:mod:`failslow.conformance`; DESIGN.md,
"Invariants the conformance suite checks for every adapter").

Four CPU ranks on gloo (``DS_ACCELERATOR=cpu``), one tiny MLP (16 -> 32 -> 32 -> 8, fp32, SGD,
``gradient_clipping: 0.0``) trained through ``failslow.deepspeed.initialize`` on a fixed, seeded
regression set, in five layouts:

- ``zero0``, ``zero1``, ``zero2``, ``zero3``: DP = 4, 2 micro-batches of 2 samples per replica;
- ``pipeline``, ``pipeline_zero1``: ``deepspeed.pipe.PipelineModule``, 2 stages x DP 2 (ZeRO 0
  and 1; DeepSpeed rejects ZeRO 2/3 with a pipeline), 4 micro-batches per replica;
- ``zero1_loop``, ``zero1_loop_workers``: ZeRO 1 trained by the user's own forward/backward/step
  loop over the loader from ``adapter.dataloader`` (no workers; 2 prefetching workers);
- ``zero2_loop``: ZeRO 2 in that loop (ZeRO 2 and 3 get the size form of S2: every replica runs
  ``G`` micro-batches, a plan changes their samples).

Which samples the model read is seen in its input: every row of ``x`` is looked up in the
dataset (the first pipeline stage's and the whole model's forwards).

Every layout has M = 8 micro-batches of 2 samples per global step. The expected collectives of
a step (invariant 1) are derived here from the model's parameter sizes and DeepSpeed's group
layout, never from a capture: see :meth:`DeepSpeedJob.expected_collectives`.

DeepSpeed's CPU accelerator would JIT-build its shared-memory inference all-reduce kernel at
``init_distributed`` (~100 s on 2 cores); training never uses it, so the harness skips the
build (test-only, as ``tests/nccl_hook/_ds_scenario.py`` does) unless
``FAILSLOW_TEST_DS_BUILD_SHM=1``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from failslow.conformance import AdapterHarness, AdapterJob, Collective
from failslow.demo.ds_worker import skip_shm_kernel_build

LAYOUTS: dict[str, tuple[int, bool]] = {
    "zero0": (0, False),
    "zero1": (1, False),
    "pipeline": (0, True),
    "pipeline_zero1": (1, True),
    "zero2": (2, False),
    "zero3": (3, False),
    "zero1_loop": (1, False),
    "zero1_loop_workers": (1, False),
    "zero2_loop": (2, False),
}
"""Layout name -> (ZeRO stage, pipeline engine)."""
LOOP_WORKERS: dict[str, int] = {"zero1_loop": 0, "zero1_loop_workers": 2, "zero2_loop": 0}
"""Layouts trained by the loop DeepSpeed's tutorials teach (``loss = engine(x, y);
engine.backward(loss); engine.step()`` over the share-aware loader) instead of
``engine.train_batch()``, with this many DataLoader workers (2: a loader that prefetches)."""
IN, HIDDEN, OUT = 16, 32, 8
MICRO_BATCH_SIZE = 2
MICRO_BATCHES = 8
"""M, micro-batches per global step (all DP replicas together)."""
SAMPLES = 128
PIPE_STAGES = 2
TENSOR_META_BYTES = 1024
"""The pipeline engine's first step sends its activation-meta buffer once (DeepSpeed 0.19)."""
FP32 = 4


def _layers() -> list[Any]:
    import torch

    return [
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    ]


def _regression() -> Any:
    import torch

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*_layers())

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(x), y)

    return Regression()


class DeepSpeedJob(AdapterJob):
    def __init__(self, layout: str, seed: int, settings: Mapping[str, Any] | None) -> None:
        import torch
        import torch.distributed as dist

        import failslow.deepspeed

        self.stage, self.pipeline = LAYOUTS[layout]
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.dp = world // PIPE_STAGES if self.pipeline else world
        torch.manual_seed(seed)
        if self.pipeline:
            from deepspeed.pipe import PipelineModule

            model = PipelineModule(
                layers=_layers(),
                num_stages=PIPE_STAGES,
                loss_fn=torch.nn.MSELoss(),
                partition_method="uniform",
            )
        else:
            model = _regression()
        self.param_numels = [p.numel() for p in model.parameters()]  # this rank's stage, full
        self.forwards = 0
        model.register_forward_pre_hook(self._count_forward)
        g = torch.Generator().manual_seed(seed)
        dataset = torch.utils.data.TensorDataset(
            torch.randn(SAMPLES, IN, generator=g), torch.randn(SAMPLES, OUT, generator=g)
        )
        self.reads_inputs = not self.pipeline or self.rank // self.dp == 0
        self._index = {row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])}
        self.samples: list[int] = []
        config = {
            "train_batch_size": MICRO_BATCH_SIZE * MICRO_BATCHES,
            "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
            "gradient_accumulation_steps": MICRO_BATCHES // self.dp,
            # momentum: optimizer state a snapshot must carry (invariant 4)
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": self.stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "failslow": {**(settings or {}), "capture": True},
        }
        self.workers = LOOP_WORKERS.get(layout)
        self.engine, _, _, _ = failslow.deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=config,
            training_data=dataset if self.workers is None else None,
        )
        self.session = self.engine.failslow.session
        self._batches: Any = None
        if self.workers is not None:
            self.loader = self.engine.failslow.dataloader(dataset, num_workers=self.workers)

    def _count_forward(self, module: Any, args: Any) -> None:
        self.forwards += 1
        if self.reads_inputs and module.training:
            # -1: a row that is no sample of the dataset
            x = args[0][0] if isinstance(args[0], tuple | list) else args[0]
            self.samples += [self._index.get(row.numpy().tobytes(), -1) for row in x]

    # ---- AdapterJob ------------------------------------------------------------------------
    def run_step(self, step: int) -> None:
        if self.engine.global_steps != step:
            raise AssertionError(f"engine at global step {self.engine.global_steps}, not {step}")
        if self.workers is None:
            self.engine.train_batch()
            return
        # the user's loop: micro-batches from the loader until the engine took its step
        if self._batches is None:
            self._batches = iter(self._repeat())
        while self.engine.global_steps == step:
            x, y = next(self._batches)
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()

    def _repeat(self) -> Any:
        while True:
            yield from self.loader

    def micro_batches_run(self) -> int:
        return self.forwards

    def samples_read(self) -> list[int]:
        return self.samples

    def parameters(self) -> dict[str, np.ndarray]:
        module = self.engine.module

        def values() -> dict[str, np.ndarray]:
            return {
                name: p.detach().float().cpu().numpy().copy()
                for name, p in module.named_parameters()
            }

        if self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return values()
        return values()

    def expected_collectives(self, step: int) -> Sequence[Collective] | None:
        """What DeepSpeed issues in one step on CPU/gloo, from parameter sizes alone.

        ``P`` is the parameter bytes of this rank's model part, ``G = M / DP`` the micro-batches
        per replica. ZeRO 0: one all-reduce of P (the gradient). ZeRO 1: that, a scalar
        all-reduce (global gradient norm) and the all-gather of the updated partitions (P / DP
        per rank). ZeRO 2 reduces in every micro-step's backward: G all-reduces of P. ZeRO 3:
        G reduce-scatters of P, an 8-byte all-reduce, and one all-gather per parameter of its
        partition; its first step also fetches the partitioned parameters (not modelled).
        Pipeline: per micro-batch the activations go forward and their gradients back between
        the stages (send/recv on the default group; the first step also sends the meta
        buffer), the gradient all-reduce of the stage's P over its DP group, the last stage's
        loss all-reduce over DP (4 bytes), and the loss broadcast from the last stage (8 bytes);
        with ZeRO 1 also the gradient norm over DP and over the pipe (4 bytes each) and the
        all-gather of the stage's partitions.
        """
        import torch.distributed as dist

        world = tuple(range(dist.get_world_size()))
        P = sum(self.param_numels) * FP32
        G = MICRO_BATCHES // self.dp
        if not self.pipeline:
            dp = world
            if self.stage == 0:
                return [Collective("ALLREDUCE", dp, P)]
            if self.stage in (1, 2):
                grads = [Collective("ALLREDUCE", dp, P)] * (1 if self.stage == 1 else G)
                return [
                    *grads,
                    Collective("ALLREDUCE", dp, FP32),
                    Collective("ALLGATHER", dp, P // self.dp),
                ]
            if step == 0:
                return None
            return [
                *[Collective("REDUCE_SCATTER", dp, P)] * G,
                Collective("ALLREDUCE", dp, 2 * FP32),
                *[Collective("ALLGATHER", dp, n * FP32 // self.dp) for n in self.param_numels],
            ]
        stage, replica = divmod(self.rank, self.dp)
        dp = tuple(stage * self.dp + d for d in range(self.dp))
        pipe = tuple(s * self.dp + replica for s in range(PIPE_STAGES))
        peer, last = pipe[1 - stage], pipe[-1]
        activation = MICRO_BATCH_SIZE * HIDDEN * FP32
        first = stage == 0
        out, back = ("SEND", "RECV") if first else ("RECV", "SEND")
        per_micro_batch = [
            Collective(out, world, activation, peer),
            Collective(back, world, activation, peer),
        ]
        expected = per_micro_batch * G + [
            Collective("ALLREDUCE", dp, P),
            Collective("BROADCAST", pipe, 2 * FP32, last),
        ]
        if not first:
            expected.append(Collective("ALLREDUCE", dp, FP32))
        if self.stage == 1:  # gradient norm over DP and over the pipe; gather the partitions
            expected += [
                Collective("ALLREDUCE", dp, FP32),
                Collective("ALLREDUCE", pipe, FP32),
                Collective("ALLGATHER", dp, P // self.dp),
            ]
        if step == 0:
            expected.append(Collective(out, world, TENSOR_META_BYTES, peer))
        return expected

    def close(self) -> None:
        if self._batches is not None:
            # the loader's iterator ends here, not in a later garbage collection: an iterator
            # with worker processes that the cycle collector finalizes waits out each worker's
            # join timeout (5 s; 80 s of this world's 107 s before this line)
            self._batches.close()
            self._batches = None
        self.engine.failslow.close()
        self.engine.destroy()
        if self.pipeline:  # the pipeline engine leaves its grid as DeepSpeed's global mpu
            from deepspeed.utils import groups

            groups.mpu = None


class DeepSpeedHarness(AdapterHarness):
    world_size = 4
    world_timeout_s = 600.0  # a bound for a hung world, not a speed target (CI is slow)

    def layouts(self) -> Sequence[str]:
        return list(LAYOUTS)

    def rank_env(self) -> Mapping[str, str]:
        env = {"DS_ACCELERATOR": "cpu"}
        if os.environ.get("FAILSLOW_TEST_DS_BUILD_SHM") == "1":
            env["FAILSLOW_TEST_DS_BUILD_SHM"] = "1"
        return env

    def setup_rank(self) -> None:
        if os.environ.get("FAILSLOW_TEST_DS_BUILD_SHM") != "1":
            skip_shm_kernel_build()
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")

    def build(
        self, layout: str, seed: int, failslow: Mapping[str, Any] | None = None
    ) -> DeepSpeedJob:
        return DeepSpeedJob(layout, seed, failslow)
