"""failslow for the Hugging Face ``Trainer``: one line before ``trainer.train()``::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    failslow.transformers.attach(trainer)
    trainer.train()

The session starts when the Trainer prepares its model (inside ``train()``); the loop, the
loader, the LR schedule, logging and evaluation stay the Trainer's. A slow rank is detected and
diagnosed as in any job; S2 takes effect inside ``trainer.train()`` in the size form
(:mod:`.plugin`): every replica still runs ``gradient_accumulation_steps`` micro-batches, the
slow one's hold fewer samples - under DDP (:mod:`.plugin`) and under the Trainer's DeepSpeed
ZeRO-1/2 path (:mod:`.engine`). Settings come from ``config=`` (under DeepSpeed, by default the
DeepSpeed config's ``"failslow"`` block), the environment
(``FAILSLOW__SECTION__KEY``) or ``failslow run``; a bad key is one line naming it, raised by
``attach`` itself. The same line as a callback: ``Trainer(..., callbacks=[
failslow.transformers.FailslowCallback()])`` (:mod:`.callback`: it attaches at the end of the
Trainer's ``__init__``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from failslow.adapters.accelerate import Registration
from failslow.adapters.transformers.engine import TrainerEngineAdapter
from failslow.adapters.transformers.plugin import TrainerAdapter
from failslow.config import FailslowConfig, as_config, block_of
from failslow.errors import ConfigError

__all__ = ["TrainerAdapter", "TrainerEngineAdapter", "attach"]

SOURCE = "failslow.transformers.attach(trainer, config=...)"


def _adapter(accelerator: Any, *, model: Any, trainer: Any) -> Any:
    """The Trainer's adapter for what Accelerate prepared: its DeepSpeed engine, else DDP."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        engine = accelerator._models[0]
        adapter = TrainerEngineAdapter(engine, trainer=trainer)
        engine.failslow = adapter
        return adapter
    return TrainerAdapter(accelerator, model=model, trainer=trainer)


def attach(trainer: Any, config: FailslowConfig | Mapping[str, Any] | None = None) -> Registration:
    """Register failslow on ``trainer`` (every rank calls it, before ``trainer.train()``).
    Returns the registration (``.adapter`` once the Trainer prepared its model)."""
    source = SOURCE
    if config is None and getattr(trainer, "is_deepspeed_enabled", False):
        config, source = block_of(trainer.args.deepspeed, where="the Trainer's DeepSpeed config")
    cfg = as_config(config, source)  # a bad key fails here, before any collective
    accelerator = trainer.accelerator
    if accelerator._models:
        raise ConfigError(
            "failslow.transformers: attach before trainer.train() (the Trainer already "
            "prepared its model)"
        )
    registration = Registration(
        accelerator, cfg, {"trainer": trainer}, adapter_class=_adapter,
        source=source, name="transformers",
    )  # fmt: skip
    accelerator.prepare = registration._prepare_then_start
    return registration
