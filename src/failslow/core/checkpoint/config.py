"""Settings of in-memory checkpoints (byterobust 6.3).

Composed into the ``checkpoint`` section of :class:`failslow.config.FailslowConfig`; the rank
runtime's snapshot service (:mod:`failslow.runtime.snapshot_service`) follows them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = 0
    """In-memory snapshot every this many steps (byterobust 6.3); 0: off. 1 is practical."""
    directory: str | None = None
    """Node-local directory for snapshots and peers' backups (``/dev/shm/...``; survives a
    restart of the processes). None: ``$FAILSLOW_SNAPSHOT_DIR`` (set by ``failslow run``),
    else host memory of the process only."""
    backup: bool = True
    """Send every snapshot to a peer outside the rank's parallel groups."""
