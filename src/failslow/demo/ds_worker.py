"""One rank of the DeepSpeed mitigation demo: ZeRO-1 (``FAILSLOW_DEMO_ZERO``: the stage) on
CPU/gloo, enabled by a config block.

Run by :mod:`failslow.demo.mitigation` as ``python -m failslow.demo.ds_worker``. This is what a
user's training script looks like with failslow: a ``"failslow"`` block in the DeepSpeed config,
``failslow.deepspeed.initialize`` instead of ``deepspeed.initialize``, and the loop of DeepSpeed's
tutorials over the loader it returns (``loss = loss_fn(engine(x), y); engine.backward(loss);
engine.step()``; ``FAILSLOW_DEMO_LOOP=train_batch``: ``engine.train_batch`` per step instead).
The control store comes from ``$FAILSLOW_STORE``, the rings from ``$FAILSLOW_RING_DIR``
(both set by the launcher, as ``failslow run --controller`` does). The slowdown is injected from
outside; the worker only records its step times and, at the end, rank 0's parameters.

Environment: RANK, WORLD_SIZE, FAILSLOW_DEMO_STORE_PORT (torch.distributed rendezvous),
FAILSLOW_DEMO_STEPS, FAILSLOW_DEMO_OUT, FAILSLOW_DEMO_MICRO_BATCHES (per replica),
FAILSLOW_DEMO_MICRO_BATCH_SIZE, FAILSLOW_DEMO_WIDTH; for the hot-update benchmark's conventional
baseline FAILSLOW_DEMO_DISK_CHECKPOINT (load it at start if present) and FAILSLOW_DEMO_STOP_FILE
(when every rank sees it: ``engine.save_checkpoint`` there and end; without a disk checkpoint
the demo launcher ends the job with it), FAILSLOW_DEMO_CRASH_AT_START
and FAILSLOW_DEMO_LOG_TAG for the hot-update tests; FAILSLOW_DEMO_SAVE_EVERY_STEP=1 for a
reference run that several tests compare with (rank 0's parameters after every step as
``parameters-step<N>.npz``, N the steps done).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def skip_shm_kernel_build() -> None:
    """Demo and tests only: DeepSpeed's CPU accelerator JIT-compiles a shared-memory kernel (~100
    s on 2 cores) that serves only inference all-reduce; training collectives use
    torch.distributed. Skipping it is what DeepSpeed does on a machine without a compiler.

    The module comes from ``sys.modules``: ``import deepspeed.comm.torch as m`` binds the
    ``torch`` package (``deepspeed.comm`` has an attribute ``torch``), which left the kernel
    loaded under its file lock at every start - a rank killed while holding it hung every later
    DeepSpeed start on the machine (torch's ``FileBaton`` waits for the lock forever)."""
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None


def _repeat(loader: Any) -> Any:
    """The loader's micro-batches epoch after epoch (``for batch in loader`` in a while loop)."""
    while True:
        yield from loader


def main() -> None:
    import torch
    import torch.distributed as dist

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
    skip_shm_kernel_build()
    import deepspeed

    import failslow.deepspeed

    join_world(rank, world)
    deepspeed.init_distributed(dist_backend="gloo")

    torch.manual_seed(0)
    width = int(os.environ.get("FAILSLOW_DEMO_WIDTH", "256"))
    micro_batch = int(os.environ.get("FAILSLOW_DEMO_MICRO_BATCH_SIZE", "128"))
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width),
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, 4 * width),
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, width),
    )
    g = torch.Generator().manual_seed(1234)
    inputs = torch.randn(4096, width, generator=g)
    targets = torch.randn(4096, width, generator=g)
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": per_replica,
        "train_batch_size": micro_batch * per_replica * world,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": int(os.environ.get("FAILSLOW_DEMO_ZERO", "1"))},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "failslow": json.loads(os.environ.get("FAILSLOW_DEMO_CONFIG", "{}")),
    }
    engine, _, loader, _ = failslow.deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        config=ds_config,
        training_data=dataset,
    )
    loss_fn = torch.nn.functional.mse_loss
    disk = os.environ.get("FAILSLOW_DEMO_DISK_CHECKPOINT")  # the conventional way (benchmark)
    if disk and os.path.exists(os.path.join(disk, "latest")):
        engine.load_checkpoint(disk)
    stop_file = os.environ.get("FAILSLOW_DEMO_STOP_FILE")
    adapter = engine.failslow
    # tests and demos: a fault through the plugin API
    for fault in fault_plugin.from_env(engine.module, lambda: engine.global_steps):
        adapter.session.pm.register(fault)
    resumed = adapter.session.resumed_step
    announce_start(rank, resumed)
    step_end: list[float] = [time.time()]
    first = engine.global_steps
    user_loop = os.environ.get("FAILSLOW_DEMO_LOOP", "user") == "user"
    batches = _repeat(loader) if user_loop else None
    every_step = os.environ.get("FAILSLOW_DEMO_SAVE_EVERY_STEP") == "1" and rank == 0
    for step in range(first, steps):
        if stop_file and all_ranks_see(stop_file):
            if not disk:
                break  # the launcher ends the job here (every rank at the same step)
            engine.save_checkpoint(disk)  # save to disk and end the job
            print(f"rank {rank}: saved a disk checkpoint at step {step}", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            return
        if batches is None:
            loss = engine.train_batch(loss_fn=loss_fn)
        else:  # the loop of DeepSpeed's tutorials: micro-batches until the engine stepped
            while engine.global_steps == step:
                x, y = next(batches)
                loss = loss_fn(engine(x), y)
                engine.backward(loss)
                engine.step()
        norm = engine.get_global_grad_norm()  # beside the logging line (byterobust 4.1)
        failslow.report_metrics(step, loss=loss, **({} if norm is None else {"grad_norm": norm}))
        step_end.append(time.time())
        if rank == 0:  # the launcher's view of the job's progress (a replay writes none)
            write_progress(out, rank, step_end, first, step)
        if every_step:
            import numpy as np

            np.savez(out / f"parameters-step{engine.global_steps}.npz", **_parameters(engine))
    record = run_record(rank, step_end, first, resumed, adapter)
    suffix = f"-{os.environ['FAILSLOW_RESTART']}" if os.environ.get("FAILSLOW_RESTART") else ""
    finish(out, rank, record, _parameters(engine), adapter, suffix=suffix)


def _parameters(engine: Any) -> dict[str, Any]:
    return {n: p.detach().cpu().numpy() for n, p in engine.module.named_parameters()}


if __name__ == "__main__":
    main()
