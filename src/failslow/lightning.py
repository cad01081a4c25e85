"""``failslow.lightning``: ``Trainer(..., callbacks=[FailslowCallback()])``; see
:mod:`failslow.adapters.lightning`."""

from __future__ import annotations

from failslow.adapters.lightning import FailslowCallback, LightningAdapter

__all__ = ["FailslowCallback", "LightningAdapter"]
