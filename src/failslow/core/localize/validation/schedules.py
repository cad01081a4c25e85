"""O(1) link-test schedules for ring and tree communicators (greyhound 4.3, Fig. 10; falcon 4.3,
Fig. 9).

Testing every pair of a communication group costs O(N^2) transfers. Greyhound instead tests only
the links a collective uses and splits them into *passes*: within one pass every rank takes part
in at most one point-to-point transfer (it sends once, or receives once, or idles), so all
transfers of a pass run at the same time without sharing an endpoint, and the number of passes
does not grow with the group size.

Ring (Fig. 10 left/center). The ring's links are the directed hops ``i -> (i + 1) % n`` along
which ring collectives move data. Pass 1 sends from every even rank to the next odd rank
(``0->1, 2->3, ...``), pass 2 from every odd rank to the next even rank (``1->2, 3->4, ...``).
An even ring is covered by these two passes (the closing hop ``n-1 -> 0`` goes from odd to even
and falls in pass 2). An odd ring needs a third pass for the remaining hop ``n-1 -> 0``, whose two
ends (even ``n-1`` and even ``0``) are both busy in pass 1. ``n == 2`` is the even case: its ring
has the hops ``0->1`` and ``1->0`` (both directions of the one pair of ranks), tested in two
passes.

Tree (Fig. 10 right). Greyhound tests the binary tree "NCCL determines": ranks here are tree
positions of NCCL's binary tree (``ncclGetBtree`` in NCCL's ``src/graph/trees.cc``; tree 0 of its
double binary tree, rooted at 0; tree 1 is the mirrored tree for even ``n`` and the shifted tree
for odd ``n``, as ``ncclGetDtree`` builds it). Each tree link is tested once, from child to parent
(the reduce direction), as in the paper: pass 1 sends from the left children (NCCL's child 0, the
lower-numbered child) at even levels to their parents, pass 2 from the right children (child 1)
at even levels, passes 3 and 4 do the same for children at odd levels. The root is level 0. In a
pass every sender is at a level of one parity and every receiver (its parent) at the other, and a
parent has at most one left and one right child, so no rank is in two transfers of one pass.

Passes are in *positions* ``0..n-1`` of the group; :func:`map_passes` turns them into the group's
global ranks, in the group's own order; :func:`communicator_passes` combines the schedules of
the degraded communicators a validation round tests. Empty passes (a tree too shallow to have
odd-level left children, ...) are left out, so a tree schedule has at most 4 passes. Every
function here is pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from failslow.errors import FailslowError

Link = tuple[int, int]
"""A directed link ``(sender, receiver)``."""

Pass = list[Link]


def _check_n(n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise FailslowError(f"{what}: a link test needs a group of at least 2 ranks, got n={n!r}")


# -- ring --------------------------------------------------------------------------------------


def links_of_ring(n: int) -> list[Link]:
    """The directed hops ``(i, (i + 1) % n)`` of a ring of ``n`` ranks, in ring order."""
    _check_n(n, "ring")
    return [(i, (i + 1) % n) for i in range(n)]


def ring_passes(n: int) -> list[Pass]:
    """Greyhound's ring schedule: 2 passes for an even ``n``, 3 for an odd ``n`` (n >= 2)."""
    _check_n(n, "ring")
    even_to_odd = [(i, i + 1) for i in range(0, n - 1, 2)]
    odd_to_even = [(i, (i + 1) % n) for i in range(1, n, 2)]
    if n % 2 == 0:
        return [even_to_odd, odd_to_even]
    return [even_to_odd, odd_to_even, [(n - 1, 0)]]


# -- tree --------------------------------------------------------------------------------------


def _btree_parent(n: int, rank: int) -> tuple[int, int]:
    """``(parent, child_type)`` of ``rank > 0`` in NCCL's binary tree of ``n`` ranks.

    NCCL's ``ncclGetBtree``: with ``bit`` the lowest set bit of ``rank``, the parent is
    ``(rank ^ bit) | (bit << 1)``, or ``rank ^ bit`` when that is out of range; the child is its
    parent's child 0 when it is smaller than the parent, else child 1.
    """
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    if up >= n:
        up = rank ^ bit
    return up, (0 if rank < up else 1)


def tree_parents(n: int, *, tree: int = 0) -> dict[int, tuple[int, int]]:
    """``child -> (parent, child_type)`` of tree 0 or 1 of NCCL's double binary tree.

    ``child_type`` 0 is the left (first) child, 1 the right (second) child. Tree 0 is
    ``ncclGetBtree`` rooted at 0. Tree 1 is ``ncclGetDtree``'s second tree: for odd ``n`` tree 0
    shifted by one rank (``r -> r + 1 mod n``, rooted at 1), for even ``n`` tree 0 mirrored
    (``r -> n - 1 - r``, rooted at ``n - 1``, which swaps left and right children).
    """
    _check_n(n, "tree")
    if tree not in (0, 1):
        raise FailslowError(f"tree: NCCL's double binary tree has trees 0 and 1, got tree={tree!r}")
    parents: dict[int, tuple[int, int]] = {}
    for rank in range(n):
        if tree == 0:
            if rank == 0:
                continue
            parents[rank] = _btree_parent(n, rank)
        elif n % 2 == 1:
            shifted = (rank - 1) % n
            if shifted == 0:
                continue
            up, kind = _btree_parent(n, shifted)
            parents[rank] = ((up + 1) % n, kind)
        else:
            mirrored = n - 1 - rank
            if mirrored == 0:
                continue
            up, kind = _btree_parent(n, mirrored)
            parents[rank] = (n - 1 - up, 1 - kind)
    return parents


