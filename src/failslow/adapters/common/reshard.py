"""State re-cut for a new parallel layout by each tensor's global identity (odyssey III-IV: the
job goes on with fewer ranks in a new DP x PP layout, its state resharded from the in-memory
snapshots).

A framework names each piece of a rank's state by something the layout does not change: its
*identity* (Megatron-core: the sharded tensor's global key and offset, the same on every DP
replica and for any pipeline split). Every old rank's snapshot records the identity of each of
its local keys; a new rank gathers the pieces of all old states by identity
(:func:`by_identity`) and picks those its own local keys name (:func:`pick`). Replicas of a
piece (DP copies) are interchangeable: the first old rank holding it wins, which is what the
old world's all-reduces made them (bitwise equal).

Costs once per restore: a dict over every old rank's keys, O(model) references.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from failslow.errors import FailslowError


def by_identity(
    sources: Iterable[tuple[Mapping[Any, Hashable], Mapping[Any, Any]]],
) -> dict[Hashable, Any]:
    """Every piece of ``sources`` (``(identities, values)`` per old rank and part, both keyed
    by the old rank's local keys) by its identity; a local key without a value is skipped (an
    optimizer state not allocated before its first step)."""
    found: dict[Hashable, Any] = {}
    for identities, values in sources:
        for key, identity in identities.items():
            if identity not in found and key in values:
                found[identity] = values[key]
    return found


def pick(
    found: Mapping[Hashable, Any],
    wanted: Mapping[Any, Hashable],
    what: str,
    *,
    optional: bool = False,
) -> dict[Any, Any]:
    """This rank's pieces: ``wanted`` maps its local keys to identities. A missing identity is
    a one-line error naming it (``what`` says whose state), unless ``optional`` (optimizer
    states that did not exist yet)."""
    picked: dict[Any, Any] = {}
    missing = []
    for key, identity in wanted.items():
        if identity in found:
            picked[key] = found[identity]
        elif not optional:
            missing.append(identity)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FailslowError(
            f"{what}: no old rank's snapshot holds {missing[0]!r}{more}; the layouts do not "
            "cover the same model"
        )
    return picked
