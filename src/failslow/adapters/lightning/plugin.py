"""PyTorch Lightning's ``Trainer`` (the ``ddp`` strategy) as a failslow plugin: S2 by size
inside an unchanged ``trainer.fit()`` (greyhound 5.2's S2 in the size form of
:mod:`failslow.adapters.common.own_loader`; issue 45).

Lightning owns its loop: every rank runs ``accumulate_grad_batches = G`` batches per optimizer
step (and steps at each epoch's last batch), zeroes gradients at ``batch_idx % G == 0``, divides
each micro-loss by ``G`` and ends the epoch after ``num_training_batches``. A plan cannot change
how many micro-batches a replica runs without patching all four - it changes how many samples
they hold. The adapter is the FSDP/DDP adapter (:class:`~failslow.adapters.fsdp.plugin.
FSDPAdapter`: DDP, the topology, the optimizer-step count) with three translations:

- **the step**: Lightning's ``on_train_batch_start`` before every training batch is where the
  step boundary passes (before a step's first batch: plans due now apply) and where the
  micro-batch is told to the session (DDP's gradient sync on the step's last, as Lightning's
  own ``no_sync`` has it); ``on_after_backward`` tells where its own work ended (Lightning
  broadcasts a flag from rank 0 before every batch, so every rank waits for the slowest at
  every batch: the step profile measures the time per micro-batch without those waits);
- **the data**: the training loader Lightning built (its ``DistributedSampler`` under a
  ``BatchSampler``) keeps its sampler, order and batches; its batch sampler is re-cut by size
  (:func:`~failslow.adapters.common.own_loader.recut_by_size`): under a plan replica ``r``'s
  ``G`` micro-batches hold its ``counts[r] * B`` of each step's samples, read from copies of the
  sampler with the other replicas' ranks; under the even split, Lightning's own batches;
- **the gradient**: in a re-cut step each micro-loss is multiplied by its samples over ``B``
  (the ``training_step`` the loop calls is wrapped), so a loss that is a mean over its batch -
  Lightning's usual one - weighs every sample of the step as the even split does
  (``loss_reduction="sum"``: a sum over its batch needs nothing). Outside re-cut steps nothing
  is multiplied: attached without a plan, the job trains bitwise what it trains without
  failslow.

Where a plan cannot take effect - another strategy, manual optimization, an accumulation that
changes between epochs, a loader that is not a sampler's (an iterable dataset), several training
loaders, loaders reloaded every few epochs, ``limit_train_batches`` cutting epochs inside a
step, a run resumed from a Lightning checkpoint inside an epoch - micro-batch plans are declared
unsupported with the reason. Snapshots too:
Lightning keeps its loops' progress, the LR schedule and the data position itself and resumes
from its own checkpoints.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from failslow import hookimpl
from failslow.adapters.common.data import READS_KEPT
from failslow.adapters.common.own_loader import SizeRecut, recut_by_size
from failslow.adapters.fsdp.plugin import FSDPAdapter
from failslow.capabilities import Capabilities
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import ConfigError

NO_SNAPSHOTS = (
    "Lightning keeps its loops' progress, the LR schedule and the data position itself and "
    "resumes from its own checkpoints (ModelCheckpoint, ckpt_path), not from failslow's snapshot"
)
LOSS_REDUCTIONS = ("mean", "sum")


def model_of(trainer: Any) -> Any:
    """The DDP-wrapped model of ``trainer``'s ``ddp`` strategy (ConfigError naming the
    strategy otherwise)."""
    from torch.nn.parallel import DistributedDataParallel

    model = trainer.strategy.model
    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(
            f"failslow.lightning: the Trainer's strategy is {type(trainer.strategy).__name__} "
            f"(its model a {type(model).__name__}); failslow.lightning supports strategy="
            "'ddp' (more than one process) so far"
        )
    return model


def plans_reason(trainer: Any, pl_module: Any) -> str:
    """Why micro-batch plans cannot take effect in ``trainer``'s loop ("" where they can)."""
    if not pl_module.automatic_optimization:
        return "the LightningModule steps its optimizers itself (manual optimization)"
    if any(type(c).__name__ == "GradientAccumulationScheduler" for c in trainer.callbacks):
        return "a GradientAccumulationScheduler changes accumulate_grad_batches between epochs"
    if trainer.reload_dataloaders_every_n_epochs:
        return "the Trainer reloads its training loader every few epochs"
    loaders = trainer.fit_loop._combined_loader.flattened
    if len(loaders) != 1:
        return f"the Trainer reads {len(loaders)} training loaders at once"
    batches, g = trainer.num_training_batches, trainer.accumulate_grad_batches
    try:
        length: int | None = len(loaders[0])
    except TypeError:  # an iterable dataset without a length
        length = None
    if length is not None and batches < length and batches % g:
        return (
            f"limit_train_batches ends each epoch after {batches} of its {length} batches, "
            f"inside a step of {g}"
        )
    return ""


