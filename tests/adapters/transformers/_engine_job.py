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

import torch
import torch.distributed as dist
from _size_job import PLANS, SAMPLES, STEPS, Effects, Regression

import failslow.transformers
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan
from failslow.demo.ds_worker import skip_shm_kernel_build


def train(out: str, mode: str, stage: int) -> dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    AcceleratorState._reset_state()
    GradientState._reset_state()
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}
            for _ in range(SAMPLES)]  # fmt: skip
    torch.manual_seed(0)
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
    seen: dict[str, Any] = {}
    if mode == "plans":
        reg = failslow.transformers.attach(trainer, config={"capture": True})
        effects = Effects()

        class Schedule(TrainerCallback):
            def on_train_begin(self, *a: Any, **kw: Any) -> None:
                assert reg.adapter is not None
                reg.adapter.session.register(effects, name="effects")
                for step, counts in PLANS.items():
                    plan = MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))
                    reg.adapter.session.schedule(plan, step)

        trainer.add_callback(Schedule())
    trainer.train()
    module: Any = trainer.model_wrapped.module  # the engine's (stages 1-2: whole parameters)
    seen["parameters"] = {n: p.detach().flatten().tolist() for n, p in
                          module.named_parameters()}  # fmt: skip
    seen["global_step"] = trainer.state.global_step
    seen["stage"] = trainer.model_wrapped.zero_optimization_stage()
    if mode == "plans":
        assert reg.adapter is not None
        sampler = reg.adapter.split.samplers[0]
        seen["reads"] = {s: sampler.read_in(s) for s in range(STEPS - 10, STEPS)}
        seen["effects"] = effects.seen
        seen["capabilities"] = reg.adapter.failslow_capabilities().to_dict()
        reg.adapter.close()
    return seen


def main() -> None:
    skip_shm_kernel_build()
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    result = {mode: train(str(out / mode), mode, stage) for mode in ("plain", "plans")}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
