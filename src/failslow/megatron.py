"""``failslow.megatron.attach(model, optimizer, scheduler)`` and
``failslow.megatron.parallel_sizes(tp, pp)``: see :mod:`failslow.adapters.megatron`."""

from __future__ import annotations

from failslow.adapters.megatron import MegatronAdapter, attach, parallel_sizes

__all__ = ["MegatronAdapter", "attach", "parallel_sizes"]
