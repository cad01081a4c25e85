"""The FSDP2/HSDP/DDP harness of the conformance suite (:mod:`failslow.conformance`).

Four CPU ranks on gloo, one MLP (16 -> 30 -> 36 -> 6, fp32, AdamW: optimizer state with a
step count that a snapshot must carry), each ``Linear`` and the root ``fully_shard``-ed, trained
through ``failslow.fsdp.attach`` and ``fs.train_step`` on a fixed, seeded regression set, in
four layouts:

- ``ddp``: ``DistributedDataParallel``, DP 4, 2 micro-batches per rank and step;
- ``fsdp``: FSDP2 on a 1-D mesh of 4, ``unshard_once=True`` (the opt-in that allows plans);
- ``fsdp_default``: FSDP2 on a 1-D mesh of 4 as users shard by default: every rank runs the
  even split's 2 micro-batches and a plan sizes them (S2's size form, issue 46);
- ``hsdp_2x2``: FSDP2 on a (replicate 2, shard 2) mesh; 4 micro-batches per replica, each
  shard rank computing on its half of every micro-batch.

Every layout has M = 8 micro-batch slots of 2 samples per rank. 30 and 6 rows do not divide
by 4, so FSDP2 pads those shards over 4 ranks (:func:`padded_rows`) and the padding is part of
what is checked. Expected collectives are derived from the parameter shapes
and FSDP2's schedule, never from a capture (:meth:`FSDPJob.expected_collectives`). Which
samples the model read is seen in its input: every row of ``x`` is looked up in the dataset.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from failslow.conformance import AdapterHarness, AdapterJob, Collective

LAYOUTS = ("ddp", "fsdp", "fsdp_default", "hsdp_2x2")
SIZES = (16, 30, 36, 6)
MICRO_BATCH_SIZE = 2
MICRO_BATCHES = 8
"""Micro-batch slots per global step, all replicas together (an HSDP slot is one micro-batch
on each shard rank of the replica)."""
SAMPLES = 256
FP32 = 4
SHAPES = [s for a, b in itertools.pairwise(SIZES) for s in ((b, a), (b,))]
"""The parameters' full shapes: each Linear's weight and bias."""


def padded_rows(rows: int, shards: int) -> int:
    """Rows of one rank's shard of a dim-0 size ``rows`` parameter (FSDP2 pads dim 0 up to a
    multiple of the shard count)."""
    return -(-rows // shards)


def full_parameters(model: Any) -> dict[str, np.ndarray]:
    """Full parameter values by name, DDP's ``module.`` prefix dropped (FSDP: gathered, a
    collective every rank makes here)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix("module.")] = value.detach().float().numpy().copy()
    return out


