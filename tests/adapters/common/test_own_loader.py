"""S2 over the loop's own DataLoader iterator (adapters/common/own_loader.py): D replicas' real
torch DataLoaders in one process, each replica's iterator taken over as an adapter does at its
first training step, then read the way the loop reads them (``counts[r]`` micro-batches per
step, a new iterator at each epoch's end). The reference is the same loaders without failslow
under the even split: every step must read exactly its samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.adapters.common.own_loader import recut_of, take_over
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import FailslowError

D, G, B = 4, 3, 4  # replicas, micro-batches per replica and step, samples per micro-batch


class _Indices(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _PretrainingSampler:
    """A Megatron-LM style batch sampler, written for this test with the attributes Megatron-LM's
    ``MegatronPretrainingSampler`` has (``data_parallel_rank``, ``micro_batch_size``,
    ``micro_batch_times_data_parallel_size``; no data-parallel size of its own): consecutive
    global micro-batches from ``consumed_samples`` on, this replica's slice of each."""

    def __init__(self, total: int, consumed: int, mbs: int, dp_rank: int, dp_size: int) -> None:
        self.total_samples, self.consumed_samples = total, consumed
        self.micro_batch_size, self.data_parallel_rank = mbs, dp_rank
        self.micro_batch_times_data_parallel_size = mbs * dp_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):  # type: ignore[no-untyped-def]
        width = self.micro_batch_times_data_parallel_size
        lo = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - width + 1, width):
            yield list(range(start + lo, start + lo + self.micro_batch_size))


def _distributed(n: int, **kwargs: Any) -> Callable[[int], DataLoader]:  # type: ignore[type-arg]
    def build(r: int) -> DataLoader:  # type: ignore[type-arg]
        sampler = DistributedSampler(_Indices(n), num_replicas=D, rank=r, shuffle=True, seed=3)
        return DataLoader(_Indices(n), batch_size=B, sampler=sampler, **kwargs)

    return build


def _pretraining(n: int) -> Callable[[int], DataLoader]:  # type: ignore[type-arg]
    def build(r: int) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(_Indices(n), batch_sampler=_PretrainingSampler(n, 8, B, r, D))

    return build


class _Loop:
    """Each replica's loop: ``next(iterator)`` per micro-batch; at an epoch's end, the next
    epoch (``set_epoch`` where the sampler has it) and a new iterator."""

    def __init__(self, build: Callable[[int], DataLoader]) -> None:  # type: ignore[type-arg]
        self.loaders = [build(r) for r in range(D)]
        self.epochs = [0] * D
        self.iterators = [iter(loader) for loader in self.loaders]

    def next(self, r: int) -> list[int]:
        while True:
            try:
                return [int(x) for x in next(self.iterators[r])]
            except StopIteration:
                self.epochs[r] += 1
                sampler = getattr(self.loaders[r].batch_sampler, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.epochs[r])
                self.iterators[r] = iter(self.loaders[r])


def _reference(build: Callable[[int], DataLoader], steps: int) -> list[list[list[int]]]:  # type: ignore[type-arg]
    """Each step's batches in the replica-major order of the even split."""
    loop = _Loop(build)
    return [[loop.next(r) for r in range(D) for _ in range(G)] for _ in range(steps)]


def _plan(*counts: int) -> MicroBatchPlan:
    return MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))


def _run(build, steps, plans, *, take_at=0, check_order=True):  # type: ignore[no-untyped-def]
    """Run ``steps`` with ``plans`` ({apply step: plan}), the iterators taken over at step
    ``take_at``; returns each step's batches per replica."""
    loop = _Loop(build)
    splits = [ReplicaSplit(replica=r, replicas=D, micro_batches=G * D) for r in range(D)]
    for split in splits:
        split.bind(lambda step: [(s, p) for s, p in plans.items() if s <= step])
    ran: list[list[list[list[int]]]] = []
    for step in range(steps):
        if step == take_at:
            for r, split in enumerate(splits):
                recut, why = take_over(loop.iterators[r], split, start_step=step)
                assert recut is not None, why
        per = []
        for r, split in enumerate(splits):
            if step in plans:
                split.apply(plans[step], step)
            per.append([loop.next(r) for _ in range(split.counts[r])])
        ran.append(per)
    return ran


@pytest.mark.parametrize("build", [_distributed(200), _pretraining(8 + 12 * 16 * 6)])
def test_without_a_plan_every_replica_reads_its_own_loaders_batches(build):
    reference = _reference(build, 14)
    ran = _run(build, 14, {}, take_at=2)
    for step, per in enumerate(ran):
        assert [b for r in range(D) for b in per[r]] == reference[step]


@pytest.mark.parametrize("workers", [0, 2])
def test_plans_move_whole_batches_and_every_step_reads_the_even_splits_samples(workers):
    """200 samples, 4 replicas of 4-sample batches: 13 batches per replica and epoch (the last
    of 2 samples), so steps of 3 cross every epoch's end; plans from step 2 and 7."""
    build = _distributed(200, num_workers=workers)
    steps = 16
    reference = _reference(_distributed(200), steps)
    plans = {2: _plan(3, 3, 1, 5), 7: _plan(4, 4, 2, 2)}
    ran = _run(build, steps, plans)
    counts = (3,) * D
    crossing = 0
    for step, per in enumerate(ran):
        counts = plans[step].counts if step in plans else counts
        assert [len(b) for b in per] == list(counts)
        got = [b for r in range(D) for b in per[r]]
        if got != reference[step]:  # a step across an epoch's end: its part in this epoch first
            crossing += 1
            assert sorted(got) == sorted(reference[step]), step
            for r in range(D):
                lo = sum(counts[:r])
                assert sorted(per[r]) == sorted(reference[step][lo : lo + counts[r]])
    assert crossing >= 2


