"""The Accelerate harness of the conformance suite (:mod:`failslow.conformance`).

Four CPU ranks on gloo, the FSDP harness's MLP and data (:mod:`tests.adapters.fsdp.
_conformance_harness`), trained by the loop Accelerate's tutorials teach - ``accelerator.
prepare``, ``with accelerator.accumulate(model)``, ``accelerator.backward``, the prepared
optimizer's and scheduler's ``step`` and ``zero_grad`` - with ``failslow.accelerate.attach``
called right after the ``Accelerator`` is built (before ``prepare``), in three layouts:

- ``ddp``: ``Accelerator(cpu=True)`` (DDP over 4 ranks), 2 micro-batches per rank and step;
- ``fsdp2``: Accelerate's FSDP2 plugin (``fsdp_version=2``, the whole MLP one FSDP unit) with
  ``unshard_once=True``;
- ``fsdp2_default``: the same without the opt-in: every rank runs its 2 micro-batches and a plan
  sizes them (S2's size form, issue 46).

Accelerate ignores an FSDP plugin when ``cpu=True`` (it picks MULTI_CPU); this harness flips
Accelerate's shared state to FSDP after building the ``Accelerator`` (test-only, as
FRAMEWORKS_ON_CPU.md records: the device is already the CPU). The scheduler is a ``StepLR``
(prepared: Accelerate steps it once per process per real step) so its state is part of every
snapshot. Which samples the model read is seen in its input (every row of ``x`` looked up in
the dataset).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from failslow.conformance import AdapterHarness, AdapterJob, Collective

from ..fsdp._conformance_harness import (
    FP32,
    MICRO_BATCH_SIZE,
    MICRO_BATCHES,
    SAMPLES,
    SIZES,
    full_parameters,
)

LAYOUTS = ("ddp", "fsdp2", "fsdp2_default")


def make_accelerator(layout: str, accumulation: int) -> Any:
    """A fresh ``Accelerator`` for ``layout`` (Accelerate's process-wide state reset first)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state()
    GradientState._reset_state()
    if PartialState._shared_state:  # an earlier layout may have flipped it to FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
    if layout == "ddp":
        return Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(
        cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=accumulation
    )
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    assert accelerator.is_fsdp2, "the harness did not get Accelerate's FSDP2 path"
    return accelerator


class AccelerateJob(AdapterJob):
    def __init__(self, layout: str, seed: int, settings: Mapping[str, Any] | None) -> None:
        import torch
        import torch.distributed as dist

        import failslow.accelerate

        self.layout = layout
        self.world = dist.get_world_size()
        accumulation = MICRO_BATCHES // self.world
        self.accelerator = make_accelerator(layout, accumulation)
        fs = failslow.accelerate.attach(
            self.accelerator,
            config={**(settings or {}), "capture": True},
            micro_batch_size=MICRO_BATCH_SIZE,
            unshard_once=layout == "fsdp2",
        )
        torch.manual_seed(seed)
        layers: list[Any] = []
        for a, b in itertools.pairwise(SIZES):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers[:-1])
        self.shapes = [tuple(p.shape) for p in net.parameters()]
        self.forwards = 0
        net.register_forward_pre_hook(self._count_forward)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(
            net, optimizer, scheduler
        )
        self.fs = fs
        self.session = fs.session
        g = torch.Generator().manual_seed(seed)
        dataset = torch.utils.data.TensorDataset(
            torch.randn(SAMPLES, SIZES[0], generator=g),
            torch.randn(SAMPLES, SIZES[-1], generator=g),
        )
        self._index = {row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])}
        self.samples: list[int] = []
        self.loader = fs.loader(dataset)
        self.batches = itertools.chain.from_iterable(itertools.repeat(self.loader))

    def _count_forward(self, module: Any, args: Any) -> None:
        self.forwards += 1
        if module.training:  # -1: a row that is no sample of the dataset
            self.samples += [self._index.get(row.numpy().tobytes(), -1) for row in args[0]]

    def run_step(self, step: int) -> None:
        """Accelerate's loop, micro-batch by micro-batch, until the optimizer stepped."""
        import torch

        if self.fs.iteration != step:
            raise AssertionError(f"adapter at step {self.fs.iteration}, not {step}")
        while self.fs.iteration == step:
            x, y = next(self.batches)
            with self.accelerator.accumulate(self.model):
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                self.accelerator.backward(loss)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()

    def micro_batches_run(self) -> int:
        return self.forwards

    def samples_read(self) -> list[int]:
        return self.samples

    def parameters(self) -> dict[str, np.ndarray]:
        return full_parameters(self.model)

    def expected_collectives(self, step: int) -> Sequence[Collective] | None:
        """DDP: one all-reduce of every gradient per step (one bucket; pinned at attach).
        FSDP2 with the whole MLP one unit of shard ``S = sum(ceil(rows / 4) * row_bytes)``:
        ``unshard_once``, one all-gather of ``S`` (first forward) and one reduce-scatter of
        ``4 S`` (last backward); by default the unit is resharded after every backward
        (not after forward: Accelerate wraps the root, which FSDP2 keeps gathered through its
        backward), so one all-gather per micro-batch, and one reduce-scatter (Accelerate's
        ``accumulate`` turns the others' gradient sync off)."""
        world = tuple(range(self.world))
        G = MICRO_BATCHES // self.world
        if self.layout == "ddp":
            total = sum(int(np.prod(s)) for s in self.shapes) * FP32
            return [Collective("ALLREDUCE", world, total)]
        S = 0
        for shape in self.shapes:
            row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            S += -(-shape[0] // self.world) * row * FP32
        gathers = 1 if self.layout == "fsdp2" else G
        return [Collective("ALLGATHER", world, S)] * gathers + [
            Collective("REDUCE_SCATTER", world, S * self.world)
        ]

    def close(self) -> None:
        self.fs.close()
        self.accelerator.free_memory()


class AccelerateHarness(AdapterHarness):
    world_size = 4
    world_timeout_s = 600.0  # a bound for a hung world, not a speed target (CI is slow)

    def layouts(self) -> Sequence[str]:
        return list(LAYOUTS)

    def build(
        self, layout: str, seed: int, failslow: Mapping[str, Any] | None = None
    ) -> AccelerateJob:
        return AccelerateJob(layout, seed, failslow)
