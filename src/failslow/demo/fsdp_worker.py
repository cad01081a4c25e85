"""One rank of the FSDP2 mitigation demo: HSDP (2 replicas x N/2 shards), one line of failslow.

``FAILSLOW_DEMO_MESH=full``: pure FSDP2 instead (a 1-D mesh over every rank; S2 by size).

Run by :mod:`failslow.demo.mitigation` as ``python -m failslow.demo.fsdp_worker``. A PyTorch
FSDP2 training loop with failslow: the MLP's blocks and root ``fully_shard``-ed on a (replicate,
shard) mesh, ``fs = failslow.fsdp.attach(model, optimizer, mesh=mesh, model_factory=build)``
and ``fs.train_step`` per step. ``build(mesh)`` builds model and optimizer on a mesh, so a
topology swap (S3) can rebuild them in place on a new one. The control store comes from
``$FAILSLOW_STORE``, the rings from ``$FAILSLOW_RING_DIR`` (set by the launcher); the fault is
injected from outside. At the end every rank writes its step record (with the role it ends in)
and rank 0 the full parameters.

Its loop hands each step's loss to ``failslow.report_metrics`` (byterobust 4.1: a NaN, Inf or 5x
jump asks for a rollback); faults come through the plugin API (``$FAILSLOW_DEMO_FAULT``,
:mod:`failslow.demo.fault_plugin`).

Environment: RANK, WORLD_SIZE, FAILSLOW_DEMO_STORE_PORT (and _HOST), FAILSLOW_DEMO_STEPS,
FAILSLOW_DEMO_OUT, FAILSLOW_DEMO_MICRO_BATCHES (per replica), FAILSLOW_DEMO_MICRO_BATCH_SIZE,
FAILSLOW_DEMO_WIDTH, FAILSLOW_DEMO_CONFIG, FAILSLOW_DEMO_STOP_FILE (when every rank sees it: end);
FAILSLOW_DEMO_LOG_TAG and FAILSLOW_DEMO_CRASH_AT_START for the hot-update test;
FAILSLOW_DEMO_SAVE_EVERY_STEP=1 for a reference run (rank 0 saves ``parameters-step<N>.npz``).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any


def build(mesh: Any, width: int) -> tuple[Any, Any]:
    """Two MLP blocks (hidden 4x and 2x ``width``), each and the root ``fully_shard``-ed on
    ``mesh``, and their optimizer. The blocks differ in size: the tracker finds the iteration
    period from a call that occurs once per step, and a stack of identical blocks has none yet
    (the tracking issue)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    def block(hidden: int) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width)
        )

    model = torch.nn.Sequential(block(4 * width), block(2 * width))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def main() -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import failslow
    import failslow.fsdp
    from failslow.demo import fault_plugin
    from failslow.demo.worker_io import (
        all_ranks_see,
        announce_start,
        finish,
        join_world,
        run_record,
        worker_env,
        write_progress,
    )

    env = worker_env()
    rank, world, steps, per_replica, out = env.rank, env.world, env.steps, env.per_replica, env.out
    join_world(rank, world)
    width = int(os.environ.get("FAILSLOW_DEMO_WIDTH", "128"))
    full = os.environ.get("FAILSLOW_DEMO_MESH") == "full"
    if full:  # pure FSDP2: one shard group over every rank
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model, optimizer = build(mesh, width)
    fs = failslow.fsdp.attach(
        model,
        optimizer,
        mesh=mesh,
        # S3: rebuilt on the new mesh (HSDP; a full mesh has one group, nothing to swap)
        model_factory=None if full else lambda new_mesh: build(new_mesh, width),
        config=json.loads(os.environ.get("FAILSLOW_DEMO_CONFIG", "{}")),
        accumulation_steps=per_replica,
        micro_batch_size=int(os.environ.get("FAILSLOW_DEMO_MICRO_BATCH_SIZE", "64")),
    )
    g = torch.Generator().manual_seed(1234)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(8192, width, generator=g), torch.randn(8192, width, generator=g)
    )
    data = itertools.chain.from_iterable(itertools.repeat(fs.loader(dataset)))
    stop_file = os.environ.get("FAILSLOW_DEMO_STOP_FILE")
    # tests and demos: a fault through the plugin API
    for fault in fault_plugin.from_env(model, lambda: fs.iteration):
        fs.session.pm.register(fault)
    resumed = fs.session.resumed_step
    announce_start(rank, resumed)
    first = fs.iteration
    step_end: list[float] = [time.time()]
    every_step = os.environ.get("FAILSLOW_DEMO_SAVE_EVERY_STEP") == "1"
    for step in range(first, steps):
        if stop_file and all_ranks_see(stop_file):
            break  # the launcher ends the job here (every rank at the same step)
        loss = fs.train_step(data, torch.nn.functional.mse_loss)
        failslow.report_metrics(step, loss=loss)  # beside the logging line (byterobust 4.1)
        step_end.append(time.time())
        if rank == 0:  # the launcher's view of the job's progress (it injects by step)
            write_progress(out, rank, step_end, first, step)
        if every_step:  # a reference run: the model after every step (every rank gathers)
            params = _parameters(model)
            if rank == 0:
                import numpy as np

                np.savez(out / f"parameters-step{step + 1}.npz", **params)
    record = run_record(rank, step_end, first, resumed, fs)
    record["coords"] = list(fs.topology.coords[rank])  # the role it ends in (after a swap)
    finish(out, rank, record, _parameters(model), fs)


def _parameters(model: Any) -> dict[str, Any]:
    """The full parameters (a collective: every rank gathers every shard)."""
    return {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()}


if __name__ == "__main__":
    main()
