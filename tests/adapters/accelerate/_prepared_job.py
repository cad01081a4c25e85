"""An Accelerate job written as Accelerate's docs teach - ``accelerator.prepare(model,
optimizer, loader)`` over the user's own DataLoader and ``with accelerator.accumulate(model)``
- three times in one torchrun world (DDP over gloo, 4 ranks, batches of 4, accumulation 4, two
epochs of 600 shuffled samples: 10 steps each, the last one short): plain, with
``failslow.accelerate.attach(accelerator)`` and no plan, and attached with micro-batch plans
scheduled on every rank (S2 by count from step 2, more skewed from step 5 across the epoch's
short last step and into the next epoch, back to even at step 12). The loss is a mean per
micro-batch (``F.mse_loss``). Each rank writes JSON: its parameters after each run, the
optimizer steps and micro-batches it ran, what the session reported of each plan and what its
re-cut loader handed out per step."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import failslow.accelerate
from failslow.conformance.scenarios import PlanResults
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan

PLANS = {2: (5, 5, 2, 4), 5: (6, 6, 1, 3), 12: (4, 4, 4, 4)}
EPOCHS, SAMPLES = 2, 600


def train(mode: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(SAMPLES)]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    fs = None
    if mode != "plain":
        fs = failslow.accelerate.attach(accelerator, config={"capture": True})
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    effects = PlanResults()
    if fs is not None:
        fs.session.register(effects, name="effects")
        if mode == "plans":
            for step, counts in PLANS.items():
                plan = MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))
                fs.session.schedule(plan, step)
    sampler = fs.split.samplers[0] if fs is not None else None
    ran: list[int] = []  # micro-batches per optimizer step
    reads: list[int] = []  # what the re-cut loader handed out per step
    micro_batches = 0
    for _ in range(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            micro_batches += 1
            if accelerator.sync_gradients:
                ran.append(micro_batches)
                micro_batches = 0
                if sampler is not None:
                    reads.append(sampler.read_in(len(ran) - 1))
    seen: dict[str, Any] = {
        "parameters": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
        "ran": ran,
        "left": micro_batches,
        "reads": reads,
    }
    if fs is not None:
        seen["effects"] = effects.seen
        seen["capabilities"] = fs.failslow_capabilities().to_dict()
        fs.close()
    return seen


def main() -> None:
    out = Path(sys.argv[1])
    result = {mode: train(mode) for mode in ("plain", "attached", "plans")}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
