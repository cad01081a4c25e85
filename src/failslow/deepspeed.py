"""``failslow.deepspeed.initialize(...)`` / ``attach(engine)``: see
:mod:`failslow.adapters.deepspeed`."""

from __future__ import annotations

from failslow.adapters.deepspeed import DeepSpeedAdapter, attach, initialize

__all__ = ["DeepSpeedAdapter", "attach", "initialize"]
