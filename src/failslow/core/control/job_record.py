"""The job record (``keys.JOB``) as the control plane reads it.

Rank 0's session writes the record at every launch of the job: its topology, capabilities and
world size. A job that went on with fewer ranks after a fail-stop (odyssey III-IV, ``failslow
run --min-ranks``) has a smaller world than the controller was started for, so pause rounds,
profiles and plans count the ranks the record names, not the configured number (one store read
per round).
"""

from __future__ import annotations

from typing import Any

from failslow.core.control import keys


def world_size(store: Any, configured: int) -> int:
    """The job's world size now: the record's, else ``configured`` (no record yet)."""
    job = store.get_json(keys.JOB)
    try:
        return int(job["world_size"]) if job else configured
    except (KeyError, TypeError, ValueError):
        return configured
