"""One rank of the PyTorch Lightning mitigation demo: ``Trainer.fit()``, one line of failslow.

Started by the demo launcher (:mod:`failslow.demo.mitigation`) like its other jobs, or by
torchrun::

    torchrun --standalone --nproc-per-node 4 -m failslow.demo.lightning_worker

This is a Lightning user's script with failslow: a ``LightningModule`` (the DeepSpeed demo's
MLP, its ``training_step`` a mean-squared error over its batch), the user's own shuffled
``DataLoader`` passed to ``trainer.fit`` (Lightning puts its ``DistributedSampler`` under it),
``Trainer(strategy="ddp", accumulate_grad_batches=G, callbacks=[failslow.lightning.
FailslowCallback()])`` - Lightning's own loop, loader and loss (DDP over gloo). The process group
is joined through the launcher's store first (under torchrun: torchrun's), which Lightning then
uses. A second callback only records the demo's progress (each step's end, rank 0's progress
file for the launcher) and ends training at a step boundary when every rank sees the stop file.
The control store comes from ``$FAILSLOW_STORE``, the rings from ``$FAILSLOW_RING_DIR``; the
slowdown is injected from outside, so each rank writes its PID (``pid-rank<r>``). At the end
every rank writes its step record and rank 0 the parameters. The optimizer is plain SGD with
momentum, as in the Accelerate demo.

Environment: FAILSLOW_DEMO_STEPS, FAILSLOW_DEMO_OUT, FAILSLOW_DEMO_MICRO_BATCHES (per rank: the
gradient accumulation), FAILSLOW_DEMO_MICRO_BATCH_SIZE, FAILSLOW_DEMO_WIDTH,
FAILSLOW_DEMO_CONFIG, FAILSLOW_DEMO_STOP_FILE.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def main() -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    import failslow.lightning
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
    rank, steps, out = env.rank, env.steps, env.out
    os.environ.setdefault("LOCAL_RANK", str(rank))  # one node: Lightning's process is this one
    join_world(rank, env.world)
    width = int(os.environ.get("FAILSLOW_DEMO_WIDTH", "256"))
    batch = int(os.environ.get("FAILSLOW_DEMO_MICRO_BATCH_SIZE", "128"))

    class MLP(LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    g = torch.Generator().manual_seed(1234)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(16384, width, generator=g), torch.randn(16384, width, generator=g)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True)
    stop_file = os.environ.get("FAILSLOW_DEMO_STOP_FILE")
    step_end: list[float] = []
    ours = failslow.lightning.FailslowCallback(
        config=json.loads(os.environ.get("FAILSLOW_DEMO_CONFIG", "{}"))
    )
    record: dict[str, Any] = {}

    class Progress(Callback):  # type: ignore[misc] # the demo's bookkeeping, not failslow's
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            announce_start(rank, None)
            step_end.append(time.time())

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            step = trainer.global_step  # optimizer steps taken
            if step == len(step_end) - 1:
                return  # inside a step: more micro-batches
            step_end.append(time.time())
            if rank == 0:  # the launcher's view of the job's progress (it injects by step)
                write_progress(out, rank, step_end, 0, step - 1)
            if stop_file and all_ranks_see(stop_file):
                trainer.should_stop = True  # every rank ends at the same step

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # before failslow's
            record.update(run_record(rank, step_end, 0, None, ours.adapter))

    trainer = Trainer(
        accelerator="cpu", devices=env.world, strategy="ddp", max_steps=steps,
        accumulate_grad_batches=env.per_replica, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Progress(), ours],
    )  # fmt: skip
    module = MLP()
    trainer.fit(module, train_dataloaders=loader)
    params = {n: p.detach().cpu().numpy() for n, p in module.named_parameters()}
    finish(out, rank, record, params, ours.adapter)


if __name__ == "__main__":
    main()
