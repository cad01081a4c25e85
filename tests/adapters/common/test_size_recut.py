"""S2 by size over the loop's own DataLoader (adapters/common/own_loader.py, ``SizeRecut``):
D replicas' real torch DataLoaders over a ``DistributedSampler`` in one process, read the way
PyTorch Lightning's loop reads them - every replica runs ``G`` micro-batches per step, a step
every ``G`` batches of an epoch and one at the epoch's last batch, ``set_epoch`` and a new
iterator per epoch. The reference is the same loaders without failslow: every step must read
exactly its samples (the step's samples of all replicas, in the even split's replica-major
order), this replica its ``counts[r] * B`` of them in ``G`` micro-batches."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.adapters.common.own_loader import recut_by_size
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import FailslowError

D, G, B = 4, 3, 4  # replicas, micro-batches per replica and step, samples per micro-batch
N = 230  # 58 samples per replica (2 padded): 15 batches, the last of 2: steps of 3 per epoch
PLANS = {2: (4, 4, 1, 3), 6: (5, 5, 1, 1), 9: (3, 3, 3, 3)}


class _Indices(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _loader(r: int, **kwargs: Any) -> DataLoader:  # type: ignore[type-arg]
    sampler = DistributedSampler(_Indices(), num_replicas=D, rank=r, shuffle=True, seed=5)
    return DataLoader(_Indices(), batch_size=B, sampler=sampler, **kwargs)


def _plan(counts: tuple[int, ...]) -> MicroBatchPlan:
    return MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))


def _epochs(loaders: list[Any], epochs: int) -> list[list[list[list[int]]]]:
    """Each step's micro-batches per replica, as a Lightning-like loop reads them: per epoch,
    a new iterator on every replica, steps of ``G`` batches and the epoch's rest."""
    steps: list[list[list[list[int]]]] = []
    for epoch in range(epochs):
        iterators = []
        for loader in loaders:
            loader.batch_sampler.sampler.set_epoch(epoch)
            iterators.append(iter(loader))
        while True:
            step = [[[int(x) for x in b] for b in itertools.islice(it, G)] for it in iterators]
            if not any(step):
                break
            steps.append(step)
    return steps


def _recut(loaders: list[Any], plans: dict[int, tuple[int, ...]]) -> list[Any]:
    recuts = []
    for r, loader in enumerate(loaders):
        split = ReplicaSplit(replica=r, replicas=D, micro_batches=G * D)
        split.by_size = B
        split.bind(lambda step: [(s, _plan(c)) for s, c in plans.items() if s <= step])
        recut, why = recut_by_size(loader, split, start_step=0)
        assert recut is not None, why
        recuts.append(recut)
    return recuts


@pytest.mark.parametrize("workers", [0, 2])
def test_a_size_plan_reads_each_steps_samples_cut_by_size(workers: int) -> None:
    kwargs = {"num_workers": workers}
    want = _epochs([_loader(r, **kwargs) for r in range(D)], 2)
    loaders = [_loader(r, **kwargs) for r in range(D)]
    recuts = _recut(loaders, PLANS)
    got = _epochs(loaders, 2)
    assert len(got) == len(want) == 10  # 5 steps per epoch (15 batches)
    for step, (ran, ref) in enumerate(zip(got, want, strict=True)):
        counts = next((c for s, c in sorted(PLANS.items(), reverse=True) if s <= step), (G,) * D)
        short = step % 5 == 4  # the epoch's last step: 3 batches, the last of 2 samples
        if all(c == G for c in counts) or short:  # the loop's own batches
            assert ran == ref, step
            assert all(r.cut_sizes(step) is None for r in recuts)
            continue
        layout = [x for replica in ref for batch in replica for x in batch]
        flat = [x for replica in ran for batch in replica for x in batch]
        assert flat == layout, step  # every sample once, in the even split's order
        for r in range(D):
            sizes = [len(b) for b in ran[r]]
            assert len(sizes) == G and sum(sizes) == counts[r] * B, (step, r, sizes)
            assert max(sizes) - min(sizes) <= 1, (step, r, sizes)
            assert recuts[r].read_in(step) == counts[r] * B
            assert recuts[r].handed_out(step) == G
            assert recuts[r].cut_sizes(step) == sizes


