"""Benchmark job: FSDP2 (fully_shard on a 1-D CPU mesh) on an MLP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _job import StepTimer, benchmark_mlp, finish, start
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

args = start(__doc__)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = benchmark_mlp()
for m in model:
    if isinstance(m, torch.nn.Linear):
        fully_shard(m, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 512)
timer = StepTimer()
for _ in range(args.steps):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    timer.step_done()
timer.write(args.out, "fsdp2")
finish()
