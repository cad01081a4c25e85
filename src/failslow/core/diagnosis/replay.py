"""Dual-phase replay: which machine silently corrupts the job (byterobust 4.2, Algorithm 1).

When reattempts and a code rollback did not clear an incident, byterobust assumes an unknown
fault - a silent data corruption (SDC) - and replays a recorded step on groups of machines,
keeping TP and PP and reducing only DP. The ``z`` machines get ids ``x`` in ``0..z-1``:

1. *horizontal* phase: ``n = z / m`` groups of ``m`` consecutive machines, ``x // m``; the
   replay finds the faulty group ``a``;
2. *vertical* phase: ``n`` groups ``x mod n``; the replay finds the faulty group ``b``;
3. the suspects solve ``x // m == a`` and ``x mod n == b``: one machine when ``m <= n``,
   ``ceil(m / n)`` otherwise (:func:`locate`).

In practice ``m = k * PP`` and ``n = DP / k`` (:func:`plan`), so each group holds whole
pipelines and replays with DP ``k``. Everything here is plain integer arithmetic, O(z) to list
the groups and O(m / n + 1) to solve; property-tested at 10,000+ machines.
"""

from __future__ import annotations

from dataclasses import dataclass

from failslow.core.topology import megatron_rank


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    machines: int
    """``z``."""
    group_size: int
    """``m``: machines per replay group (``k`` whole pipelines)."""

    @property
    def groups(self) -> int:
        """``n = z / m``: groups per phase."""
        return self.machines // self.group_size

    @property
    def unique(self) -> bool:
        """Whether the two phases name exactly one machine (``m <= n``)."""
        return self.group_size <= self.groups

    def horizontal(self) -> list[list[int]]:
        """Phase 1: group ``a`` holds the machines ``x`` with ``x // m == a``."""
        m = self.group_size
        return [list(range(a * m, (a + 1) * m)) for a in range(self.groups)]

    def vertical(self) -> list[list[int]]:
        """Phase 2: group ``b`` holds the machines ``x`` with ``x mod n == b``."""
        n = self.groups
        return [list(range(b, self.machines, n)) for b in range(n)]

    def locate(self, a: int, b: int) -> list[int]:
        """The machines in horizontal group ``a`` and vertical group ``b``."""
        return locate(self.machines, self.group_size, a, b)


def plan(machines: int, pp: int, k: int | None = None) -> ReplayPlan:
    """The replay groups of ``machines`` machines running pipelines of ``pp`` machines:
    ``m = k * pp`` with ``k`` the largest whole number of pipelines for which the answer is
    unique (``m <= n``) and ``m`` divides ``z`` (given ``k``: that one). ValueError when the
    machines cannot be split so (fewer than two groups, or no ``k`` divides)."""
    if machines < 2 or pp < 1 or machines % pp:
        raise ValueError(f"{machines} machines in pipelines of {pp}: no replay groups")
    if k is not None:
        m = k * pp
        if k < 1 or machines % m or machines // m < 2:
            raise ValueError(f"k={k}: {m} machines per group do not split {machines} in >= 2")
        return ReplayPlan(machines, m)
    best = None
    for kk in range(1, machines // pp + 1):
        m = kk * pp
        if machines % m == 0 and machines // m >= 2 and m <= machines // m:
            best = m
    if best is None:  # no unique split: the smallest groups, several suspects
        best = pp if machines // pp >= 2 else None
    if best is None:
        raise ValueError(f"{machines} machines in pipelines of {pp}: fewer than two groups")
    return ReplayPlan(machines, best)


def locate(machines: int, group_size: int, a: int, b: int) -> list[int]:
    """Algorithm 1, lines 13-14: every ``x`` with ``x // m == a`` and ``x mod n == b`` - one
    when ``m <= n``, ``ceil(m / n)`` (or one fewer at the edge) otherwise."""
    m, n = group_size, machines // group_size
    if not (0 <= a < n and 0 <= b < n):
        raise ValueError(f"faulty groups a={a}, b={b}: each must be in 0..{n - 1}")
    first = a * m
    start = first + (b - first) % n  # the first x >= a*m with x mod n == b
    return list(range(start, first + m, n))


# -- grids: machines are TP groups, groups are whole pipelines ------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayWorld:
    """One replay group of a TP x PP grid as a world of its own (TP and PP kept, DP ``k``)."""

    ranks: list[int]
    """The old world's ranks that run it, in its own rank order (Megatron-core's default,
    :func:`~failslow.core.topology.megatron_rank` with DP ``k``)."""
    roles: list[int]
    """Per rank of it: the old rank whose place it takes (TP rank ``t`` of stage ``s`` in its
    own old replica) - whose RNG state and metric history it resumes."""


@dataclass(frozen=True, slots=True)
class Grid:
    """Where a TP x DP x PP world's ranks sit, for dual-phase replay: machine ``x = d * PP + s``
    is the TP group of replica ``d``, stage ``s`` (byterobust's machine: one host holding a TP
    group), so ``k * PP`` consecutive machines are ``k`` whole pipelines (the horizontal
    groups). A vertical group (``x mod n``) holds machines of any stages; its ``i``-th machine
    takes stage ``i mod PP`` of replica ``i // PP`` - byterobust re-forms the pipelines, and
    every stage's state is in the old world's snapshots (a resharded restore gathers it)."""

    tp: int
    pp: int
    dp: int
    rank_of: dict[tuple[int, int, int], int]
    """``(t, d, s)`` -> the old world's rank that runs that role."""

    @classmethod
    def from_coords(cls, coords: dict[int, tuple[int, int, int]], tp: int, pp: int) -> Grid:
        """From each rank's ``(t, d, s)`` (its layout note); ValueError unless they fill a
        ``tp x dp x pp`` grid exactly."""
        n = len(coords)
        if tp < 1 or pp < 1 or n % (tp * pp):
            raise ValueError(f"{n} ranks do not fill a TP{tp} x PP{pp} grid")
        dp = n // (tp * pp)
        rank_of = {(int(t), int(d), int(s)): r for r, (t, d, s) in coords.items()}
        want = {(t, d, s) for t in range(tp) for d in range(dp) for s in range(pp)}
        if set(rank_of) != want:
            raise ValueError(f"the ranks' coordinates do not fill a TP{tp} x DP{dp} x PP{pp} grid")
        return cls(tp, pp, dp, rank_of)

    @property
    def machines(self) -> int:
        return self.dp * self.pp

    def machine_ranks(self, x: int) -> list[int]:
        """The old world's ranks of machine ``x`` (its TP group, in TP order)."""
        d, s = divmod(x, self.pp)
        return [self.rank_of[(t, d, s)] for t in range(self.tp)]

    def world(self, machines: list[int]) -> ReplayWorld:
        """The replay world of a group of ``k * PP`` machines (in the order the group lists
        them: the ``i``-th takes stage ``i mod PP`` of replica ``i // PP``)."""
        if not machines or len(machines) % self.pp:
            raise ValueError(f"{len(machines)} machines are not whole pipelines of {self.pp}")
        k = len(machines) // self.pp
        ranks = [0] * (len(machines) * self.tp)
        roles = [0] * len(ranks)
        for i, x in enumerate(machines):
            d_new, s_new = i // self.pp, i % self.pp
            d_old = x // self.pp
            for t in range(self.tp):
                j = megatron_rank((t, d_new, s_new), tp=self.tp, dp=k)
                ranks[j] = self.rank_of[(t, d_old, x % self.pp)]
                roles[j] = self.rank_of[(t, d_old, s_new)]
        return ReplayWorld(ranks, roles)