def _levels(parents: dict[int, tuple[int, int]], n: int) -> dict[int, int]:
    """Depth of every rank below the root (level 0)."""
    levels: dict[int, int] = {}

    def level(rank: int) -> int:
        if rank not in levels:
            levels[rank] = 0 if rank not in parents else level(parents[rank][0]) + 1
        return levels[rank]

    for rank in range(n):
        level(rank)
    return levels


def links_of_tree(n: int, *, tree: int = 0) -> list[Link]:
    """The directed ``(child, parent)`` links of the tree, ordered by child."""
    parents = tree_parents(n, tree=tree)
    return [(child, parents[child][0]) for child in sorted(parents)]


def tree_passes(n: int, *, tree: int = 0) -> list[Pass]:
    """Greyhound's tree schedule: <= 4 passes (left, right children at even, then odd levels)."""
    parents = tree_parents(n, tree=tree)
    levels = _levels(parents, n)
    passes: list[Pass] = []
    for parity in (0, 1):
        for kind in (0, 1):
            p = [
                (child, up)
                for child, (up, child_kind) in sorted(parents.items())
                if child_kind == kind and levels[child] % 2 == parity
            ]
            if p:
                passes.append(p)
    return passes


# -- checks and mapping ------------------------------------------------------------------------


def check_passes(passes: Sequence[Iterable[Link]], links: Iterable[Link]) -> None:
    """Raise :class:`FailslowError` unless ``passes`` test exactly ``links``, each once, with no
    rank in two transfers of one pass and no self-transfer."""
    wanted = list(links)
    if len(set(wanted)) != len(wanted):
        raise FailslowError(f"check_passes: the topology lists a link twice: {wanted}")
    seen: dict[Link, int] = {}
    for index, one_pass in enumerate(passes):
        busy: dict[int, Link] = {}
        for link in one_pass:
            src, dst = link
            if src == dst:
                raise FailslowError(f"pass {index}: self-transfer {link}")
            for rank in (src, dst):
                if rank in busy:
                    raise FailslowError(
                        f"pass {index}: rank {rank} is in two transfers, {busy[rank]} and {link}"
                    )
                busy[rank] = link
            if link in seen:
                raise FailslowError(f"link {link} tested twice, in passes {seen[link]} and {index}")
            seen[link] = index
    wanted_set = set(wanted)
    missing = [link for link in wanted if link not in seen]
    extra = [link for link in seen if link not in wanted_set]
    if missing or extra:
        raise FailslowError(
            f"check_passes: passes do not cover the topology: missing {missing}, extra {extra}"
        )


def map_passes(passes: Sequence[Iterable[Link]], ranks: Sequence[int]) -> list[Pass]:
    """Translate positions ``0..n-1`` into ``ranks[position]`` (a group's global ranks in order)."""
    if len(set(ranks)) != len(ranks):
        raise FailslowError(f"map_passes: the group lists a rank twice: {list(ranks)}")
    out: list[Pass] = []
    for one_pass in passes:
        mapped = []
        for src, dst in one_pass:
            if not (0 <= src < len(ranks) and 0 <= dst < len(ranks)):
                raise FailslowError(
                    f"map_passes: link {(src, dst)} is outside a group of {len(ranks)} ranks"
                )
            mapped.append((ranks[src], ranks[dst]))
        out.append(mapped)
    return out


# -- the links of degraded communicators ----------------------------------------------------------


def communicator_passes(groups: Iterable[Sequence[int]]) -> list[Pass]:
    """Passes that test the links each communicator uses: its ring and NCCL's tree 0, both in
    the order of the group's ranks (its membership record: the order it was created with,
    which NCCL's ring and tree channels follow over the group's ranks - a ring over the sorted
    ranks of a group created as ``[0, 2, 1, 3]`` would test ``0->1``, which it never uses).

    Each group's passes keep the one-transfer-per-rank property; a pass joins the first
    combined pass that shares no rank with it, so communicators on disjoint ranks (the degraded
    DP groups of several pipeline stages) are tested at once and the count stays O(1) per
    overlapping group. A link two groups share is tested once."""
    combined: list[Pass] = []
    busy: list[set[int]] = []
    seen: set[Link] = set()
    for group in groups:
        ranks = list(group)
        if len(ranks) < 2:
            continue
        n = len(ranks)
        for one_pass in map_passes(ring_passes(n) + tree_passes(n), ranks):
            fresh = [link for link in one_pass if link not in seen]
            if not fresh:
                continue
            seen.update(fresh)
            ends = {r for link in fresh for r in link}
            for index, taken in enumerate(busy):
                if not taken & ends:
                    combined[index].extend(fresh)
                    taken |= ends
                    break
            else:
                combined.append(fresh)
                busy.append(ends)
    return combined
