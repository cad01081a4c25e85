"""The Hugging Face ``Trainer`` as a failslow plugin: S2 by size inside an unchanged
``trainer.train()`` (greyhound 5.2's S2 in the size form of :mod:`failslow.adapters.common.
recut`).

The Trainer owns its loop: it draws ``G = gradient_accumulation_steps`` batches per optimizer
step from its own prepared loader on every rank, counts its own accumulation boundary and sets
Accelerate's ``sync_gradients`` itself before each micro-batch. So a plan cannot change how
many micro-batches a replica runs - it changes how many samples they hold. The adapter is the
Accelerate adapter (:class:`~failslow.adapters.accelerate.plugin.AccelerateAdapter`: DDP, the
topology, the step profile) with three translations:

- **the step**: the Trainer's own ``_set_sync_gradients`` call before each micro-batch is where
  the step boundary passes (before a step's first micro-batch: plans due now apply) and where
  the micro-batch is told to the session (DDP's gradient sync on the last, as the Trainer's
  own ``no_sync`` has it);
- **the data**: the Trainer's prepared loader keeps its sampler, its order and its batches; its
  Accelerate ``BatchSamplerShard`` is wrapped in a :class:`~failslow.adapters.common.recut.
  RecutSampler`, which hands this replica ``counts[r] * B`` of each step's samples in its ``G``
  micro-batches under a plan, and the Trainer's own batches under the even split;
- **the gradient**: the Trainer divides the summed token losses by the items of the whole
  global batch (``num_items_in_batch`` gathered across ranks, ``average_tokens_across_devices``)
  where the model takes it, which is exact for replicas of unequal sizes. Where it does not
  (``average_tokens_across_devices=False``, a model whose forward takes no loss kwargs and no
  ``compute_loss_func``), or ``per_device_train_batch_size < G`` (a replica given one
  micro-batch's worth of samples could not fill its ``G``), micro-batch plans are declared
  unsupported with that reason.

Only DDP so far (the Trainer's FSDP and DeepSpeed paths are not re-cut: declared, with the
reason), and not in a run resumed from a Trainer checkpoint (the Trainer skips the epoch's
trained batches through the loader, so the re-cut's step numbers would not be the session's:
plans are refused from the first micro-batch, with that reason). Snapshots are declared
unsupported: the Trainer's step counter, LR schedule and data position live in the Trainer,
which resumes from its own checkpoints (``save_steps``, ``resume_from_checkpoint``), not from
failslow's in-memory snapshot.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from failslow import hookimpl
from failslow.adapters.accelerate.plugin import AccelerateAdapter
from failslow.adapters.accelerate.prepared import recut
from failslow.capabilities import Capabilities

NOT_DDP = (
    "failslow.transformers re-cuts the Trainer's micro-batches by size under DDP only so far "
    "(this job's model is {flavor})"
)
NO_SNAPSHOTS = (
    "the Trainer keeps its step counter, LR schedule and data position itself and resumes from "
    "its own checkpoints (save_steps, resume_from_checkpoint), not from failslow's snapshot"
)


def exactness_reason(trainer: Any) -> str:
    """Why replicas of unequal sizes would not give the even split's gradient in ``trainer``
    ("" where they do: the loss is normalized by the global batch's items)."""
    args = trainer.args
    if not args.average_tokens_across_devices:
        return (
            "the Trainer normalizes each rank's loss by that rank's own items "
            "(average_tokens_across_devices=False), so replicas of unequal sizes would weigh "
            "their samples unequally; set average_tokens_across_devices=True"
        )
    if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        return (
            "the model's forward takes no num_items_in_batch and the Trainer has no "
            "compute_loss_func, so its loss is a mean over each micro-batch and replicas of "
            "unequal sizes would weigh their samples unequally"
        )
    batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if batch < accumulation:
        return (
            f"per_device_train_batch_size {batch} < gradient_accumulation_steps {accumulation}: "
            f"a replica given one micro-batch's worth of samples could not fill its "
            f"{accumulation} micro-batches"
        )
    return ""


def recut_trainer_loader(split: Any, loaders: list[Any], start_step: int) -> str:
    """Wrap the Trainer's training loader (the newest one Accelerate prepared when the model is
    prepared) in a size-form :class:`~failslow.adapters.common.recut.RecutSampler` tracked by
    ``split`` (``split.by_size`` samples per unit); the reason where it cannot be."""
    if not loaders:
        return "the Trainer prepared no training loader before its model"
    whose = "the Trainer's training loader"
    return recut(split, loaders[-1], whose, start_step=start_step, by_count=False)


def resumed_reason(trainer: Any, start_step: int) -> str:
    """At the first micro-batch: why the re-cut's step numbers are not the session's ("" when
    they are) - the Trainer resumed from its checkpoint and skips the epoch's trained batches
    through the loader."""
    step = int(trainer.state.global_step)
    if step == start_step:
        return ""
    return (
        f"the Trainer resumed from its checkpoint at step {step}, and failslow does not re-cut "
        "the loader of a resumed run yet"
    )


class TrainerAdapter(AccelerateAdapter):
    """The Accelerate adapter driven by a ``transformers.Trainer``'s own loop."""

    def __init__(
        self, accelerator: Any, *, trainer: Any, model: Any = None, model_factory: Any = None
    ) -> None:
        args = trainer.args
        super().__init__(
            accelerator,
            model=model,
            micro_batch_size=int(args.per_device_train_batch_size),
            model_factory=model_factory,
            accumulation_steps=int(args.gradient_accumulation_steps),
        )
        self.trainer = trainer
        self.split.by_size = self.micro_batch_size
        self.split.micro_loss_scale = lambda: None  # the Trainer normalizes by the global items
        self.split.loader_hint = "train with trainer.train() over the Trainer's own loader"
        self._sets_sync: Any = None
        self.size_reason = (
            NOT_DDP.format(flavor=self.flavor)
            if self.flavor != "ddp"
            else exactness_reason(trainer)
        )
        self._start_step = self.iteration
        if not self.size_reason:
            self.size_reason = recut_trainer_loader(
                self.split, accelerator._dataloaders, self._start_step
            )

    def follow_loop(self) -> None:
        """See the Trainer's own sync call before every micro-batch (and every training
        forward, as the Accelerate adapter does)."""
        self._hook = self.model.register_forward_pre_hook(self._before_forward)
        state = self.accelerator.gradient_state
        original = state._set_sync_gradients

        def trainer_sets_sync(sync_gradients: bool) -> Any:
            self._micro_batch(bool(sync_gradients))
            return original(sync_gradients)

        state._set_sync_gradients = trainer_sets_sync  # GradientState's shared dict
        self._sets_sync = (state, trainer_sets_sync)

    def _micro_batch(self, last: bool) -> None:
        """The Trainer is about to run a micro-batch; ``last``: its step's last."""
        if self._begun is None:
            self._resumed(resumed_reason(self.trainer, self._start_step))
        if self._done == 0:
            self.begin_step()
        self._done += 1
        self.set_boundary(last)
        if last:
            self._done = 0

    def _resumed(self, why: str) -> None:
        """``why`` (:func:`resumed_reason`): plans are refused from here, with that reason
        (the job record published again)."""
        if why and not self.size_reason:
            self.size_reason = why
            if self.session is not None:
                self.session.capabilities_changed()

    @hookimpl
    def failslow_capabilities(self) -> Capabilities:
        caps = super().failslow_capabilities()
        if caps.microbatch_plans == "" and self.size_reason:
            caps = replace(caps, microbatch_plans=self.size_reason)
        return replace(caps, snapshots=NO_SNAPSHOTS, hot_update=NO_SNAPSHOTS)

    def close(self) -> None:
        if self._sets_sync is not None:
            state, ours = self._sets_sync
            if vars(state).get("_set_sync_gradients") is ours:
                delattr(state, "_set_sync_gradients")
            self._sets_sync = None
        super().close()
