"""Benchmark job: torch DDP on an MLP (one bucketed all-reduce set per step)."""

from __future__ import annotations

from _job import benchmark_mlp, start, train_and_finish
from torch.nn.parallel import DistributedDataParallel as DDP

args = start(__doc__)
model = DDP(benchmark_mlp(), bucket_cap_mb=1)
train_and_finish(model, args, "ddp")
