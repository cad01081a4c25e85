"""Backup placement outside the rank's parallel groups (byterobust 6.3 Fig. 9; over-eviction 5)."""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.checkpoint.placement import backup_holders, wards_of
from failslow.core.topology import Topology


def _shares_group(topo: Topology, a: int, b: int) -> bool:
    (ta, da, pa), (tb, db, pb) = topo.coords[a], topo.coords[b]
    return (da, pa) == (db, pb) or (ta, da) == (tb, db) or (ta, pa) == (tb, pb)


def _pp_groups(topo: Topology) -> list[list[int]]:
    return [topo.pp_group(t, d) for t in range(topo.tp) for d in range(topo.dp)]


def _survives(topo: Topology, holders: tuple[int, ...], evicted_hosts: set[str]) -> list[int]:
    """Ranks whose state is gone when ``evicted_hosts`` go (rank and holder both evicted)."""
    return [
        r
        for r in range(topo.world_size)
        if topo.hosts[r] in evicted_hosts and topo.hosts[holders[r]] in evicted_hosts
    ]


def _check_common(topo: Topology, holders: tuple[int, ...]) -> None:
    n = topo.world_size
    assert len(holders) == n
    assert sorted(holders) == list(range(n)), "not a permutation"
    assert max(Counter(holders).values()) == 1  # load bound: ceil(world / world) = 1
    assert all(h != r for r, h in enumerate(holders))
    assert backup_holders(topo) == holders  # deterministic
    assert backup_holders(Topology.from_dict(topo.to_dict())) == holders
    if topo.tp * topo.dp > 1:  # the rank's own PP group evicted: its holder is outside it
        for group in _pp_groups(topo):
            members = set(group)
            assert not [r for r in group if holders[r] in members]
    if len(topo.host_names) > 1:  # any one host evicted
        for host in topo.host_names:
            assert _survives(topo, holders, {host}) == []
    for w in range(n):
        assert wards_of(holders, holders[w]) == [w]


layouts = st.tuples(
    st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.sampled_from([1, 2, 4, 8])
).filter(lambda x: x[0] * x[1] * x[2] >= 2)


@settings(max_examples=150, deadline=None)
@given(layouts)
def test_megatron_layouts(layout: tuple[int, int, int, int]) -> None:
    tp, dp, pp, gph = layout
    world = tp * dp * pp
    topo = Topology.megatron(tp=tp, dp=dp, pp=pp, gpus_per_host=min(gph, world), micro_batches=1)
    if len(topo.host_names) > 1 and max(Counter(topo.hosts).values()) * 2 > world:
        return  # a host with more than half the ranks: no permutation can leave it (skip)
    holders = backup_holders(topo)
    _check_common(topo, holders)
    groups = sum(1 for s in (tp, dp, pp) if s > 1)
    host_gph = min(gph, world)
    whole_stage_hosts = (tp * dp) % host_gph == 0 and tp * dp > host_gph
    if whole_stage_hosts and (host_gph % tp == 0 or tp % host_gph == 0):
        # Every machine of a PP group evicted (byterobust Fig. 7): all its ranks' states survive,
        # including the other pipelines that share those machines.
        for group in _pp_groups(topo):
            evicted = {topo.hosts[r] for r in group}
            assert _survives(topo, holders, evicted) == []
        if groups >= 2:  # Fig. 9: the holder shares no TP, PP or DP group
            assert not [r for r, h in enumerate(holders) if _shares_group(topo, r, h)]


@settings(max_examples=150, deadline=None)
@given(layouts, st.randoms(use_true_random=False))
def test_shuffled_hosts(layout: tuple[int, int, int, int], rnd: random.Random) -> None:
    tp, dp, pp, gph = layout
    world = tp * dp * pp
    base = Topology.megatron(tp=tp, dp=dp, pp=pp, gpus_per_host=min(gph, world), micro_batches=1)
    hosts = list(base.hosts)
    rnd.shuffle(hosts)
    topo = base.with_hosts(hosts)
    if len(topo.host_names) > 1 and max(Counter(hosts).values()) * 2 > world:
        return
    _check_common(topo, backup_holders(topo))


def test_every_arrangement_of_nine_ranks_on_hosts_of_four_four_and_one() -> None:
    """TP=1, DP=3, PP=3 on hosts of 4, 4 and 1 GPUs, in each of the 630 distinct arrangements of
    the hosts over the ranks. In 8 of them (CI's property test drew one) no pairwise swap meets
    the last rank's hard constraint, while a placement that meets every rank's exists: a
    three-way rotation of holders finds it."""
    base = Topology.megatron(tp=1, dp=3, pp=3, gpus_per_host=4, micro_batches=1)
    arrangements = set(itertools.permutations(base.hosts))
    assert len(arrangements) == 630
    for hosts in sorted(arrangements):
        topo = base.with_hosts(list(hosts))
        _check_common(topo, backup_holders(topo))


def test_byterobust_fig9_layout() -> None:
    """TP=2, PP=4, DP=2 on 2-GPU machines: every backup leaves all three groups and the machine."""
    topo = Topology.megatron(tp=2, dp=2, pp=4, gpus_per_host=2, micro_batches=1)
    holders = backup_holders(topo)
    _check_common(topo, holders)
    assert not [r for r, h in enumerate(holders) if _shares_group(topo, r, h)]


@pytest.mark.parametrize(("tp", "dp", "pp"), [(1, 8, 1), (8, 1, 1), (1, 1, 8)])
def test_single_group_uses_the_neighbouring_host(tp: int, dp: int, pp: int) -> None:
    """Plain ZeRO/FSDP (DP only) and other one-group jobs: the same slot on the next machine."""
    topo = Topology.megatron(tp=tp, dp=dp, pp=pp, gpus_per_host=2, micro_batches=1)
    holders = backup_holders(topo)
    assert holders == tuple((r + 2) % 8 for r in range(8))


def test_one_host_and_one_rank() -> None:
    topo = Topology.megatron(tp=2, dp=2, pp=1, gpus_per_host=4, micro_batches=1)
    holders = backup_holders(topo)
    assert sorted(holders) == [0, 1, 2, 3]
    assert not [r for r, h in enumerate(holders) if _shares_group(topo, r, h)]
    solo = Topology.megatron(tp=1, dp=1, pp=1, gpus_per_host=1, micro_batches=1)
    assert backup_holders(solo) == (0,)


@pytest.mark.parametrize(
    ("tp", "dp", "pp", "shuffle"), [(8, 128, 16, False), (1, 16384, 1, False), (8, 128, 16, True)]
)
def test_fast_at_16k_ranks(tp: int, dp: int, pp: int, shuffle: bool) -> None:
    topo = Topology.megatron(tp=tp, dp=dp, pp=pp, gpus_per_host=8, micro_batches=1)
    if shuffle:
        hosts = list(topo.hosts)
        random.Random(7).shuffle(hosts)
        topo = topo.with_hosts(hosts)
    t0 = time.perf_counter()
    holders = backup_holders(topo)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"{elapsed:.2f} s for {topo.world_size} ranks"
    assert sorted(holders) == list(range(topo.world_size))
    assert all(topo.hosts[h] != topo.hosts[r] for r, h in enumerate(holders))
    if tp * dp > 1:
        assert all(topo.coords[h][:2] != topo.coords[r][:2] for r, h in enumerate(holders))
