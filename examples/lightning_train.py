"""A PyTorch Lightning job with failslow - the change is marked ``# failslow``.

    failslow run --controller 4 -- torchrun --standalone --nproc-per-node 4 \\
        examples/lightning_train.py --steps 200

``Trainer.fit()`` as Lightning's docs teach it: a ``LightningModule`` (a small MLP regressing
random targets), the user's own shuffled ``DataLoader`` and ``Trainer(strategy="ddp",
accumulate_grad_batches=...)``, with failslow as one callback. It runs as DDP on CPUs (gloo)
and on GPUs (NCCL) alike. A slow rank is detected, diagnosed and mitigated inside ``fit()``:
S2 by size - every replica still runs ``--accumulation`` micro-batches per step, the slow one's
hold fewer of the step's samples, each micro-loss (a mean over its batch) weighted by its
samples - without changing the trained model.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

import failslow.lightning  # failslow


class Regression(LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description="a Lightning MLP trained with failslow")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per rank")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per micro-batch")
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(8192, args.width, generator=g), torch.randn(8192, args.width, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # as torchrun started the processes
    trainer = Trainer(
        accelerator="auto", strategy="ddp", max_steps=args.steps, devices=per_node,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node,
        accumulate_grad_batches=args.accumulation, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
        callbacks=[failslow.lightning.FailslowCallback()],  # failslow
    )  # fmt: skip
    module = Regression(args.width)
    trainer.fit(module, train_dataloaders=loader)
    if trainer.is_global_zero:
        print(f"step {trainer.global_step}: loss {float(trainer.callback_metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
