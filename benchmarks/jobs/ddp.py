"""Benchmark job: torch DDP on an MLP (one bucketed all-reduce set per step)."""

from __future__ import annotations

import torch
from _job import StepTimer, benchmark_mlp, finish, start
from torch.nn.parallel import DistributedDataParallel as DDP

args = start(__doc__)
model = DDP(benchmark_mlp(), bucket_cap_mb=1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 512)
timer = StepTimer()
for _ in range(args.steps):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    timer.step_done()
timer.write(args.out, "ddp")
finish()
