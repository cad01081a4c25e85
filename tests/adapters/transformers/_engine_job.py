"""The Hugging Face ``Trainer`` on its DeepSpeed path (ZeRO stage from argv[2]; DS on the CPU,
gloo) in one torchrun world: plain, then with ``failslow.transformers.attach(trainer)`` and the
size job's micro-batch plans scheduled on every rank (:mod:`_size_job`: per-device batch 4,
gradient accumulation 4, 14 steps over an epoch boundary). Each rank writes JSON: its
parameters after each run, what the session reported of each plan, the samples its re-cut
loader handed out per step and the adapter's capabilities."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _size_job import STEPS, Regression, fresh_data, recorder, what_it_ran

import failslow.transformers
from failslow.conformance.scenarios import PlanResults
from failslow.demo.ds_worker import skip_shm_kernel_build


def train(out: str, mode: str, stage: int) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    data = fresh_data()
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}  # fmt: skip
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=4,
        max_steps=STEPS, learning_rate=0.01, report_to=[], save_strategy="no",
        logging_steps=10**6, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        deepspeed=ds,
    )  # fmt: skip
    trainer = Trainer(model=Regression(), args=args, train_dataset=data)
    if mode == "plans":
        reg = failslow.transformers.attach(trainer, config={"capture": True})
        effects = PlanResults()
        trainer.add_callback(recorder(reg, effects, plans=True))
    trainer.train()
    engine: Any = trainer.model_wrapped  # its module's parameters are whole at stages 1-2
    seen: dict[str, Any] = {
        "parameters": {
            n: p.detach().flatten().tolist() for n, p in engine.module.named_parameters()
        },
        "global_step": trainer.state.global_step,
        "stage": engine.zero_optimization_stage(),
    }
    if mode == "plans":
        seen.update(what_it_ran(reg, effects))
    return seen


def main() -> None:
    skip_shm_kernel_build()
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    result = {mode: train(str(out / mode), mode, stage) for mode in ("plain", "plans")}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
