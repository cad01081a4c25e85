"""The O(1) ring and tree link-test schedules (greyhound 4.3, Fig. 10), exhaustive for n = 2..64."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.localize.validation.schedules import (
    check_passes,
    communicator_passes,
    links_of_ring,
    links_of_tree,
    map_passes,
    ring_passes,
    tree_parents,
    tree_passes,
)
from failslow.errors import FailslowError

SIZES = range(2, 65)


def nccl_btree(nranks: int, rank: int) -> tuple[int, int, int]:
    """A line-by-line port of NCCL's ``ncclGetBtree`` (src/graph/trees.cc): (up, down0, down1)."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1)
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, down0, down1


def nccl_dtree_second(nranks: int, rank: int) -> tuple[int, int, int]:
    """NCCL's ``ncclGetDtree`` second tree: shifted for odd ``nranks``, mirrored for even."""
    if nranks % 2 == 1:
        u, d0, d1 = nccl_btree(nranks, (rank - 1 + nranks) % nranks)
        return tuple(-1 if x == -1 else (x + 1) % nranks for x in (u, d0, d1))  # type: ignore[return-value]
    u, d0, d1 = nccl_btree(nranks, nranks - 1 - rank)
    mirror = [-1 if x == -1 else nranks - 1 - x for x in (u, d1, d0)]
    return mirror[0], mirror[1], mirror[2]


def rank_once_per_pass(passes: list[list[tuple[int, int]]]) -> bool:
    return all(len({r for link in p for r in link}) == 2 * len(p) for p in passes)


# -- exhaustive --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_ring_covers_every_hop_in_two_or_three_passes(n: int) -> None:
    passes = ring_passes(n)
    check_passes(passes, links_of_ring(n))
    assert len(passes) == (2 if n % 2 == 0 else 3)
    assert rank_once_per_pass(passes)
    assert sorted(link for p in passes for link in p) == sorted(links_of_ring(n))
    # Pass 1 is even -> next odd, pass 2 odd -> next even, as greyhound describes.
    assert all(src % 2 == 0 and dst == src + 1 for src, dst in passes[0])
    assert all(src % 2 == 1 and dst == (src + 1) % n for src, dst in passes[1])


@pytest.mark.parametrize("tree", [0, 1])
@pytest.mark.parametrize("n", SIZES)
def test_tree_covers_every_edge_in_at_most_four_passes(n: int, tree: int) -> None:
    passes = tree_passes(n, tree=tree)
    links = links_of_tree(n, tree=tree)
    check_passes(passes, links)
    assert 1 <= len(passes) <= 4
    assert rank_once_per_pass(passes)
    assert len(links) == n - 1  # a spanning tree
    if n >= 8:
        assert len(passes) == 4


@pytest.mark.parametrize("n", SIZES)
def test_trees_are_ncclgetbtree_and_ncclgetdtree(n: int) -> None:
    for tree, reference in ((0, nccl_btree), (1, nccl_dtree_second)):
        parents = tree_parents(n, tree=tree)
        roots = [r for r in range(n) if r not in parents]
        assert len(roots) == 1
        for rank in range(n):
            up, down0, down1 = reference(n, rank)
            assert parents.get(rank, (-1, -1))[0] == up, (tree, rank)
            left = [c for c, (p, kind) in parents.items() if p == rank and kind == 0]
            right = [c for c, (p, kind) in parents.items() if p == rank and kind == 1]
            assert left == ([] if down0 == -1 else [down0]), (tree, rank)
            assert right == ([] if down1 == -1 else [down1]), (tree, rank)


def test_tree_passes_follow_levels_and_child_kind() -> None:
    # NCCL's 14-rank illustration: 0 - 8; 8: 4, 12; 4: 2, 6; 12: 10, 13; 2: 1, 3; ...
    passes = tree_passes(14)
    assert passes == [
        [(1, 2), (4, 8), (5, 6), (9, 10)],  # left children at even levels
        [(3, 2), (7, 6), (11, 10), (12, 8)],  # right children at even levels
        [(2, 4), (10, 12)],  # left children at odd levels
        [(6, 4), (8, 0), (13, 12)],  # right children at odd levels
    ]


def test_small_cases() -> None:
    assert ring_passes(2) == [[(0, 1)], [(1, 0)]]
    assert ring_passes(3) == [[(0, 1)], [(1, 2)], [(2, 0)]]
    assert ring_passes(4) == [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]
    assert ring_passes(5)[2] == [(4, 0)]
    assert tree_passes(2) == [[(1, 0)]]
    assert tree_passes(4) == [[(1, 2)], [(3, 2)], [(2, 0)]]


