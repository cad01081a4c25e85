"""PyTorch Lightning ``Trainer.fit`` runs of one job in one torchrun world (strategy ``ddp`` over
gloo, batch 4, ``accumulate_grad_batches=4``, 14 steps over 600 samples: 38 batches per replica
and epoch, the last of 2 samples - 9 steps of 4 and one of 2, then 4 steps of the next epoch):
plain; with ``callbacks=[failslow.lightning.FailslowCallback()]`` and no plan; with the callback
and micro-batch plans scheduled on every rank (S2 by size from step 2, more skewed from step 5
through the epoch's short last step, back to even at step 12), for a module whose loss is a mean
over its batch; and plain and with plans (``loss_reduction="sum"``) for one whose loss is a sum
over its batch (over 4: the same as the mean but in the epoch's short last batch). Each rank writes
JSON: its parameters after each run, what the session reported of each plan, the samples its
re-cut loader handed out per step and the capabilities. Last, runs whose plans cannot take effect
report their reasons (manual optimization, ``limit_train_batches`` inside a step, an accumulation
scheduled to change)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler

import failslow.lightning
from failslow.conformance.scenarios import PlanResults
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan

PLANS = {2: (5, 5, 2, 4), 5: (6, 6, 1, 3), 12: (4, 4, 4, 4)}
STEPS, SAMPLES = 14, 600


class Regression(LightningModule):
    def __init__(self, reduction: str = "mean", manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 1)
        self.reduction = reduction
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        err = (self.linear(x) - y) ** 2
        loss = (
            err.sum() / 4 if self.reduction == "sum" else err.mean()
        )  # a sum (over 4: the mean of a full batch)
        if not self.automatic_optimization:
            self.manual_backward(loss)
            self.optimizers().step()
            self.optimizers().zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)}  # fmt: skip


def data() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True
    )


class Schedule(Callback):  # type: ignore[misc]
    """After failslow's callback started the session: record what it reports of each plan,
    schedule :data:`PLANS` (every rank, as the plan channel commits them), and keep what the
    re-cut loader handed out before the session closes."""

    def __init__(self, ours: Any, plans: bool) -> None:
        self.ours, self.plans, self.effects, self.seen = ours, plans, PlanResults(), {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        adapter = self.ours.adapter
        adapter.session.register(self.effects, name="effects")
        if self.plans:
            for step, counts in PLANS.items():
                plan = MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))
                adapter.session.schedule(plan, step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        adapter = self.ours.adapter
        recut = adapter.recut
        self.seen = {
            "reads": {s: recut.read_in(s) for s in range(STEPS - 10, STEPS)} if recut else {},
            "effects": self.effects.seen,
            "capabilities": adapter.failslow_capabilities().to_dict(),
        }


def fit(mode: str) -> dict[str, Any]:
    module = Regression("sum" if "sum" in mode else "mean", manual=mode == "manual")
    callbacks: list[Any] = []
    if not mode.startswith("plain"):
        ours = failslow.lightning.FailslowCallback(
            config={"capture": True}, loss_reduction="sum" if mode == "sum" else "mean"
        )
        schedule = Schedule(ours, plans=mode in ("plans", "sum"))
        callbacks = [ours, schedule]
    extra = [GradientAccumulationScheduler({0: 4, 2: 2})] if mode == "scheduled" else []
    own_count = mode in ("manual", "scheduled")  # Lightning's accumulation must be 1 there
    trainer = Trainer(
        accelerator="cpu", devices=4, strategy="ddp", max_steps=4 if own_count else STEPS,
        accumulate_grad_batches=1 if own_count else 4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_train_batches=6 if mode == "limited" else None, callbacks=callbacks + extra,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=data())
    seen: dict[str, Any] = {
        "parameters": {n: p.detach().flatten().tolist() for n, p in module.named_parameters()},
        "global_step": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
    }
    if not mode.startswith("plain"):
        seen.update(schedule.seen)
        seen["training_step_restored"] = "training_step" not in vars(module)
    return seen


def main() -> None:
    out = Path(sys.argv[1])
    modes = ("plain", "attached", "plans", "plain sum", "sum", "manual", "limited", "scheduled")
    result = {mode: fit(mode) for mode in modes}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
