"""failslow for the Hugging Face ``Trainer``: one line before ``trainer.train()``::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    failslow.transformers.attach(trainer)
    trainer.train()

The session starts when the Trainer prepares its model (inside ``train()``); the loop, the
loader, the LR schedule, logging and evaluation stay the Trainer's. A slow rank is detected and
diagnosed as in any job; S2 takes effect inside ``trainer.train()`` in the size form
(:mod:`.plugin`): every replica still runs ``gradient_accumulation_steps`` micro-batches, the
slow one's hold fewer samples. Settings come from ``config=``, the environment
(``FAILSLOW__SECTION__KEY``) or ``failslow run``; a bad key is one line naming it, raised by
``attach`` itself. A ``TrainerCallback`` is not given the Trainer (nor its Accelerator), so the
one line is a call, not a callback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from failslow.adapters.accelerate import Registration
from failslow.adapters.transformers.plugin import TrainerAdapter
from failslow.config import FailslowConfig, as_config
from failslow.errors import ConfigError

__all__ = ["TrainerAdapter", "attach"]

SOURCE = "failslow.transformers.attach(trainer, config=...)"


def attach(trainer: Any, config: FailslowConfig | Mapping[str, Any] | None = None) -> Registration:
    """Register failslow on ``trainer`` (every rank calls it, before ``trainer.train()``).
    Returns the registration (``.adapter`` once the Trainer prepared its model)."""
    cfg = as_config(config, SOURCE)  # a bad key fails here, before any collective
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError(
            "failslow.transformers: the Trainer's DeepSpeed path is not supported yet (its "
            "engine sets the accumulation boundary itself); attach failslow.deepspeed to "
            "trainer.model_wrapped from a callback's on_train_begin for detection and diagnosis"
        )
    accelerator = trainer.accelerator
    if accelerator._models:
        raise ConfigError(
            "failslow.transformers: attach before trainer.train() (the Trainer already "
            "prepared its model)"
        )
    registration = Registration(
        accelerator, cfg, {"trainer": trainer}, adapter_class=TrainerAdapter,
        source=SOURCE, name="transformers",
    )  # fmt: skip
    accelerator.prepare = registration._prepare_then_start
    return registration
