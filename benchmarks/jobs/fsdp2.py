"""Benchmark job: FSDP2 (fully_shard on a 1-D CPU mesh) on an MLP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _job import benchmark_mlp, start, train_and_finish
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

args = start(__doc__)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = benchmark_mlp()
for m in model:
    if isinstance(m, torch.nn.Linear):
        fully_shard(m, mesh=mesh)
fully_shard(model, mesh=mesh)
train_and_finish(model, args, "fsdp2")