class FSDPJob(AdapterJob):
    def __init__(self, layout: str, seed: int, settings: Mapping[str, Any] | None) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import failslow.fsdp

        self.layout = layout
        world = dist.get_world_size()
        torch.manual_seed(seed)
        self.mesh: Any = None
        if layout == "ddp":
            self.replicas, self.shards = world, 1
        elif layout == "hsdp_2x2":
            self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            self.replicas, self.shards = 2, 2
        else:
            self.mesh = init_device_mesh("cpu", (world,))
            self.replicas, self.shards = world, world
        self.forwards = 0
        self.model, optimizer = self._build(self.mesh)
        self.shapes = list(SHAPES)
        self.fs = failslow.fsdp.attach(
            self.model,
            optimizer,
            mesh=self.mesh,
            model_factory=self._build if layout == "hsdp_2x2" else None,
            config={**(settings or {}), "capture": True},
            accumulation_steps=MICRO_BATCHES // self.replicas,
            micro_batch_size=MICRO_BATCH_SIZE,
            unshard_once=layout == "fsdp",
        )
        self.session = self.fs.session
        g = torch.Generator().manual_seed(seed)
        dataset = torch.utils.data.TensorDataset(
            torch.randn(SAMPLES, SIZES[0], generator=g),
            torch.randn(SAMPLES, SIZES[-1], generator=g),
        )
        self._index = {row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])}
        self.samples: list[int] = []
        self.data = itertools.chain.from_iterable(itertools.repeat(self.fs.loader(dataset)))

    def _count_forward(self, module: Any, args: Any) -> None:
        self.forwards += 1
        if module.training:  # -1: a row that is no sample of the dataset
            self.samples += [self._index.get(row.numpy().tobytes(), -1) for row in args[0]]

    def _build(self, mesh: Any) -> tuple[Any, Any]:
        """The MLP wrapped for this layout and its optimizer; also the HSDP ``model_factory``
        (a topology swap calls it with the new mesh; the values it starts from are replaced
        by the moved state)."""
        import torch
        from torch.distributed.fsdp import fully_shard

        layers: list[Any] = []
        for a, b in itertools.pairwise(SIZES):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers[:-1])
        net.register_forward_pre_hook(self._count_forward)
        if self.layout == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(net)
        else:
            for layer in net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            model = fully_shard(net, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def run_step(self, step: int) -> None:
        import torch

        if self.fs.iteration != step:
            raise AssertionError(f"adapter at step {self.fs.iteration}, not {step}")
        self.fs.train_step(self.data, torch.nn.functional.mse_loss)

    def micro_batches_run(self) -> int:
        return self.forwards

    def samples_read(self) -> list[int]:
        return self.samples

    def parameters(self) -> dict[str, np.ndarray]:
        return full_parameters(self.model)

    def expected_collectives(self, step: int) -> Sequence[Collective] | None:
        """What one step issues on CPU/gloo, from the parameter shapes and FSDP2's schedule.

        DDP: one all-reduce of the gradient bucket per step (all parameters fit DDP's first
        25 MB bucket), issued in the last micro-batch's backward.
        The adapter pins DDP's bucket layout at attach, so no bucket rebuild (and its two
        broadcasts) happens in step 1.
        FSDP2, per ``Linear`` (a param group of weight and bias; the root holds no parameter of
        its own): this rank's shard is ``S = sum(padded_rows(rows, N) * row_bytes)`` over the
        group's parameters, ``N`` shard ranks. Default (``fsdp_default``): per micro-batch an
        all-gather of ``S`` in the forward, again in the backward (every ``Linear`` reshards
        after forward) and a reduce-scatter of the padded full ``N * S``. ``unshard_once``: one
        all-gather and one reduce-scatter per group and step. HSDP: per micro-batch the
        forward and backward all-gathers and the reduce-scatter over the shard group, and one
        all-reduce of ``S`` over the replicate group per step.
        """
        import torch.distributed as dist

        world = tuple(range(dist.get_world_size()))
        G = MICRO_BATCHES // self.replicas
        groups = [self.shapes[i : i + 2] for i in range(0, len(self.shapes), 2)]

        def shard_bytes(group: list[tuple[int, ...]]) -> int:
            total = 0
            for shape in group:
                row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                total += padded_rows(shape[0], self.shards) * row * FP32
            return total

        if self.layout == "ddp":
            total = sum(int(np.prod(s)) for s in self.shapes) * FP32
            return [Collective("ALLREDUCE", world, total)]  # buckets pinned at attach
        rank = dist.get_rank()
        if self.layout == "hsdp_2x2":
            shard_group = tuple(r for r in world if r // 2 == rank // 2)
            replicate_group = tuple(r for r in world if r % 2 == rank % 2)
        else:
            shard_group, replicate_group = world, ()
        out: list[Collective] = []
        for group in groups:
            S = shard_bytes(group)
            if self.layout == "fsdp":
                out += [Collective("ALLGATHER", shard_group, S),
                        Collective("REDUCE_SCATTER", shard_group, S * self.shards)]  # fmt: skip
                continue
            out += [Collective("ALLGATHER", shard_group, S)] * (2 * G)
            out += [Collective("REDUCE_SCATTER", shard_group, S * self.shards)] * G
            if replicate_group:
                out.append(Collective("ALLREDUCE", replicate_group, S))
        return out

    def close(self) -> None:
        self.fs.close()


class FSDPHarness(AdapterHarness):
    world_size = 4
    world_timeout_s = 600.0  # a bound for a hung world, not a speed target (CI is slow)

    def layouts(self) -> Sequence[str]:
        return list(LAYOUTS)

    def build(self, layout: str, seed: int, failslow: Mapping[str, Any] | None = None) -> FSDPJob:
        return FSDPJob(layout, seed, failslow)
