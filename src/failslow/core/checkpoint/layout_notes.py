"""Each rank's note of its layout beside its snapshots, for the node launcher (odyssey III-IV).

When ranks are lost with no standby left, the launcher decides the layout the job goes on in
(:mod:`failslow.core.planner.odyssey.rigid`) before any rank of the new world exists, from what
the old world left in node memory: with every snapshot, each rank rewrites
``layout-rank<R>.json`` in its snapshot directory - the grid (TP, DP, PP), its own coordinates,
the layers per stage (reported only by adapters that can rebuild their model on another
pipeline split: Megatron-core), the global batch in micro-batches and its step profile. O(1)
per rank and snapshot; the launcher reads its own ranks' notes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from failslow.core.topology import Topology


def note_path(directory: Path, rank: int) -> Path:
    return directory / f"layout-rank{rank}.json"


def write_note(
    directory: Path, rank: int, topology: Topology, profile: Mapping[str, Any] | None
) -> None:
    """Replace ``rank``'s note (atomically: the launcher may read it at any moment)."""
    note = {
        "rank": rank,
        "tp": topology.tp,
        "dp": topology.dp,
        "pp": topology.pp,
        "coord": list(topology.coords[rank]),
        "layers": sum(topology.layers_per_stage) or None,
        "micro_batches": topology.micro_batches,
        "profile": dict(profile) if profile else None,
    }
    path = note_path(directory, rank)
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(note))
    tmp.replace(path)


def read_notes(places: Iterable[tuple[Path, int]]) -> list[dict[str, Any]]:
    """The notes of ``(directory, rank)`` that exist and parse (a rank that died before its
    first snapshot has none; its machine's memory may be gone)."""
    notes = []
    for directory, rank in places:
        try:
            note = json.loads(note_path(directory, rank).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(note, dict) and note.get("rank") == rank:
            notes.append(note)
    return notes
