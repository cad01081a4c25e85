"""Stack aggregation (byterobust 5.1): failslow.core.diagnosis.stacks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.stacks import (
    CHILD,
    RANK,
    Aggregation,
    DeclineTally,
    Frame,
    ProcessStack,
    aggregate,
    frames_from_py_spy,
    group_of,
    round_flag,
    shared_group,
    signature,
)
from failslow.core.topology import Topology


def _frames(*names: str, line: int = 1) -> tuple[Frame, ...]:
    return tuple(Frame(n, f"{n.split('_')[0]}.py", line) for n in names)


OPTIMIZER = _frames("allreduce_grads", "step", "train", "main")


def test_the_paper_s_backward_hang_names_the_stalled_pipeline() -> None:
    """Fig. 7: TP=2, PP=4, DP=4, a machine per TP pair. Pipeline 3's last stage stalls in an
    all-gather; its middle stage waits in isend, its first stages in irecv; every other
    machine went on to the optimizer's gradient reduction. Healthy data loader workers beside
    every rank, on all machines alike."""
    topo = Topology.megatron(tp=2, dp=4, pp=4, gpus_per_host=2, micro_batches=8)
    stacks = []
    for rank, (_, d, p) in enumerate(topo.coords):
        frames = OPTIMIZER
        if d == 3:
            inner = {3: "all_gather_into_tensor", 2: "isend"}.get(p, "irecv")
            frames = _frames(inner, "backward_step", "train", "main", line=rank)  # lines differ
        stacks.append(ProcessStack(rank, 1000 + rank, RANK, frames))
        stacks.append(ProcessStack(rank, 5000 + rank, CHILD, _frames("wait", "worker_loop")))
    found = aggregate(stacks, topo)
    pipeline = sorted(r for r, (_, d, _) in enumerate(topo.coords) if d == 3)
    assert found.outliers == tuple(pipeline)
    assert found.suspects is not None and found.suspects.kind == "pp"
    assert found.suspects.groups == (tuple(topo.pp_group(0, 3)), tuple(topo.pp_group(1, 3)))
    assert found.suspects.hosts == tuple(sorted({topo.hosts[r] for r in pipeline}))
    healthy = [g for g in found.groups if g.healthy]
    assert [(g.kind, len(g.ranks)) for g in healthy] == [(RANK, 24), (CHILD, 32)]
    outliers = [g for g in found.groups if g.healthy is False]
    assert sorted(len(g.ranks) for g in outliers) == [2, 2, 4]  # irecv x2 stages, isend, gather


def test_a_stuck_data_loader_worker_names_its_rank_s_machine() -> None:
    topo = Topology.megatron(tp=2, dp=2, pp=1, gpus_per_host=2, micro_batches=2)
    stacks = [ProcessStack(r, r, RANK, _frames("next_batch", "train")) for r in range(4)]
    stacks += [ProcessStack(r, 100 + r, CHILD, _frames("wait", "worker_loop")) for r in range(4)]
    stacks[4 + 3] = ProcessStack(3, 103, CHILD, _frames("read", "open_shard", "worker_loop"))
    found = aggregate(stacks, topo)
    assert found.outliers == (3,)
    assert found.suspects is not None  # PP 1: no pipelines; its TP group is its machine
    assert found.suspects.kind == "tp" and found.suspects.ranks == (2, 3)
    assert found.suspects.hosts == ("node00001",)


def test_a_tie_for_the_largest_group_evicts_nothing_and_no_topology_names_ranks() -> None:
    stacks = [ProcessStack(r, r, RANK, _frames("a" if r < 2 else "b")) for r in range(4)]
    found = aggregate(stacks)
    assert found.undecided == (RANK,) and found.suspects is None and not found.outliers
    assert {g.healthy for g in found.groups} == {None}
    stacks[3] = ProcessStack(3, 3, RANK, _frames("a"))
    found = aggregate(stacks)
    assert found.outliers == (2,)
    assert found.suspects is not None and found.suspects.kind == "ranks"
    unreadable = [*stacks, ProcessStack(4, 44, RANK, (), error="py-spy: permission denied")]
    assert aggregate(unreadable).unreadable == ((4, 44, "py-spy: permission denied"),)


def test_signatures_ignore_lines_and_native_addresses() -> None:
    a = (Frame("recv", "pair.cc", 10), Frame("0x7f00aa", "libc.so.6"), Frame("step", "x.py", 3))
    b = (Frame("recv", "pair.cc", 99), Frame("0x7f00bb", "libc.so.6"), Frame("step", "x.py", 4))
    assert signature(a) == signature(b) == "recv (pair.cc) <- step (x.py)"
    assert signature(a) != signature((Frame("send", "pair.cc"), Frame("step", "x.py")))


def test_py_spy_json_gives_the_main_thread_innermost_first() -> None:
    threads = [
        {"os_thread_id": 8, "frames": [{"name": "run", "short_filename": "threading.py"}]},
        {"os_thread_id": 7, "frames": [
            {"name": "wait", "short_filename": "store.py", "line": 5},
            {"name": "<module>", "filename": "/x/train.py", "line": 9},
        ]},
    ]  # fmt: skip
    assert frames_from_py_spy(threads, pid=7) == (
        Frame("wait", "store.py", 5), Frame("<module>", "/x/train.py", 9)
    )  # fmt: skip
    assert frames_from_py_spy(threads, pid=99) == (Frame("run", "threading.py", 0),)
    assert frames_from_py_spy([], pid=7) == ()


def test_an_mfu_decline_s_degrader_is_the_group_flagged_most_over_five_rounds() -> None:
    topo = Topology.megatron(tp=1, dp=4, pp=2, gpus_per_host=1, micro_batches=4)
    slow_pipeline = topo.pp_group(0, 2)
    tally = DeclineTally(rounds=5)
    rounds = [slow_pipeline, [1], slow_pipeline, [], slow_pipeline]  # noise in two rounds
    for outliers in rounds:
        stacks = [
            ProcessStack(r, r, RANK, _frames("gemm" if r in outliers else "wait")) for r in range(8)
        ]
        assert tally.degrader() is None
        tally.add([aggregate(stacks, topo)], topo)
    assert tally.done and tally.degrader() == ("pp", tuple(slow_pipeline))
    noise = DeclineTally(rounds=5)  # the most flagged group, but in 2 rounds of 5: nobody
    for outliers in [slow_pipeline, [1], slow_pipeline, [], [3]]:
        stacks = [
            ProcessStack(r, r, RANK, _frames("gemm" if r in outliers else "wait")) for r in range(8)
        ]
        noise.add([aggregate(stacks, topo)], topo)
    assert noise.done and noise.flags[("pp", tuple(slow_pipeline))] == 2
    assert noise.degrader() is None


def test_a_round_of_samples_flags_the_group_outlying_in_most_of_them() -> None:
    """A slow rank caught computing in one sample of three, waiting (an outlier) in the
    others; a healthy rank outlying in one sample only: the round flags the slow one. Two
    groups outlying equally often flag nobody; so do samples with nothing outlying."""
    topo = Topology.megatron(tp=1, dp=4, pp=1, gpus_per_host=1, micro_batches=4)

    def sample(*outliers: int, topology: Topology | None = topo) -> Aggregation:
        stacks = [
            ProcessStack(r, r, RANK, _frames("load" if r in outliers else "wait")) for r in range(4)
        ]
        return aggregate(stacks, topology)

    assert round_flag([sample(2), sample(), sample(2), sample(1)], topo) == ("host", (2,))
    assert round_flag([sample(2), sample(1)], topo) == ("none", ())  # a tie
    assert round_flag([sample(), sample()], topo) == ("none", ())
    unknown = [sample(2, topology=None), sample(2, topology=None)]
    assert round_flag(unknown, None) == ("ranks", (2,))  # no topology known
    tally = DeclineTally(rounds=2)
    assert tally.add([sample(2), sample(1)], topo) == ("none", ())
    assert tally.add([sample(3)], topo) == ("host", (3,))
    assert tally.seen == 2 and tally.flags == {("host", (3,)): 1}
    assert tally.degrader() is None  # 1 of 2 rounds is not more than half


@settings(max_examples=150, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    dp=st.integers(1, 8),
    pp=st.sampled_from([1, 2, 4]),
    per_host=st.sampled_from([1, 2, 8]),
    kind=st.sampled_from(["pp", "dp", "tp", "host"]),
    anchor=st.integers(0, 255),
    subset=st.integers(1, 255),
)
def test_outliers_inside_one_group_cost_no_more_machines_than_it_spans(
    tp, dp, pp, per_host, kind, anchor, subset
) -> None:
    topo = Topology.megatron(tp=tp, dp=dp, pp=pp, gpus_per_host=per_host, micro_batches=dp)
    group = group_of(topo, kind, anchor % topo.world_size)
    outliers = [r for i, r in enumerate(group) if subset >> (i % 8) & 1] or [group[0]]
    found = shared_group(outliers, topo)
    assert set(outliers) <= set(found.ranks)
    machines = {topo.hosts[r] for r in group}
    if len(group) > 1 or kind == "host":  # a dimension of size 1 is skipped for the machine
        assert len(found.hosts) <= len(machines)  # never more machines than the group spans
    assert set(found.hosts) == {topo.hosts[r] for r in found.ranks}


def test_aggregation_is_one_json_document() -> None:
    import json

    topo = Topology.megatron(tp=1, dp=2, pp=1, gpus_per_host=1, micro_batches=2)
    stacks = [ProcessStack(r, r, RANK, _frames("a")) for r in range(3)]
    found = aggregate(stacks, None)
    assert isinstance(found, Aggregation) and json.loads(json.dumps(found.to_dict()))
    with pytest.raises(ValueError, match="unknown group kind"):
        group_of(topo, "ep", 0)


@given(
    st.lists(
        st.tuples(st.sampled_from(["f", "g", "<lambda>"]), st.text(max_size=8), st.integers(0, 9)),
        max_size=5,
    ),
    st.sampled_from([RANK, CHILD]),
    st.text(max_size=10),
)
@settings(max_examples=50, deadline=None)
def test_a_stack_sent_to_another_node_aggregates_as_the_same_stack(
    frames: list[tuple[str, str, int]], kind: str, error: str
) -> None:
    import json

    stack = ProcessStack(3, 4321, kind, tuple(Frame(*f) for f in frames), error)
    back = ProcessStack.from_dict(json.loads(json.dumps(stack.to_dict())))
    assert back == stack and signature(back.frames) == signature(stack.frames)
