"""An Accelerate training loop with failslow - the change is marked ``# failslow``.

    failslow run --controller 4 -- accelerate launch --multi_gpu --num_processes 4 \\
        examples/accelerate_train.py --steps 100

The loop Accelerate's tutorials teach (``prepare``, ``accumulate``, ``backward``, the prepared
optimizer's and scheduler's ``step``), with failslow registered in one line right after the
``Accelerator`` is built and this rank's share of every global batch read through
``fs.loader``. It runs as DDP on CPUs (gloo); on GPUs an ``accelerate config`` with
``fsdp_version: 2`` makes the same script an FSDP2 job (pure FSDP allows micro-batch plans with
``attach(..., unshard_once=True)``). Plans the controller decides (S2: fewer micro-batches for
a slow rank) take effect at a step boundary without changing the trained model.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator

import failslow.accelerate  # failslow


def main() -> None:
    parser = argparse.ArgumentParser(description="an MLP trained with Accelerate and failslow")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per rank")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per micro-batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.accumulation
    )
    fs = failslow.accelerate.attach(accelerator, micro_batch_size=args.batch_size)  # failslow
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(8192, 64, generator=g), torch.randn(8192, 64, generator=g)
    )
    loader = fs.loader(dataset)  # failslow: this rank's share of every global batch
    step = fs.iteration  # a restart in place resumes at its step
    while step < args.steps:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:  # the optimizer stepped: one global step done
                if step % 10 == 0:
                    accelerator.print(f"step {step}: loss {loss.item():.4f}")
                step += 1
                if step >= args.steps:
                    break
    fs.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
