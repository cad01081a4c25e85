"""``failslow.accelerate.attach(accelerator)``: see :mod:`failslow.adapters.accelerate`."""

from __future__ import annotations

from failslow.adapters.accelerate import AccelerateAdapter, Registration, attach

__all__ = ["AccelerateAdapter", "Registration", "attach"]
