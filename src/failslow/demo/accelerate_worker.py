"""One rank of the Accelerate mitigation demo: the loop of its tutorials, one line of failslow.

Started by ``accelerate launch`` (from :mod:`failslow.demo.mitigation`, or by hand)::

    accelerate launch --multi_gpu --num_processes 4 -m failslow.demo.accelerate_worker

This is an Accelerate user's script with failslow: ``fs = failslow.accelerate.attach(
accelerator)`` right after the ``Accelerator`` is built, and the rest as Accelerate's docs
teach - the user's own shuffled DataLoader passed to ``accelerator.prepare`` with the model and
the optimizer (failslow re-cuts it per plan), and the ordinary ``accumulate`` / ``backward`` /
``step`` loop (``FAILSLOW_DEMO_LOADER=failslow``: failslow's share-aware ``fs.loader(dataset)``
instead). The
model is FSDP2 (``FAILSLOW_DEMO_SHARDING=fsdp2``, the default: one shard group over every rank,
with ``unshard_once`` so micro-batch plans can run) or DDP (``ddp``). Accelerate picks FSDP only
on accelerators: on this CPU-only machine the worker switches Accelerate's state to FSDP after
building the ``Accelerator`` (demo-only, what ``fsdp_version: 2`` in an ``accelerate config``
gives on GPUs). The control store comes from ``$FAILSLOW_STORE``, the rings from
``$FAILSLOW_RING_DIR`` (set by the launcher, as ``failslow run --controller`` does); the
slowdown is injected from outside, so each rank writes its PID (``pid-rank<r>``) for the
launcher. At the end every rank writes its step record and rank 0 the full parameters.

Its loop hands each step's loss to ``failslow.report_metrics`` (byterobust 4.1: a NaN, Inf or 5x
jump asks for a rollback); faults come through the plugin API (``$FAILSLOW_DEMO_FAULT``,
:mod:`failslow.demo.fault_plugin`). A rank resumed from a snapshot (a restart, a rollback, a hot
update) runs the same loop over the same prepared loader: failslow walks it over the steps
already trained (:mod:`failslow.adapters.common.recut`).

Environment: FAILSLOW_DEMO_STEPS, FAILSLOW_DEMO_OUT, FAILSLOW_DEMO_MICRO_BATCHES (per rank),
FAILSLOW_DEMO_MICRO_BATCH_SIZE, FAILSLOW_DEMO_WIDTH, FAILSLOW_DEMO_CONFIG,
FAILSLOW_DEMO_STOP_FILE (when every rank sees it: end), FAILSLOW_DEMO_SHARDING,
FAILSLOW_DEMO_LOADER (``prepared``, the default, or ``failslow``); FAILSLOW_DEMO_LOG_TAG and
FAILSLOW_DEMO_CRASH_AT_START for the hot-update test; FAILSLOW_DEMO_SAVE_EVERY_STEP=1 for a
reference run (rank 0 saves ``parameters-step<N>.npz``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def make_accelerator(sharding: str, accumulation: int) -> Any:
    """The ``Accelerator`` (DDP on CPU; FSDP2 through the demo-only switch in the docstring)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if sharding == "ddp":
        return Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    if sharding != "fsdp2":
        raise SystemExit(f"FAILSLOW_DEMO_SHARDING must be fsdp2 or ddp, got {sharding!r}")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(
        cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=accumulation
    )
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    return accelerator


def main() -> None:
    import torch

    import failslow
    import failslow.accelerate
    from failslow.demo import fault_plugin
    from failslow.demo.worker_io import (
        all_ranks_see,
        announce_start,
        finish,
        run_record,
        worker_env,
        write_progress,
    )

    env = worker_env()
    rank, steps, per_replica, out = env.rank, env.steps, env.per_replica, env.out
    sharding = os.environ.get("FAILSLOW_DEMO_SHARDING", "fsdp2")
    accelerator = make_accelerator(sharding, per_replica)
    micro_batch_size = int(os.environ.get("FAILSLOW_DEMO_MICRO_BATCH_SIZE", "128"))
    fs = failslow.accelerate.attach(
        accelerator,
        config=json.loads(os.environ.get("FAILSLOW_DEMO_CONFIG", "{}")),
        micro_batch_size=micro_batch_size,
        unshard_once=sharding == "fsdp2",
    )
    torch.manual_seed(0)
    width = int(os.environ.get("FAILSLOW_DEMO_WIDTH", "256"))
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width),
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, 4 * width),
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, width),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(1234)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(4096, width, generator=g), torch.randn(4096, width, generator=g)
    )
    if os.environ.get("FAILSLOW_DEMO_LOADER", "prepared") == "failslow":
        model, optimizer = accelerator.prepare(model, optimizer)
        loader = fs.loader(dataset)
    else:
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=micro_batch_size, shuffle=True,
            generator=torch.Generator().manual_seed(5),
        )  # fmt: skip
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stop_file = os.environ.get("FAILSLOW_DEMO_STOP_FILE")
    # tests and demos: a fault through the plugin API
    for fault in fault_plugin.from_env(model, lambda: fs.iteration):
        fs.session.pm.register(fault)
    every_step = os.environ.get("FAILSLOW_DEMO_SAVE_EVERY_STEP") == "1"
    resumed = fs.session.resumed_step
    announce_start(rank, resumed)
    first = fs.iteration
    step_end: list[float] = [time.time()]
    step = first
    stop = False
    while step < steps and not stop:
        for x, y in loader:  # the loop of Accelerate's tutorials
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if fs.iteration == step:
                continue  # the optimizer has not stepped yet: more micro-batches of this step
            failslow.report_metrics(step, loss=loss)  # beside the logging line (byterobust 4.1)
            step_end.append(time.time())
            if rank == 0:  # the launcher's view of the job's progress (it injects by step)
                write_progress(out, rank, step_end, first, step)
            if every_step:  # a reference run: the model after every step (every rank gathers)
                params = _parameters(model)
                if rank == 0:
                    import numpy as np

                    np.savez(out / f"parameters-step{step + 1}.npz", **params)
            step += 1
            if step >= steps or (stop_file and all_ranks_see(stop_file)):
                stop = True  # every rank ends at the same step
                break
    finish(out, rank, run_record(rank, step_end, first, resumed, fs), _parameters(model), fs)


def _parameters(model: Any) -> dict[str, Any]:
    """The full parameters (FSDP2: a collective, every rank gathers every shard)."""
    from torch.distributed.tensor import DTensor

    params = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        params[name.removeprefix("module.")] = value.detach().cpu().numpy()
    return params


if __name__ == "__main__":
    main()
