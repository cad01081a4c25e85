"""In-place hot update, launcher side (byterobust 6.1, "In-Place Hot-Update"; rollback: 4.2, 8.1.2).

An update names what changes in the way a job is launched - its command, its environment, its
code directory - and whether it is *urgent* (halt training at once, at one common step boundary)
or *lazy* (applied at the next failure's recovery, or when its window, 24 h by default, expires).
``failslow update submit`` records it in the job's history (:mod:`.history`, SQLite); the node
agent that ``failslow run`` hosts (:mod:`.agent`) applies it by restarting the command in place,
and rolls it back on its own when the new version fails within a probation window.
"""

from __future__ import annotations

from failslow.node.hot_update.history import History, Update
from failslow.node.hot_update.version import Version

__all__ = ["History", "Update", "Version"]
