"""``failslow.megatron.attach(model, optimizer, scheduler)``: see
:mod:`failslow.adapters.megatron`."""

from __future__ import annotations

from failslow.adapters.megatron import MegatronAdapter, attach

__all__ = ["MegatronAdapter", "attach"]
