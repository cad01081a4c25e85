"""A Hugging Face ``Trainer`` job (DDP over gloo, gradient accumulation 4) with
``failslow.accelerate.attach(trainer.accelerator)`` before ``trainer.train()``, as issue 45's
user wrote it. Run under ``failslow run --controller N -- torchrun ...``; rank 0 prints JSON:
what a micro-batch plan's prepare says after training, the capabilities in the job record the
controller reads, and the warnings failslow logged."""

from __future__ import annotations

import json
import logging
import sys
import time

import torch
import torch.distributed as dist

import failslow.accelerate
from failslow.core.control import keys
from failslow.core.planner.plans import MicroBatchPlan


class Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


def main() -> None:
    from transformers import Trainer, TrainingArguments

    caught = Caught()
    logging.getLogger("failslow").addHandler(caught)
    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(256)]
    args = TrainingArguments(
        output_dir=sys.argv[1], per_device_train_batch_size=2, gradient_accumulation_steps=4,
        max_steps=20, learning_rate=0.01, report_to=[], save_strategy="no", logging_steps=10**6,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=Regression(), args=args, train_dataset=data)
    fs = failslow.accelerate.attach(trainer.accelerator, config={"capture": False})
    trainer.train()
    world = dist.get_world_size()
    plan = MicroBatchPlan(counts=(4,) * world, weights=(1.0,) * world)
    try:
        fs.failslow_prepare_microbatch_plan(plan=plan, rank=dist.get_rank())
        prepared = "prepared"
    except Exception as exc:
        prepared = f"refused: {exc}"
    job, deadline = None, time.monotonic() + 20.0  # rank 0's reporting thread writes it
    while fs.session.store is not None and time.monotonic() < deadline:
        job = fs.session.store.get_json(keys.JOB)
        if job and job["capabilities"]["microbatch_plans"]:
            break
        time.sleep(0.05)
    seen = {
        "prepare": prepared,
        "job record": (job or {}).get("capabilities", {}).get("microbatch_plans"),
        "warnings": [m for m in caught.messages if "S2" in m],
    }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(seen), flush=True)
    fs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
