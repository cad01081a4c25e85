"""Unit tests of failslow.adapters.common.data: exact shares of every global batch (no
processes)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import TensorDataset

from failslow.adapters.common.data import ShareSampler, share_loader
from failslow.errors import ConfigError, FailslowError

N, MBS, M, D = 50, 2, 8, 4  # global batch 16: 3 steps per epoch, 2 samples left over


def samplers(**kw):
    return [
        ShareSampler(N, micro_batch_size=MBS, micro_batches=M, replica=r, replicas=D, **kw)
        for r in range(D)
    ]


def take_step(sampler: ShareSampler) -> list[list[int]]:
    """The micro-batches this replica reads in its current step (the adapter's view)."""
    count = sampler.counts_at(sampler.next_step)[sampler.replica]
    it = iter(sampler)
    return [next(it) for _ in range(count)]


def step_union(ss: list[ShareSampler]) -> list[int]:
    return [i for s in ss for mb in take_step(s) for i in mb]


@pytest.mark.parametrize("counts", [None, (2, 2, 2, 2), (1, 3, 2, 2), (5, 1, 1, 1), (0, 0, 8, 0)])
def test_union_of_shares_is_the_global_batch(counts):
    ss = samplers(counts=counts)
    for step in range(3):
        expected = [i for mb in ss[0].global_batch_indices(step) for i in mb]
        assert len(expected) == M * MBS == len(set(expected))
        assert step_union(ss) == expected  # same samples, same order: nothing dropped or repeated
        assert all(len(mb) == MBS for mb in ss[0].global_batch_indices(step))


def test_even_default_matches_explicit_even_counts():
    a, b = samplers(), samplers(counts=(2, 2, 2, 2))
    assert [take_step(s) for s in a] == [take_step(s) for s in b]


def test_counts_change_at_a_step_boundary():
    even, planned = samplers(seed=3), samplers(seed=3)
    for s in planned:
        s.set_counts((1, 3, 2, 2), step=2)
    for step in range(6):
        assert sorted(step_union(planned)) == sorted(step_union(even)), step
    assert [s.counts_at(1) for s in planned] == [(2, 2, 2, 2)] * D
    assert [s.counts_at(5) for s in planned] == [(1, 3, 2, 2)] * D


def test_set_counts_without_step_applies_at_the_next_boundary():
    s = samplers()[1]
    it = iter(s)
    next(it)  # inside step 0
    s.set_counts((1, 3, 2, 2))
    assert s.counts_at(0) == (2, 2, 2, 2) and s.counts_at(1) == (1, 3, 2, 2)


def test_plan_for_a_step_already_read_raises():
    s = samplers()[0]
    it = iter(s)
    next(it)
    with pytest.raises(FailslowError, match="already read up to step 0"):
        s.set_counts((1, 3, 2, 2), step=0)


def test_epoch_rollover_drops_the_tail_and_reshuffles():
    ss = samplers(seed=7, counts=(1, 3, 2, 2))
    per_epoch = N // (M * MBS)
    epochs = []
    for _ in range(2):
        seen = []
        for _ in range(per_epoch):
            seen += step_union(ss)
        epochs.append(seen)
    for seen in epochs:
        assert len(seen) == len(set(seen)) == per_epoch * M * MBS  # the tail of 2 is skipped
    assert epochs[0] != epochs[1]
    g = torch.Generator().manual_seed(7 + 1)
    assert epochs[1] == torch.randperm(N, generator=g)[: per_epoch * M * MBS].tolist()


def test_for_loop_is_one_epoch_then_the_next():
    s = samplers(shuffle=False)[2]
    first = list(s)
    second = list(s)
    assert len(first) == len(second) == len(s) == 3 * 2
    assert first[0] == [8, 9] and second[0] == [8, 9]  # shuffle=False: same order every epoch
    assert s.step == 6


def test_state_dict_roundtrip():
    a = samplers(seed=1)[3]
    a.set_counts((1, 3, 2, 2), step=1)
    it = iter(a)
    for _ in range(3):
        next(it)
    b = samplers(seed=1)[3]
    b.load_state_dict(a.state_dict())
    assert list(itertools.islice(iter(a), 5)) == list(itertools.islice(iter(b), 5))


@pytest.mark.parametrize(
    ("counts", "match"),
    [
        ((2, 2, 4), "expected one count per DP replica \\(4\\), got 3"),
        ((2, 2, 2, 3), "must sum to the 8 micro-batches of a global batch, got 9"),
        ((3, -1, 3, 3), "every count must be an integer >= 0"),
        ((2.0, 2, 2, 2), "every count must be an integer >= 0"),
    ],
)
def test_bad_counts_are_one_line_config_errors(counts, match):
    with pytest.raises(ConfigError, match=match) as info:
        samplers()[0].set_counts(counts)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=match):
        samplers(counts=counts)


