"""``failslow.fsdp.attach(model, optimizer, mesh=...)``: see :mod:`failslow.adapters.fsdp`."""

from __future__ import annotations

from failslow.adapters.fsdp import FSDPAdapter, attach

__all__ = ["FSDPAdapter", "attach"]
