"""The Hugging Face ``Trainer``'s DeepSpeed path as a failslow plugin: S2 by size over ZeRO
(greyhound 5.2's S2 in the size form of :mod:`failslow.adapters.common.recut`; issue 46).

Under ``TrainingArguments(deepspeed=...)`` the Trainer drives a DeepSpeed engine through
Accelerate's ``DeepSpeedEngineWrapper``, which sets the engine's accumulation boundary itself
before every backward - the Trainer's own ``G`` micro-batches per step on every rank. That is
why a count plan cannot run there (the DeepSpeed adapter refuses it), and why a size plan can:
every replica still runs ``G`` micro-steps, so every reduction DeepSpeed issues inside a
micro-step's backward (ZeRO-2's reduce-scatters, ZeRO-3's gathers) still happens on every rank.
The plugin is the DeepSpeed adapter (:class:`~failslow.adapters.deepspeed.plugin.
DeepSpeedAdapter`: the topology, the step tracker over the engine's counters) with the
Trainer's size form: its prepared loader re-cut as under DDP (:mod:`.plugin`), the loop's
boundary calls taken as the plan's (they agree: ``G`` for every replica), the gradient exact
where the Trainer divides the summed token losses by the global batch's items (it passes
``scale_wrt_gas=False`` to DeepSpeed's backward). ZeRO stages 1 and 2; stage 3 and snapshots
declared, with the reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from failslow import hookimpl
from failslow.adapters.deepspeed.plugin import DeepSpeedAdapter
from failslow.adapters.transformers.plugin import (
    NO_SNAPSHOTS,
    exactness_reason,
    recut_trainer_loader,
    resumed_reason,
)
from failslow.capabilities import Capabilities

ZERO3 = (
    "failslow.transformers re-cuts the Trainer's micro-batches by size under ZeRO stages 1 and "
    "2 so far (this engine runs stage 3)"
)


class TrainerEngineAdapter(DeepSpeedAdapter):
    """The DeepSpeed adapter driven by a ``transformers.Trainer``'s own loop."""

    weighs_samples = False  # the Trainer divides the summed losses by the global batch's items

    def __init__(self, engine: Any, *, trainer: Any) -> None:
        super().__init__(engine)
        self.trainer = trainer
        self.split.by_size = int(engine.train_micro_batch_size_per_gpu())
        self.split.micro_loss_scale = lambda: None  # the Trainer normalizes by the global items
        self.split.loader_hint = "train with trainer.train() over the Trainer's own loader"
        self._start_step = int(engine.global_steps)
        self._first = True
        self.size_reason = ZERO3 if engine.zero_optimization_stage() >= 3 else ""
        self.size_reason = self.size_reason or exactness_reason(trainer)
        if not self.size_reason:
            self.size_reason = recut_trainer_loader(
                self.split, trainer.accelerator._dataloaders, self._start_step
            )

    def follow_loop(self) -> None:
        """Follow the Trainer's micro-batches (the engine's counters, before every training
        forward). Accelerate's wrapper sets the boundary before every backward, as the plan's
        size form has it (``G`` for every replica): not a loop that owns the count here."""
        self._hook = self.tracker.follow(
            self.engine, self.engine.set_gradient_accumulation_boundary
        )

    def _begin_step(self, step: int) -> None:
        if self._first:
            self._first = False
            why = resumed_reason(self.trainer, self._start_step)
            if why and not self.size_reason:
                self.size_reason = why
                if self.session is not None:
                    self.session.capabilities_changed()
        super()._begin_step(step)

    @hookimpl
    def failslow_capabilities(self) -> Capabilities:
        caps = super().failslow_capabilities()  # the count form's reasons: not this one's
        return replace(
            caps, microbatch_plans=self.size_reason, snapshots=NO_SNAPSHOTS, hot_update=NO_SNAPSHOTS
        )
