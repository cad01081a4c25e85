"""The capture layer (greyhound 4.2): the Python hook over torch.distributed.

``install()`` records every collective and point-to-point call of this process into its
event ring (:mod:`failslow.core.ring`); see :mod:`failslow.nccl_hook.capture`.
"""

from __future__ import annotations

from failslow.core.ring import DEFAULT_CAPACITY
from failslow.nccl_hook.capture import Capture, current, install, uninstall

__all__ = ["DEFAULT_CAPACITY", "Capture", "current", "install", "uninstall"]