def test_bad_geometry():
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        ShareSampler(10, micro_batch_size=2, micro_batches=8, replica=0, replicas=4)
    with pytest.raises(ConfigError, match="replica must be in"):
        ShareSampler(50, micro_batch_size=2, micro_batches=8, replica=4, replicas=4)
    with pytest.raises(ConfigError, match="do not split evenly"):
        ShareSampler(50, micro_batch_size=2, micro_batches=6, replica=0, replicas=4)


def test_share_loader_yields_tensors_of_the_share():
    data = TensorDataset(torch.arange(N, dtype=torch.float32))
    loaders = [
        share_loader(data, micro_batch_size=MBS, micro_batches=M, replica=r, replicas=D, seed=5)
        for r in range(D)
    ]
    for loader in loaders:
        loader.batch_sampler.set_counts((3, 1, 1, 3), step=0)
    got = []
    for loader in loaders:
        got += [int(v) for (batch,) in loader for v in batch]
    assert len(got) == len(set(got)) == 3 * M * MBS


@pytest.mark.parametrize("counts", [None, (1, 3), (3, 1)])
def test_parts_of_a_replica_split_its_micro_batches(counts):
    """HSDP: 2 replicas x 2 shard ranks; each shard rank reads its own half of every
    micro-batch of its replica, and together they read the global batch once, in order."""
    kw = dict(micro_batch_size=MBS, micro_batches=4, replicas=2, parts=2, counts=counts, seed=1)
    ranks = [
        ShareSampler(N, replica=r, part=p, **kw)  # type: ignore[arg-type]
        for r in range(2)
        for p in range(2)
    ]
    whole = ShareSampler(N, micro_batch_size=2 * MBS, micro_batches=4, replica=0, replicas=2,
                         seed=1)  # fmt: skip
    for step in range(2):
        expected = [i for mb in whole.global_batch_indices(step) for i in mb]
        got = {}
        for s in ranks:
            got[(s.replica, s.part)] = take_step(s)
            assert all(len(mb) == MBS for mb in got[(s.replica, s.part)])
        union = [
            i
            for r in range(2)
            for k in range(len(got[(r, 0)]))
            for p in range(2)
            for i in got[(r, p)][k]
        ]
        assert union == expected
    with pytest.raises(ConfigError, match="part must be in"):
        ShareSampler(N, replica=0, part=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("counts", [(2, 2, 2, 2), (1, 3, 2, 2), (5, 1, 1, 1), (3, 3, 1, 1)])
def test_by_size_every_replica_runs_g_micro_batches_of_its_count_form_samples(counts):
    """The size form (issue 46): the same samples as the count form's share, in G = M / D
    micro-batches as even as they go; reads counted in samples."""
    sized, counted = samplers(counts=counts, by_size=True), samplers(counts=counts)
    for step in range(3):
        for s, c in zip(sized, counted, strict=True):
            mine = [next(iter(s)) for _ in range(M // D)]
            want = [i for mb in take_step(c) for i in mb]
            assert [i for mb in mine for i in mb] == want, (step, s.replica)
            n = counts[s.replica] * MBS
            assert [len(mb) for mb in mine] == [n // 2 + (j < n % 2) for j in range(2)]
            assert s.read_in(step) == n


def test_by_size_under_the_even_split_is_the_count_form():
    a, b = samplers(seed=5, by_size=True), samplers(seed=5)
    assert [take_step(s) for s in a] == [take_step(s) for s in b]
    assert len(a[0]) == len(b[0]) == 3 * M // D


def test_by_size_needs_whole_micro_batches_and_an_even_accumulation():
    with pytest.raises(ConfigError, match="by_size needs one rank's part per micro-batch"):
        ShareSampler(N, micro_batch_size=2, micro_batches=8, replica=0, replicas=4, parts=2,
                     by_size=True)  # fmt: skip
