"""Invariant 1 (DESIGN.md): capture sees every collective of a training step, with the right
group and byte count (greyhound 4.2, the Monitor).

The oracle is the harness's :meth:`~failslow.conformance.harness.AdapterJob.expected_collectives`,
computed from the model and the layout (for example: the ZeRO-0 gradient all-reduce carries
exactly the parameter bytes of the rank's stage), compared as a multiset with what the rank's
event ring holds for the step's CLOCK_MONOTONIC window - nothing missing, nothing unexplained.
"""

from __future__ import annotations

import collections
from typing import Any

from failslow.conformance.fixtures import ConformanceFixtures, describe
from failslow.conformance.harness import Collective
from failslow.conformance.world import LayoutRun, RankRun
from failslow.core.events import CommEvent, Flags, OpCode

_ROOTED_OR_P2P = {"SEND", "RECV", "GATHER", "SCATTER"}


def op_name(event: CommEvent) -> str:
    return getattr(event.op, "name", str(int(event.op)))


def captured_key(rank_run: RankRun, event: CommEvent) -> tuple[Any, ...]:
    info = rank_run.groups.get(event.group_key)
    group: tuple[Any, ...] = (
        tuple(sorted(info.ranks)) if info else ("unknown group", event.group_key)
    )
    return (op_name(event), group, int(event.nbytes), int(event.peer))


def captured(rank_run: RankRun, run: str, step: int) -> collections.Counter[tuple[Any, ...]]:
    return collections.Counter(captured_key(rank_run, e) for e in rank_run.window(run, step))


def expected(rank_run: RankRun, step: int) -> collections.Counter[tuple[Any, ...]] | None:
    items = rank_run.run("reference")["expected"][step]
    if items is None:
        return None
    return collections.Counter(
        Collective(i["op"], tuple(i["group"]), i["nbytes"], i["peer"]).key() for i in items
    )


class AbstractCaptureTests(ConformanceFixtures):
    def test_capture_sees_every_collective_of_a_step(self, layout_run: LayoutRun) -> None:
        for rank_run in layout_run.ranks:
            steps = len(rank_run.run("reference")["windows"])
            modeled = 0
            total_bytes = 0
            for step in range(steps):
                want = expected(rank_run, step)
                if want is None:
                    continue
                modeled += 1
                total_bytes += sum(key[2] * n for key, n in want.items())
                got = captured(rank_run, "reference", step)
                assert got == want, (
                    f"layout {layout_run.layout!r}, rank {rank_run.rank}, step {step}: the "
                    f"capture differs from the harness's expected collectives\n"
                    f"  missing (op, group, nbytes, peer):\n{describe((want - got).elements())}\n"
                    f"  unexpected:\n{describe((got - want).elements())}"
                )
            assert modeled * 2 >= steps, (
                f"rank {rank_run.rank}: the harness models only {modeled} of {steps} steps"
            )
            assert total_bytes > 0, f"rank {rank_run.rank}: the harness expects no payload"

    def test_capture_names_the_same_group_on_every_member(self, layout_run: LayoutRun) -> None:
        """Each captured group is known on every member with the same ranks, and every member
        issued the same sequence of symmetric collectives on it (same op, same bytes)."""
        by_rank = {r.rank: r for r in layout_run.ranks}
        sequences: dict[int, dict[int, list[tuple[str, int]]]] = {}
        for rank_run in layout_run.ranks:
            for step in range(len(rank_run.run("reference")["windows"])):
                for event in rank_run.window("reference", step):
                    info = rank_run.groups.get(event.group_key)
                    assert info is not None, (
                        f"rank {rank_run.rank}: group key {event.group_key:#x} of a "
                        f"{op_name(event)} is not in the ring's group table"
                    )
                    assert rank_run.rank in info.ranks, (
                        f"rank {rank_run.rank} recorded a call on group {list(info.ranks)}"
                    )
                    if op_name(event) not in _ROOTED_OR_P2P:
                        seq = sequences.setdefault(event.group_key, {})
                        seq.setdefault(rank_run.rank, []).append(
                            (op_name(event), int(event.nbytes))
                        )
        assert sequences or any(
            e.op in (OpCode.SEND, OpCode.RECV) for r in layout_run.ranks for e in r.events
        ), "no collective captured at all"
        for key, per_rank in sequences.items():
            members = by_rank[next(iter(per_rank))].groups[key].ranks
            for member in members:
                assert member in by_rank, f"group {list(members)} names rank {member}"
                info = by_rank[member].groups.get(key)
                assert info is not None and tuple(info.ranks) == tuple(members), (
                    f"group key {key:#x}: rank {member} knows it as "
                    f"{None if info is None else list(info.ranks)}, others as {list(members)}"
                )
                assert per_rank.get(member) == per_rank[next(iter(per_rank))], (
                    f"group {list(members)}: members issued different collectives:\n"
                    + describe(f"rank {r}: {s}" for r, s in sorted(per_rank.items()))
                )

    def test_capture_records_are_complete(self, layout_run: LayoutRun) -> None:
        for rank_run in layout_run.ranks:
            assert rank_run.result["ring_dropped"] == 0, f"rank {rank_run.rank} dropped records"
            for step in range(len(rank_run.run("reference")["windows"])):
                for event in rank_run.window("reference", step):
                    assert not event.flags & Flags.FAILED, f"rank {rank_run.rank}: {event}"
                    assert event.t_end_ns >= event.t_start_ns, f"rank {rank_run.rank}: {event}"

    def test_capture_marks_the_end_of_every_optimizer_step(self, layout_run: LayoutRun) -> None:
        """Each step has a step marker from every optimizer the framework stepped, once each,
        the same optimizers in every step (the iteration tracker measures between them). The
        process's first optimizer step may be unmarked: when the framework's own ``step``
        wraps the optimizer's, the marker moves to its end from the next step on."""
        for rank_run in layout_run.ranks:
            per_step = []
            for t0, t1 in rank_run.run("reference")["windows"]:
                keys = [m.group_key for m in rank_run.markers if t0 <= m.t_start_ns <= t1]
                per_step.append(collections.Counter(keys))
            later = per_step[1:]
            assert later and all(later), (
                f"rank {rank_run.rank}: steps without a step marker: "
                f"{[i for i, c in enumerate(per_step) if not c and i]}"
            )
            assert all(c == later[0] and set(c.values()) == {1} for c in later), (
                f"rank {rank_run.rank}: step markers per step differ: {per_step}"
            )
            assert per_step[0] in (later[0], collections.Counter()), per_step
