"""``failslow.transformers.attach(trainer)``: see :mod:`failslow.adapters.transformers`."""

from __future__ import annotations

from failslow.adapters.transformers import TrainerAdapter, attach

__all__ = ["TrainerAdapter", "attach"]
