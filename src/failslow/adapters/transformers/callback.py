"""``Trainer(..., callbacks=[failslow.transformers.FailslowCallback()])``: the one line as a
callback (issue 45).

A ``TrainerCallback`` is handed neither the Trainer nor its Accelerator, but the Trainer calls
``on_init_end`` as the last thing its ``__init__`` does - the moment
:func:`~failslow.adapters.transformers.attach` wants (the Trainer built, its model not prepared
yet). The callback finds the Trainer being built there, on the call stack, and attaches. A
callback added later (``trainer.add_callback``) never sees ``on_init_end``: ``train()`` then
stops at its start with one line saying what to do, instead of training without failslow.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from transformers import Trainer, TrainerCallback

from failslow.adapters.accelerate import Registration
from failslow.adapters.transformers import attach
from failslow.config import FailslowConfig
from failslow.errors import ConfigError


def _trainer_being_built() -> Any:
    """The ``Trainer`` whose ``__init__`` is on the call stack (innermost first), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


class FailslowCallback(TrainerCallback):  # type: ignore[misc]
    """failslow on the Trainer it is passed to; ``config`` as :func:`attach` takes it (default:
    the DeepSpeed config's ``"failslow"`` block, the environment, ``failslow run``)."""

    def __init__(self, config: FailslowConfig | Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.registration: Registration | None = None
        """What :func:`attach` returned (``.adapter`` once the Trainer prepared its model)."""

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _trainer_being_built()
        if trainer is None:
            raise ConfigError(
                "failslow.transformers.FailslowCallback: on_init_end came from no Trainer's "
                "__init__; pass it as Trainer(..., callbacks=[FailslowCallback()])"
            )
        self.registration = attach(trainer, self.config)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.registration is None:
            raise ConfigError(
                "failslow.transformers.FailslowCallback was added after the Trainer was built "
                "(trainer.add_callback), so failslow is not attached: pass it as "
                "Trainer(..., callbacks=[FailslowCallback()]), or call "
                "failslow.transformers.attach(trainer) before trainer.train()"
            )
