"""Cross-group profiling on synthetic DP x PP jobs (greyhound 4.3, falcon 4.3)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from failslow.core.control.controller import link_groups
from failslow.core.events import CommEvent, GroupInfo, OpCode, group_key
from failslow.core.localize.profiling import (
    GroupSummary,
    comparable_clusters,
    degraded_groups,
    group_profiles,
    late_ranks,
    summarize,
)
from failslow.core.localize.validation.schedules import communicator_passes

MS = 1_000_000


def simulate(
    *,
    dp: int = 2,
    pp: int = 4,
    iterations: int = 12,
    compute_ms: float = 20.0,
    dp_ms: float = 8.0,
    p2p_ms: float = 2.0,
    slow_rank: dict[int, float] | None = None,  # rank -> compute factor
    slow_dp_stage: dict[int, float] | None = None,  # stage -> DP transfer factor
    jitter: float = 0.0,
    ranks_per_host: int = 4,
    seed: int = 0,
    dp_order: int = 1,  # -1: each DP group is created over its ranks in descending order
) -> list[GroupSummary]:
    """One iteration: every pipeline runs its stages forward (stage s receives from s-1,
    computes, sends to s+1), then every rank computes a backward chunk and all-reduces with
    its DP peers (the ranks of its stage). Rank r = d * pp + s. Each host has its own clock."""
    rng = np.random.default_rng(seed)
    slow_rank = slow_rank or {}
    slow_dp_stage = slow_dp_stage or {}
    world = dp * pp
    offset = {
        r: (r // ranks_per_host) * 10**12 + 12345 * (r // ranks_per_host) for r in range(world)
    }
    host = {r: f"node{r // ranks_per_host}" for r in range(world)}

    def noisy(x: float) -> float:
        return x * (1 + jitter * rng.standard_normal()) if jitter else x

    groups: dict[int, GroupInfo] = {}
    dp_key, pair_key = {}, {}
    for s in range(pp):
        ranks = tuple(d * pp + s for d in range(dp))[::dp_order]
        dp_key[s] = group_key(f"dp{s}", ranks)
        groups[dp_key[s]] = GroupInfo(dp_key[s], ranks, role="dp")
    for d in range(dp):
        for s in range(pp - 1):
            a, b = d * pp + s, d * pp + s + 1
            pair_key[a, b] = group_key(f"pp{a}-{b}", (a, b))
            groups[pair_key[a, b]] = GroupInfo(pair_key[a, b], (a, b), role="pp")
    events: dict[int, list[CommEvent]] = {r: [] for r in range(world)}
    anchors: dict[int, list[int]] = {r: [] for r in range(world)}
    calls: dict[int, int] = {k: 0 for k in groups}

    def record(r: int, t0: float, t1: float, key: int, op: OpCode, nbytes: int, peer: int = -1):
        events[r].append(
            CommEvent(
                t_start_ns=int(t0) + offset[r],
                t_end_ns=int(t1) + offset[r],
                nbytes=nbytes,
                group_key=key,
                op=op,
                peer=peer,
                call_index=calls[key],
            )
        )

    t = 1e9
    for _ in range(iterations):
        for r in range(world):
            anchors[r].append(int(t) + offset[r])
        done = {}
        for d in range(dp):
            ready = t
            for s in range(pp):
                r = d * pp + s
                finish = ready + noisy(compute_ms * MS) * slow_rank.get(r, 1.0)
                if s < pp - 1:  # receiver posted its recv at the start of the iteration
                    key = pair_key[r, r + 1]
                    end = finish + noisy(p2p_ms * MS)
                    record(r, finish, end, key, OpCode.SEND, 1 << 20, peer=r + 1)
                    record(r + 1, t, end + noisy(0.05 * MS), key, OpCode.RECV, 1 << 20, peer=r)
                    calls[key] += 1
                    ready = end
                    done[r] = end
                else:
                    done[r] = finish
        ends = []
        for s in range(pp):
            members = [d * pp + s for d in range(dp)]
            arrive = {r: done[r] + noisy(compute_ms * MS) * slow_rank.get(r, 1.0) for r in members}
            end = max(arrive.values()) + noisy(dp_ms * MS) * slow_dp_stage.get(s, 1.0)
            for r in members:
                record(
                    r, arrive[r], end + abs(noisy(0.05 * MS)), dp_key[s], OpCode.ALLREDUCE, 64 << 20
                )
            calls[dp_key[s]] += 1
            ends.append(end)
        t = max(ends) + 1 * MS
    out = []
    for r in range(world):
        window = (anchors[r][0], anchors[r][-1])
        out += summarize(
            events[r], groups, window=window, rank=r, host=host[r], iteration_ends_ns=anchors[r]
        )
    return out


def test_summaries_are_small_plain_json() -> None:
    summaries = simulate(iterations=40)
    # rank 1: recv from 0, send to 2, DP all-reduce -> three kinds
    mine = [s for s in summaries if s.rank == 1]
    assert sorted(s.op for s in mine) == ["allreduce", "p2p", "p2p"]
    for s in mine:
        assert len(s.call_index) == 32 and s.calls == 39  # bounded, newest calls
        assert GroupSummary.from_json(s.to_json()) == s
        assert s.iterations == 39 and s.iteration_s > 0
    with pytest.raises(ValueError, match="unknown field"):
        GroupSummary.from_dict({**mine[0].to_dict(), "bogus": 1})


def test_slow_dp_group_is_degraded_communication() -> None:
    profiles = group_profiles(simulate(slow_dp_stage={2: 2.0}))
    suspects = degraded_groups(profiles)
    assert len(suspects) == 1, suspects
    (s,) = suspects
    assert s.kind == "communication"
    assert s.ranks == (2, 6)
    assert s.slowdown == pytest.approx(2.0, rel=0.05)  # against the median of 1, 1, 1, 2 x 8 ms
    assert s.evidence["cluster"]["groups"] == 4
    assert late_ranks(profiles) == []
    json.dumps([x.to_dict() for x in suspects])


def test_validation_tests_the_links_a_degraded_group_uses_in_its_order() -> None:
    """A DP group created over its ranks in descending order is profiled in that order, and
    the validation round tests its ring and tree hops in that order, not over sorted ranks."""
    profiles = group_profiles(simulate(dp=4, pp=2, slow_dp_stage={1: 2.0}, dp_order=-1))
    (s,) = degraded_groups(profiles)
    assert s.ranks == (7, 5, 3, 1)
    groups = link_groups([s, *late_ranks(profiles)], world_size=8)
    assert groups == [(7, 5, 3, 1)]
    tested = {link for one in communicator_passes(groups) for link in one}
    ring = {(7, 5), (5, 3), (3, 1), (1, 7)}
    tree = {(5, 3), (3, 7), (1, 3)}  # NCCL's tree 0 (1->2, 2->0, 3->2) over the group order
    assert tested == ring | tree
    assert not tested & {(3, 5), (5, 7), (7, 1)}  # hops of the sorted ring it never uses
    assert link_groups([], world_size=3) == [(0, 1, 2)]


def test_slow_compute_rank_is_late_not_degraded() -> None:
    profiles = group_profiles(simulate(slow_rank={5: 1.5}))
    assert degraded_groups(profiles) == []
    # falcon 4.3: the DP group of rank 5 takes long because rank 1 waits - it is healthy
    dp15 = next(p for p in profiles if p.op == "allreduce" and p.ranks == (1, 5))
    dp00 = next(p for p in profiles if p.op == "allreduce" and p.ranks == (0, 4))
    assert dp15.duration_s > 1.4 * dp00.duration_s
    assert dp15.transfer_s == pytest.approx(dp00.transfer_s, rel=0.05)
    assert dp15.wait_fraction > 0.4
    suspects = late_ranks(profiles)
    # ranks 6 and 7 arrive late too (their input came late) but they waited for it
    assert [s.ranks for s in suspects] == [(5,)], [s.evidence for s in suspects]
    (s,) = suspects
    assert s.kind == "compute"
    assert s.evidence["lateness_s"] == pytest.approx(0.020, rel=0.1)  # 0.5 x (20 + 20) ms


def test_healthy_job_has_no_suspects() -> None:
    profiles = group_profiles(simulate(jitter=0.03, seed=3))
    assert degraded_groups(profiles) == []
    assert late_ranks(profiles) == []


@pytest.mark.parametrize("seed", range(5))
def test_noise_does_not_hide_or_invent_suspects(seed: int) -> None:
    profiles = group_profiles(simulate(jitter=0.03, seed=seed))
    assert degraded_groups(profiles) == []
    assert late_ranks(profiles) == []
    profiles = group_profiles(simulate(jitter=0.03, seed=seed, slow_dp_stage={1: 1.5}))
    assert [s.ranks for s in degraded_groups(profiles)] == [(1, 5)]
    profiles = group_profiles(simulate(jitter=0.03, seed=seed, slow_rank={2: 1.3}))
    assert degraded_groups(profiles) == []
    assert [s.ranks for s in late_ranks(profiles)] == [(2,)]


def test_clusters_keep_p2p_and_allreduce_apart() -> None:
    # PP transfers are much faster than DP all-reduces; neither is compared with the other
    profiles = group_profiles(simulate(p2p_ms=0.5, dp_ms=20.0, jitter=0.02))
    clusters = comparable_clusters(profiles)
    assert sorted((k[0], k[2], len(v)) for k, v in clusters.items()) == [
        ("allreduce", 2, 4),
        ("p2p", 2, 6),
    ]
    assert degraded_groups(profiles) == []
    # a slow link in the PP cluster is found against PP peers only
    summaries = simulate(p2p_ms=0.5, dp_ms=20.0, jitter=0.02)
    for s in summaries:
        if s.link == (5, 6):
            s.duration_ns = [d + 2 * MS for d in s.duration_ns]
    suspects = degraded_groups(group_profiles(summaries))
    assert [(s.kind, s.links) for s in suspects] == [("communication", ((5, 6),))]


def test_duration_clock_needs_no_synchronized_hosts() -> None:
    # every rank on its own host: only durations are compared, the result is the same
    summaries = simulate(slow_rank={5: 1.5}, ranks_per_host=1)
    profiles = group_profiles(summaries)
    assert {p.clock for p in profiles} == {"duration"}
    assert [s.ranks for s in late_ranks(profiles)] == [(5,)]
    summaries = simulate(slow_dp_stage={0: 1.6}, ranks_per_host=1)
    assert [s.ranks for s in degraded_groups(group_profiles(summaries))] == [(0, 4)]


def test_ten_thousand_ranks() -> None:
    """1000-way DP x 10 PP stages from summaries (no timing assert; it runs in well under 1 s)."""
    dp, pp, calls = 1000, 10, 8
    rng = np.random.default_rng(0)
    summaries = []
    for s in range(pp):
        key = group_key(f"dp{s}", [])
        slow = 1.5 if s == 7 else 1.0
        for d in range(dp):
            r = d * pp + s
            late = 30 * MS if r == 4321 else 0
            arrive = 100 * MS * np.arange(calls) + rng.integers(0, MS // 10, calls) + late
            end = 100 * MS * np.arange(calls) + 30 * MS + int(40 * MS * slow)
            summaries.append(
                GroupSummary(
                    rank=r,
                    group_key=key,
                    op="allreduce",
                    nbytes=1 << 26,
                    group_size=dp,
                    member=d,
                    host=f"n{r // 8}",
                    calls=calls,
                    window_s=0.8,
                    iteration_s=0.1,
                    call_index=list(range(calls)),
                    start_ns=arrive.tolist(),
                    duration_ns=(end - arrive).tolist(),
                )
            )
    for d in range(dp):
        for s in range(pp - 1):
            a = d * pp + s
            for r, peer in ((a, a + 1), (a + 1, a)):
                summaries.append(
                    GroupSummary(
                        rank=r,
                        group_key=group_key(f"pp{a}", []),
                        op="p2p",
                        nbytes=1 << 20,
                        group_size=2,
                        peer=peer,
                        host=f"n{r // 8}",
                        calls=calls,
                        window_s=0.8,
                        iteration_s=0.1,
                        call_index=list(range(calls)),
                        start_ns=(100 * MS * np.arange(calls) + 5 * MS).tolist(),
                        duration_ns=[2 * MS] * calls,
                    )
                )
    profiles = group_profiles(summaries)
    assert len(profiles) == pp + dp * (pp - 1)
    assert [s.ranks[:2] for s in degraded_groups(profiles)] == [(7, 17)]
    assert [s.ranks for s in late_ranks(profiles)] == [(4321,)]