def test_a_megatron_lm_sampler_is_re_cut_by_its_data_parallel_rank():
    build = _pretraining(8 + 12 * 16 * 5)
    reference = _reference(build, 5)
    ran = _run(build, 5, {1: _plan(1, 5, 4, 2)})
    for step, per in enumerate(ran):
        assert [b for r in range(D) for b in per[r]] == reference[step]
    assert [len(b) for b in ran[3]] == [1, 5, 4, 2]


def test_the_recut_counts_what_it_handed_out_and_survives_the_next_epoch():
    loop = _Loop(_distributed(200))
    split = ReplicaSplit(replica=1, replicas=D, micro_batches=G * D)
    recut, why = take_over(loop.iterators[1], split, start_step=0)
    assert recut is not None and not why
    split.apply(_plan(3, 5, 2, 2), 0)
    for _ in range(5):
        loop.next(1)
    assert recut.read_in(0) == 5 and split.samplers == [recut]
    for _ in range(40):  # into the next epochs: the new iterators are re-cut as well
        loop.next(1)
    assert recut_of(loop.iterators[1]) is recut and loop.epochs[1] >= 2
    assert not recut.broken


def test_what_cannot_be_re_cut_says_why_and_changes_nothing():
    split = ReplicaSplit(replica=0, replicas=D, micro_batches=G * D)
    recut, why = take_over(iter([[1, 2]]), split, start_step=0)
    assert recut is None and "not a DataLoader's iterator" in why
    plain = DataLoader(_Indices(64), batch_size=B, shuffle=True)
    recut, why = take_over(iter(plain), split, start_step=0)
    assert recut is None and "does not say which data-parallel replica" in why
    wrong = DistributedSampler(_Indices(64), num_replicas=2, rank=1)
    recut, why = take_over(iter(DataLoader(_Indices(64), sampler=wrong)), split, start_step=0)
    assert recut is None and "rank 1 of 2" in why and "replica 0 of 4" in why
    assert split.samplers == [] and type(plain.batch_sampler) is BatchSampler


def test_a_sampler_that_depends_on_more_than_its_rank_is_found_out_before_a_plan():
    """A copy of the sampler draws other batches than the loop's (unseeded shuffling): the
    loop still reads its own batches, and the recut says it cannot serve a plan."""
    dataset = _Indices(96)
    sampler = DistributedSampler(dataset, num_replicas=D, rank=0, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler)
    sampler.__class__ = type("Unseeded", (DistributedSampler,), {"__iter__": _unseeded})
    iterator = iter(loader)
    split = ReplicaSplit(replica=0, replicas=D, micro_batches=G * D)
    recut, _ = take_over(iterator, split, start_step=0)
    assert recut is not None
    seen = [next(iterator) for _ in range(G)]
    assert len(seen) == G and "depends on more than its rank" in recut.broken


def _unseeded(self):  # type: ignore[no-untyped-def]
    return iter(torch.randperm(len(self.dataset))[self.rank :: self.num_replicas].tolist())


def test_a_plan_for_a_step_the_workers_already_fetched_raises():
    loop = _Loop(_distributed(200, num_workers=2))
    split = ReplicaSplit(replica=0, replicas=D, micro_batches=G * D)
    recut, why = take_over(loop.iterators[0], split, start_step=0)
    assert recut is not None, why
    loop.next(0)  # the workers have fetched step 0 and into step 1
    with pytest.raises(FailslowError, match="already read up to step 1"):
        split.apply(_plan(1, 5, 3, 3), 1)


def test_a_loop_that_starts_its_iterator_over_goes_on_under_the_even_split_not_under_a_plan():
    """Under the even split a new iterator mid-epoch goes on with the step from the sampler's
    new stream (what the loop would read without failslow); under a plan the step's share
    cannot be finished exactly, and the recut says so instead of reading other data."""
    loop = _Loop(_distributed(200))
    split = ReplicaSplit(replica=0, replicas=D, micro_batches=G * D)
    recut, why = take_over(loop.iterators[0], split, start_step=0)
    assert recut is not None, why
    loop.next(0)
    loop.iterators[0] = iter(loop.loaders[0])  # started over, 1 batch into step 0
    fresh = [int(x) for x in next(iter(DataLoader(_Indices(200), batch_size=B,
                                                  sampler=loop.loaders[0].sampler)))]  # fmt: skip
    assert loop.next(0) == fresh and recut.read_in(0) == 2
    loop.next(0)
    split.apply(_plan(1, 5, 3, 3), 1)
    loop.next(0)  # replica 0's one batch of step 1: a step boundary
    loop.iterators[0] = iter(loop.loaders[0])  # step 2 reads the new stream from its start
    assert loop.next(0) == fresh and recut.read_in(2) == 1
    split.apply(_plan(2, 4, 3, 3), 3)
    loop.next(0)  # 1 of replica 0's 2 batches of step 3
    loop.iterators[0] = iter(loop.loaders[0])
    with pytest.raises(FailslowError, match="started its data iterator over in step 3"):
        loop.next(0)