# -- properties at larger sizes ------------------------------------------------------------------


@settings(deadline=None)
@given(st.integers(min_value=2, max_value=4096))
def test_pass_count_does_not_grow(n: int) -> None:
    ring = ring_passes(n)
    tree = tree_passes(n)
    check_passes(ring, links_of_ring(n))
    check_passes(tree, links_of_tree(n))
    assert len(ring) <= 3 and len(tree) <= 4


@given(st.data())
def test_mapped_passes_keep_the_properties(data: st.DataObject) -> None:
    n = data.draw(st.integers(min_value=2, max_value=40))
    ranks = data.draw(st.permutations(range(200)))[:n]
    for passes, links in (
        (ring_passes(n), links_of_ring(n)),
        (tree_passes(n, tree=1), links_of_tree(n, tree=1)),
    ):
        mapped = map_passes(passes, ranks)
        check_passes(mapped, [(ranks[a], ranks[b]) for a, b in links])
        assert rank_once_per_pass(mapped)


# -- check_passes rejects bad schedules ---------------------------------------------------------


@pytest.mark.parametrize(
    ("passes", "links", "match"),
    [
        ([[(0, 1), (1, 2)]], [(0, 1), (1, 2)], "rank 1 is in two transfers"),
        ([[(0, 1)], [(0, 1)]], [(0, 1)], "tested twice"),
        ([[(0, 1)]], [(0, 1), (1, 0)], "missing"),
        ([[(0, 1), (2, 3)]], [(0, 1)], "extra"),
        ([[(2, 2)]], [(2, 2)], "self-transfer"),
        ([[(0, 1)]], [(0, 1), (0, 1)], "twice"),
    ],
)
def test_check_passes_rejects(passes: list[list[tuple[int, int]]], links: list, match: str) -> None:
    with pytest.raises(FailslowError, match=match):
        check_passes(passes, links)


def test_bad_inputs_name_the_input() -> None:
    with pytest.raises(FailslowError, match="at least 2 ranks"):
        ring_passes(1)
    with pytest.raises(FailslowError, match="at least 2 ranks"):
        tree_passes(0)
    with pytest.raises(FailslowError, match="trees 0 and 1"):
        tree_passes(4, tree=2)
    with pytest.raises(FailslowError, match="outside a group of 2"):
        map_passes([[(0, 2)]], [5, 6])
    with pytest.raises(FailslowError, match="twice"):
        map_passes([[(0, 1)]], [5, 5])


# -- the links of degraded communicators ----------------------------------------------------------


def test_a_communicator_is_tested_in_its_group_order_not_sorted() -> None:
    """A group created as [0, 2, 1, 3] rings 0->2->1->3->0: those hops are tested, and 0->1
    (a hop of the sorted ring that this communicator never uses) is not."""
    passes = communicator_passes([(0, 2, 1, 3)])
    tested = {link for one in passes for link in one}
    ring = {(0, 2), (2, 1), (1, 3), (3, 0)}
    # NCCL's tree 0 over positions 0..3 (parents 1->2, 2->0, 3->2) in group order
    tree = {(2, 1), (1, 0), (3, 1)}
    assert tested == ring | tree
    assert (0, 1) not in tested
    assert rank_once_per_pass(passes)


@given(st.data())
def test_communicator_passes_cover_each_group_once_with_one_transfer_per_rank(
    data: st.DataObject,
) -> None:
    world = data.draw(st.integers(min_value=2, max_value=48))
    groups = [
        data.draw(st.permutations(range(world)))[: data.draw(st.integers(2, world))]
        for _ in range(data.draw(st.integers(1, 4)))
    ]
    passes = communicator_passes(groups)
    wanted = {}
    for g in groups:
        n = len(g)
        for a, b in links_of_ring(n) + links_of_tree(n):
            wanted.setdefault((g[a], g[b]), None)
    check_passes(passes, list(wanted))  # every link once, no rank twice in a pass
    single = max(len(ring_passes(len(g)) + tree_passes(len(g))) for g in groups)
    assert len(passes) <= single * len(groups)


def test_communicators_on_disjoint_ranks_share_passes() -> None:
    """The DP groups of four pipeline stages (disjoint ranks) take no more passes than one."""
    stages = [tuple(range(s, 32, 4)) for s in range(4)]
    one = len(communicator_passes(stages[:1]))
    assert len(communicator_passes(stages)) == one
    assert communicator_passes([(5,)]) == []
