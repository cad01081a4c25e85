"""Three Hugging Face ``Trainer`` runs of one job in one torchrun world (DDP over gloo,
per-device batch 4, gradient accumulation 4, 14 steps over 600 samples: an epoch of 10 steps
whose last is short, and 4 of the next): plain, with ``failslow.transformers.attach(trainer)``
and no plan, and attached with micro-batch plans scheduled on every rank (S2 by size from
step 2, more skewed from step 5 across the epoch's short last step, back to even at step 12).
The model's loss is a sum over its items divided by ``num_items_in_batch`` (as Hugging Face's
models compute theirs). Each rank writes JSON: its parameters after each run, what the session
reported of each plan, and the samples its re-cut loader handed out per step. A fourth, one-step
run with a loss that is a mean per micro-batch reports the capabilities that model gets, and a
run resumed from the Trainer's own checkpoint those it gets. The run with plans is enabled the
one-line way, ``Trainer(..., callbacks=[failslow.transformers.FailslowCallback()])``; a last
one adds the callback after the Trainer was built (``add_callback``) and reports the error."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import failslow.transformers
from failslow.conformance.scenarios import PlanResults
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import ConfigError

PLANS = {2: (5, 5, 2, 4), 5: (6, 6, 1, 3), 12: (4, 4, 4, 4)}
STEPS, SAMPLES = 14, 600


class Regression(torch.nn.Module):
    accepts_loss_kwargs = True

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None
    ) -> dict[str, torch.Tensor]:
        err = (self.linear(x) - labels) ** 2
        loss = err.sum() / num_items_in_batch if num_items_in_batch is not None else err.mean()
        return {"loss": loss}


class MeanLoss(Regression):
    """The same model with a loss that is a mean over each micro-batch (no loss kwargs)."""

    accepts_loss_kwargs = False

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"loss": ((self.linear(x) - labels) ** 2).mean()}


def fresh_data() -> list[dict[str, torch.Tensor]]:
    """Accelerate's process-wide state reset (a new Trainer in the same process), the data,
    and the model's seed."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}
            for _ in range(SAMPLES)]  # fmt: skip
    torch.manual_seed(0)
    return data


def recorder(reg: Any, effects: PlanResults, *, plans: bool) -> Any:
    """A TrainerCallback that, at the start of training, registers ``effects`` on the session
    and (``plans``) schedules :data:`PLANS` on this rank."""
    from transformers import TrainerCallback

    class Schedule(TrainerCallback):
        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            assert reg.adapter is not None
            reg.adapter.session.register(effects, name="effects")
            if plans:
                for step, counts in PLANS.items():
                    plan = MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))
                    reg.adapter.session.schedule(plan, step)

    return Schedule()


def what_it_ran(reg: Any, effects: PlanResults) -> dict[str, Any]:
    """The samples the re-cut loader handed out per step, what the session reported of each
    plan and the adapter's capabilities; the adapter closed."""
    assert reg.adapter is not None
    sampler = reg.adapter.split.samplers[0]
    seen = {
        "reads": {s: sampler.read_in(s) for s in range(STEPS - 10, STEPS)},
        "effects": effects.seen,
        "capabilities": reg.adapter.failslow_capabilities().to_dict(),
    }
    reg.adapter.close()
    return seen


def train(out: str, mode: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    data = fresh_data()
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=4,
        max_steps={"mean": 1, "resumed": 4}.get(mode, STEPS), learning_rate=0.01, report_to=[],
        save_strategy="steps" if mode == "resumed" else "no", save_steps=3,
        logging_steps=10**6, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    model = MeanLoss() if mode == "mean" else Regression()
    seen: dict[str, Any] = {}
    if mode == "late":  # the callback added after the Trainer was built: one line, no training
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.add_callback(failslow.transformers.FailslowCallback())
        try:
            trainer.train()
        except ConfigError as error:
            return {"error": str(error)}
        return {"error": None}
    if mode == "plans":  # the one line as a callback
        callback = failslow.transformers.FailslowCallback(config={"capture": True})
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        assert callback.registration is not None
        reg = callback.registration
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    if mode not in ("plain", "resumed"):
        if mode != "plans":
            reg = failslow.transformers.attach(trainer, config={"capture": True})
        effects = PlanResults()
        trainer.add_callback(recorder(reg, effects, plans=mode == "plans"))
    trainer.train()
    assert trainer.model is not None
    seen["parameters"] = {n: p.detach().flatten().tolist() for n, p in
                          trainer.model.named_parameters()}  # fmt: skip
    seen["global_step"] = trainer.state.global_step
    if mode == "resumed":  # trained to step 4 with a checkpoint at 3; resumed there, attached
        resumed = Trainer(model=Regression(), args=args, train_dataset=data)
        reg = failslow.transformers.attach(resumed, config={"capture": True})
        resumed.train(resume_from_checkpoint=f"{out}/checkpoint-3")
        assert reg.adapter is not None
        seen["capabilities"] = reg.adapter.failslow_capabilities().to_dict()
        reg.adapter.close()
        return seen
    if mode == "mean":
        assert reg.adapter is not None
        seen["capabilities"] = reg.adapter.failslow_capabilities().to_dict()
        reg.adapter.close()
    elif mode != "plain":
        seen.update(what_it_ran(reg, effects))
    return seen


def main() -> None:
    out = Path(sys.argv[1])
    modes = ("plain", "attached", "plans", "mean", "resumed", "late")
    result = {mode: train(str(out / mode), mode) for mode in modes}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
