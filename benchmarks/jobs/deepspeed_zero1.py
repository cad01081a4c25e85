"""Benchmark job: DeepSpeed ZeRO-1 on CPU/gloo (DS_ACCELERATOR=cpu, set by launch.py)."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from _job import StepTimer, benchmark_mlp, finish, start

args = start(__doc__)
deepspeed.init_distributed(dist_backend="gloo")
model = benchmark_mlp()
config = {
    "train_micro_batch_size_per_gpu": 256, "train_batch_size": 256 * dist.get_world_size(),
    "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
}
engine, _, _, _ = deepspeed.initialize(
    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=config)
x = torch.randn(256, 512)
timer = StepTimer()
for _ in range(args.steps):
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    timer.step_done()
timer.write(args.out, "deepspeed_zero1")
finish()
