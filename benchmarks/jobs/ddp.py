"""Benchmark job: torch DDP on an MLP (one bucketed all-reduce set per step)."""

from __future__ import annotations

import torch
from _job import StepTimer, finish, start
from torch.nn.parallel import DistributedDataParallel as DDP

args = start(__doc__)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512)), bucket_cap_mb=1)
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
