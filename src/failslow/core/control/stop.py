"""Stopping every rank at one step boundary for a hot update (byterobust 6.1).

Not a mitigation: the launcher's update agent (:mod:`failslow.node.hot_update.agent`) sends
:class:`StopForUpdate` through the plan channel (:mod:`failslow.core.control.plan_channel`), so
every rank reaches the same step boundary, commits its in-memory snapshot there and exits with
:data:`EXIT_FOR_UPDATE`; the launcher then restarts the command in place with the update and the
ranks resume from that snapshot (:mod:`failslow.runtime.session`).
"""

from __future__ import annotations

from dataclasses import dataclass

from failslow.core.planner.plans import Plan


@dataclass(frozen=True, kw_only=True)
class StopForUpdate(Plan):
    """Every rank commits an in-memory snapshot at one step boundary and exits with
    :data:`EXIT_FOR_UPDATE`, so the node agent restarts it in place with new code or config
    (byterobust 6.1); the restarted ranks resume from that snapshot."""

    update_id: int
    reason: str = ""


EXIT_FOR_UPDATE = 75
"""Exit status of a rank that stopped for a hot update (EX_TEMPFAIL)."""

EXIT_UNRESTORABLE = 78
"""Exit status of a rank that cannot restore its state from memory under failslow's rank
launcher (a rank and its backup holder lost together): restarting again cannot help, so the
launcher ends the job for a person instead (EX_CONFIG)."""

EXIT_FOR_RESTART = 76
"""Exit status of a rank that stopped at an S4 restart plan's step with its snapshot committed
(a :class:`~failslow.core.planner.plans.RestartPlan`; greyhound 5.2, byterobust 6.2): the node
launcher restarts it in place."""

EXIT_EVICTED = 77
"""Like :data:`EXIT_FOR_RESTART`, from a rank whose host the plan evicts: the node launcher
restarts its rank on a standby slot."""
