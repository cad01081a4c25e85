"""``failslow.transformers``: ``Trainer(..., callbacks=[FailslowCallback()])`` or
``attach(trainer)``; see :mod:`failslow.adapters.transformers`."""

from __future__ import annotations

from typing import Any

from failslow.adapters.transformers import TrainerAdapter, attach

__all__ = ["FailslowCallback", "TrainerAdapter", "attach"]  # noqa: F822 - FailslowCallback: lazily


def __getattr__(name: str) -> Any:
    if name == "FailslowCallback":  # a TrainerCallback: imports transformers when asked for
        from failslow.adapters.transformers.callback import FailslowCallback

        return FailslowCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