def test_attached_without_a_plan_hands_out_the_loops_own_batches() -> None:
    want = _epochs([_loader(r) for r in range(D)], 2)
    loaders = [_loader(r) for r in range(D)]
    _recut(loaders, {})
    assert _epochs(loaders, 2) == want


def _unseeded(self):  # type: ignore[no-untyped-def]
    return iter(torch.randperm(len(self.dataset))[self.rank :: self.num_replicas].tolist())


def test_a_sampler_that_depends_on_more_than_its_rank_is_found_out() -> None:
    """A copy of the sampler draws other batches than the loop's (unseeded shuffling): found at
    the epoch's first step - the loop's own batches and ``broken`` under the even split, an
    error under a plan (the other replicas' batches read would be wrong too)."""
    loaders = [_loader(r) for r in range(D)]
    for loader in loaders:
        unseeded = type("Unseeded", (DistributedSampler,), {"__iter__": _unseeded})
        loader.batch_sampler.sampler.__class__ = unseeded
    recuts = _recut(loaders, {})
    first = [next(iter(loaders[0])) for _ in range(1)]
    assert len(first) == 1 and "depends on more than its rank" in recuts[0].broken
    loaders = [_loader(r) for r in range(D)]
    for loader in loaders:
        loader.batch_sampler.sampler.__class__ = unseeded
    _recut(loaders, {0: (4, 4, 1, 3)})
    with pytest.raises(FailslowError, match="depends on more than its rank"):
        next(iter(loaders[0]))


def test_refusals_say_why() -> None:
    split = ReplicaSplit(replica=1, replicas=D, micro_batches=G * D)
    split.by_size = B
    loader = _loader(2)
    recut, why = recut_by_size(loader, split, start_step=0)
    assert recut is None and "rank 2 of 4" in why and "replica 1 of 4" in why
    split.by_size = B + 1
    recut, why = recut_by_size(_loader(1), split, start_step=0)
    assert recut is None and "batch size is 4, not the 5 samples" in why


def test_a_live_iterator_whose_workers_fetched_ahead_is_taken_over() -> None:
    """Lightning makes the first epoch's iterator before training starts; with workers, they
    have fetched batches of it already (``prefetch_factor * num_workers`` = 4: step 0 and one
    batch of step 1, under the even split). Taken over live, the rest of the epoch and the next
    one read exactly the plan's samples from step 2 on, and the fetched batches count as read."""
    kwargs = {"num_workers": 2}
    want = _epochs([_loader(r, **kwargs) for r in range(D)], 2)
    loaders = [_loader(r, **kwargs) for r in range(D)]
    for loader in loaders:
        loader.batch_sampler.sampler.set_epoch(0)
    lives = [iter(loader) for loader in loaders]
    recuts = []
    for r, (loader, live) in enumerate(zip(loaders, lives, strict=True)):
        split = ReplicaSplit(replica=r, replicas=D, micro_batches=G * D)
        split.by_size = B
        split.bind(lambda step: [(s, _plan(c)) for s, c in PLANS.items() if s <= step])
        recut, why = recut_by_size(loader, split, start_step=0, live=live)
        assert recut is not None, why
        recuts.append(recut)
    first = []  # the rest of epoch 0 from the live iterators, then epoch 1 as the loop reads it
    while True:
        step = [[[int(x) for x in b] for b in itertools.islice(it, G)] for it in lives]
        if not any(step):
            break
        first.append(step)
    for loader in loaders:
        loader.batch_sampler.sampler.set_epoch(1)
    lives = [iter(loader) for loader in loaders]
    while True:
        step = [[[int(x) for x in b] for b in itertools.islice(it, G)] for it in lives]
        if not any(step):
            break
        first.append(step)
    assert len(first) == len(want) == 10
    assert first[:2] == want[:2]  # before the plan: the loop's own batches
    for step in range(2, 10):
        ran, ref = first[step], want[step]
        assert [x for q in ran for b in q for x in b] == [x for q in ref for b in q for x in b]
    assert [recuts[r].read_in(2) for r in range(D)] == [c * B for c in PLANS[2]]
    assert recuts[0].read_in(0) == G * B  # fetched ahead by the workers, counted
