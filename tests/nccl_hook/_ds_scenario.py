"""DeepSpeed ZeRO-1 on CPU/gloo for the hook test (runs inside ``_worker.py``).

DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel at its first
``init_distributed`` (~100 s on 2 cores). That kernel serves only ``inference_all_reduce``;
training collectives go through ``torch.distributed``. Unless the kernel was prebuilt
(``DS_BUILD_SHM_COMM=1`` at install) the test skips building it -
``failslow.demo.ds_worker.skip_shm_kernel_build`` - and DeepSpeed falls back to gloo exactly as
on a machine without a compiler.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from failslow.demo.ds_worker import skip_shm_kernel_build


def scenario_deepspeed(ctx: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if os.environ.get("FAILSLOW_TEST_DS_BUILD_SHM", "0") != "1":
        skip_shm_kernel_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
    )
    world = dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "train_batch_size": 8 * world,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=config
    )
    steps = 3
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(steps):
        x = torch.randn(8, 128, generator=g)

        def one(x: torch.Tensor = x) -> None:
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()

        ctx["phases"].run(f"ds_step{step}", one)
    return {
        "steps": steps,
        "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
        "world": world,
    }
