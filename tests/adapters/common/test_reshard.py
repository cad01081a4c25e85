"""Pieces of state gathered by identity across old ranks (failslow.adapters.common.reshard)."""

from __future__ import annotations

import pytest

from failslow.adapters.common.reshard import by_identity, pick
from failslow.errors import FailslowError


def test_replicas_are_taken_once_and_each_rank_picks_what_its_keys_name() -> None:
    old = [
        (
            {"layers.0.w": ("w", (0,)), "layers.1.w": ("w", (1,))},
            {"layers.0.w": 1, "layers.1.w": 2},
        ),
        (
            {"layers.0.w": ("w", (0,)), "layers.1.w": ("w", (1,))},
            {"layers.0.w": 9, "layers.1.w": 9},
        ),
        ({"layers.0.w": ("w", (2,)), "head": ("head", (0,))}, {"layers.0.w": 3}),  # head: no value
    ]
    found = by_identity(old)
    assert found == {("w", (0,)): 1, ("w", (1,)): 2, ("w", (2,)): 3}  # the first replica wins
    mine = {"layers.0.w": ("w", (1,)), "layers.1.w": ("w", (2,))}
    assert pick(found, mine, "chunk 0") == {"layers.0.w": 2, "layers.1.w": 3}
    assert pick(found, {"head": ("head", (0,))}, "optimizer 0", optional=True) == {}


def test_an_identity_no_old_rank_holds_is_one_line_naming_it() -> None:
    found = by_identity([({"a": ("a", (0,))}, {"a": 1})])
    with pytest.raises(
        FailslowError,
        match=r"^model chunk 0: no old rank's snapshot holds "
        r"\('b', \(3,\)\) and 1 more; the layouts do not cover the same model$",
    ):
        pick(found, {"x": ("b", (3,)), "y": ("c", (0,)), "a": ("a", (0,))}, "model chunk 0")