class LightningAdapter(FSDPAdapter):
    """The DDP adapter driven by a Lightning ``Trainer``'s own loop (``on_train_batch_start``
    before every training batch)."""

    def __init__(self, trainer: Any, pl_module: Any, *, loss_reduction: str = "mean") -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError(
                f"failslow.lightning: loss_reduction must be one of {LOSS_REDUCTIONS}, got "
                f"{loss_reduction!r}"
            )
        scheduler = (
            trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        )
        loaders = trainer.fit_loop._combined_loader.flattened
        batch_size = getattr(loaders[0], "batch_size", None) if loaders else None
        super().__init__(
            model_of(trainer),
            trainer.optimizers[0],
            scheduler=scheduler,
            accumulation_steps=int(trainer.accumulate_grad_batches),
            micro_batch_size=int(batch_size or 1),
            iteration=int(trainer.global_step),
            framework="Lightning",
        )
        self.trainer = trainer
        self.module = pl_module
        self.loss_reduction = loss_reduction
        self.split.by_size = self.micro_batch_size
        self.split.micro_loss_scale = lambda: None  # checked against the step's re-cut instead
        self.split.loader_hint = "train with trainer.fit() over the loader Lightning builds"
        self.recut: SizeRecut | None = None
        self._scale = 1.0
        self._weighted: dict[int, int] = {}
        """Per re-cut step: the samples its micro-losses were weighted for (over ``B``)."""
        self._pending: tuple[int, int] | None = None
        """(step, samples) of the re-cut micro-batch about to run, until its loss is weighted."""
        self._said_broken = False
        self.size_reason = plans_reason(trainer, pl_module)
        self._start_step = self.iteration
        if not self.size_reason and trainer.fit_loop.epoch_loop.batch_progress.current.ready:
            self.size_reason = (
                f"the Trainer resumed from its checkpoint inside an epoch (batch "
                f"{trainer.fit_loop.epoch_loop.batch_progress.current.ready}), and failslow does "
                "not re-cut the loader of a resumed run yet"
            )
        if not self.size_reason:  # Lightning made this epoch's iterator when it set up the data
            live = getattr(trainer.fit_loop._combined_loader, "_iterator", None)
            live = (getattr(live, "iterators", None) or [None])[0]
            self.recut, why = recut_by_size(
                loaders[0], self.split, start_step=self.iteration, live=live
            )
            if self.recut is None:
                self.size_reason = f"Lightning's training loader cannot be re-cut: {why}"
        self._training_step = pl_module.__dict__.get("training_step")
        pl_module.training_step = self._wrap(pl_module.training_step)

    def _wrap(self, training_step: Any) -> Any:
        def training_step_weighted(*args: Any, **kwargs: Any) -> Any:
            out = training_step(*args, **kwargs)
            pending, self._pending = self._pending, None
            if pending is None or out is None:
                return out
            step, n = pending  # counted where the loss is weighted: what verification reads
            self._weighted[step] = self._weighted.get(step, 0) + n
            if len(self._weighted) > READS_KEPT:
                del self._weighted[min(self._weighted)]
            if self._scale == 1.0:
                return out
            if isinstance(out, dict):
                return {**out, "loss": out["loss"] * self._scale}
            return out * self._scale

        return training_step_weighted

    def before_batch(self) -> None:
        """Lightning is about to run a training batch (``on_train_batch_start``)."""
        loop = self.trainer.fit_loop.epoch_loop
        g = int(self.trainer.accumulate_grad_batches)
        at = int(loop.batch_progress.current.ready) - 1  # this batch's index in its epoch
        if at % g == 0:
            self.begin_step()
        last = not loop._should_accumulate()
        sizes = self.recut.cut_sizes(self.iteration) if self.recut is not None else None
        self._scale, self._pending = 1.0, None
        if sizes is not None:
            n = sizes[at % g]
            self._pending = (self.iteration, n)
            if self.loss_reduction == "mean":
                self._scale = n / self.micro_batch_size
        self.set_boundary(last)
        if self.recut is not None and self.recut.broken and not self._said_broken:
            self._said_broken = True  # found while reading: the controller plans from it
            if self.session is not None:
                self.session.capabilities_changed()

    def after_backward(self) -> None:
        """A training batch's backward ended (``on_after_backward``): its own work, before the
        next batch's broadcast from rank 0 - Lightning meets every rank at every batch, so the
        spacing of the batches' starts would hold the wait for the slowest."""
        if self.session is not None:
            self.session.micro_batch_end()

    @hookimpl
    def failslow_capabilities(self) -> Capabilities:
        caps = super().failslow_capabilities()
        reason = self.size_reason or next(
            (f"Lightning's training loader cannot be re-cut: {r.broken}" for r in [self.recut]
             if r is not None and r.broken), "",
        )  # fmt: skip
        if reason:
            caps = replace(caps, microbatch_plans=reason)
        return replace(caps, snapshots=NO_SNAPSHOTS, hot_update=NO_SNAPSHOTS)

    @hookimpl
    def failslow_verify_microbatch_plan(
        self, plan: MicroBatchPlan, step: int, forwards: int
    ) -> str:
        """The split's check (the loop's ``G`` micro-batches, the plan's samples read), and
        that the micro-losses of ``step`` were weighted for those samples."""
        why = super().failslow_verify_microbatch_plan(plan, step, forwards)
        if why:
            return why
        want = plan.counts[self.split.replica] * self.micro_batch_size
        even = all(c == self.split.count for c in plan.counts)
        weighted = self._weighted.get(step, 0 if not even else want)
        if weighted != want:
            return f"weighted micro-losses for {weighted} samples in step {step}, the plan {want}"
        return ""

    def close(self) -> None:
        if self._training_step is None:
            self.module.__dict__.pop("training_step", None)
        else:
            self.module.training_step = self._training_step
        super().close()
