"""S2 by size over Accelerate's own sharded batch sampler (:mod:`failslow.adapters.common.recut`):
four processes' ``BatchSamplerShard`` over the Trainer's kind of sampler (a seeded random
sampler in a ``BatchSampler``), each wrapped as the Trainer adapter wraps it."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("accelerate", reason="needs the Accelerate extra")

from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, SequentialSampler

from failslow.adapters.common.recut import RecutSampler, cut
from failslow.errors import FailslowError

W, G, B = 4, 3, 4


def _shards(n: int) -> list[BatchSamplerShard]:
    inner = BatchSampler(SequentialSampler(range(n)), B, drop_last=False)
    return [
        BatchSamplerShard(inner, W, q, split_batches=False, even_batches=True) for q in range(W)
    ]


def _recut(n: int, by_count: bool = False) -> list[RecutSampler]:
    out = []
    for q in range(W):
        inner = BatchSampler(SequentialSampler(range(n)), B, drop_last=False)
        shard = BatchSamplerShard(inner, W, q, split_batches=False, even_batches=True)
        out.append(
            RecutSampler(shard, replica=q, replicas=W, accumulation=G, unit=B, by_count=by_count)
        )
    return out


def _steps(batches: list[list[int]]) -> list[list[list[int]]]:
    return [batches[i : i + G] for i in range(0, len(batches), G)]


def test_the_even_split_hands_out_exactly_accelerates_own_batches() -> None:
    n = W * G * B * 3 + 10  # three full steps and a padded tail
    for plain, recut in zip(_shards(n), _recut(n), strict=True):
        assert list(recut) == list(plain)
        assert len(recut) == len(plain)


def test_a_plan_moves_samples_between_replicas_and_keeps_every_step_s_global_batch() -> None:
    n = W * G * B * 3 + 10
    plain = [_steps(list(s)) for s in _shards(n)]
    samplers = _recut(n)
    counts = (4, 4, 1, 3)  # units of B samples: replica 2 gets 4 samples over its 3 micro-batches
    for s in samplers:
        s.set_counts(counts, step=1)
    got = [_steps(list(s)) for s in samplers]
    for step in range(4):
        want = sorted(i for q in range(W) for batch in plain[q][step] for i in batch)
        have = sorted(i for q in range(W) for batch in got[q][step] for i in batch)
        assert have == want, step  # each sample of the step read once, none of another step
        for q in range(W):
            assert len(got[q][step]) == len(plain[q][step])  # the loop's count is kept
            sizes = [len(x) for x in got[q][step]]
            if step in (1, 2):
                assert sum(sizes) == counts[q] * B and max(sizes) - min(sizes) <= 1
            else:  # the even split before the plan; the padded tail is Accelerate's own
                assert got[q][step] == plain[q][step]
    assert [samplers[2].read_in(s) for s in range(4)] == [G * B, 4, 4, len(
        [i for x in plain[2][3] for i in x])]  # fmt: skip


def test_the_count_form_moves_the_even_split_s_micro_batches_whole() -> None:
    """Accelerate's ``accumulate`` loop over its prepared loader: replica ``r`` runs
    ``counts[r]`` of the step's micro-batches of ``B`` (the loop iterates what it is handed);
    every micro-batch is one of the step's own, each once, in the even split's order."""
    n = W * G * B * 3 + 10
    plain = [_steps(list(s)) for s in _shards(n)]
    samplers = _recut(n, by_count=True)
    counts = (4, 4, 1, 3)
    for s in samplers:
        s.set_counts(counts, step=1)
    handed = [list(s) for s in samplers]
    for q in range(W):  # steps of G, then counts[q], counts[q], then Accelerate's padded tail
        sizes = [G, counts[q], counts[q], len(plain[q][3])]
        bounds = [sum(sizes[:i]) for i in range(5)]
        got = [handed[q][bounds[i] : bounds[i + 1]] for i in range(4)]
        assert got[0] == plain[q][0] and got[3] == plain[q][3]
        assert bounds[4] == len(handed[q])
        for step in (1, 2):
            assert all(len(x) == B for x in got[step])
    for step in (1, 2):
        order = [b for q in range(W) for b in plain[q][step]]  # the even split's, by replica
        for q in range(W):
            first = G + (step - 1) * counts[q]
            share = order[sum(counts[:q]) : sum(counts[: q + 1])]
            assert handed[q][first : first + counts[q]] == share
    assert [samplers[2].read_in(s) for s in range(4)] == [G, 1, 1, len(plain[2][3])]


def test_a_plan_for_a_step_already_handed_out_is_refused() -> None:
    sampler = _recut(W * G * B * 2)[0]
    it = iter(sampler)
    next(it)
    with pytest.raises(FailslowError, match="already read up to step 0"):
        sampler.set_counts((2, 4, 4, 2), step=0)
    sampler.set_counts((2, 4, 4, 2), step=1)
    assert sampler.has_read(0) and not sampler.has_read(1)


def test_cut_is_as_even_as_it_goes() -> None:
    assert [len(x) for x in cut(list(range(10)), 4)] == [3, 3, 2, 2]
    assert cut([1, 2, 3], 3) == [[1], [2], [3]]


def _prepared_loaders(n: int, seedable: bool, skip_steps: int = 0) -> list[Any]:
    """Accelerate's own prepared loaders of four processes (a shuffled DataLoader with its
    generator, ``prepare_data_loader`` as ``accelerator.prepare`` calls it), each re-cut as the
    Accelerate adapter re-cuts the training loader; ``skip_steps``: a rank resumed there."""
    import torch
    from accelerate.data_loader import prepare_data_loader

    from failslow.adapters.accelerate.prepared import recut
    from failslow.adapters.common.microbatch import ReplicaSplit

    loaders = []
    for q in range(W):
        plain = torch.utils.data.DataLoader(
            list(range(n)), batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(5)
        )
        loader = prepare_data_loader(
            plain, torch.device("cpu"), num_processes=W, process_index=q, put_on_device=False,
            rng_types=None, use_seedable_sampler=seedable,
        )  # fmt: skip
        split = ReplicaSplit(replica=q, replicas=W, micro_batches=G * W)
        why = recut(split, loader, "the loader", start_step=skip_steps, by_count=True,
                    skip_steps=skip_steps)  # fmt: skip
        assert why == "", why
        loaders.append(loader)
    return loaders


def _epochs(loader: Any, epochs: int) -> list[list[list[int]]]:
    """What a loop that runs ``epochs`` epochs reads, epoch by epoch (batches as lists)."""
    return [[batch.tolist() for batch in loader] for _ in range(epochs)]


@pytest.mark.parametrize("seedable", [False, True], ids=["generator", "seedable"])
@pytest.mark.parametrize("resume_at", [0, 2, 3, 7, 9])
def test_a_resumed_rank_reads_on_where_the_uninterrupted_run_stood(
    seedable: bool, resume_at: int
) -> None:
    """A rank restarted from a snapshot of step ``resume_at`` builds the loader afresh and its
    loop starts again at the first epoch: the epochs already trained hand out nothing (each
    still drawn, and counted), then the loader goes on at the step's first batch - the same
    batches, epoch by epoch, as the run without the restart. Three steps per epoch (the last
    one short), so the resumptions fall at an epoch's start, inside it and at its last step;
    Accelerate's seedable sampler reshuffles by its epoch counter, which an epoch that handed
    out nothing must still move."""
    n = W * B * (2 * G + 1)  # 7 batches per process and epoch: steps of 3, 3 and 1
    epochs = 4
    for q, (whole, resumed) in enumerate(
        zip(_prepared_loaders(n, seedable), _prepared_loaders(n, seedable, resume_at), strict=True)
    ):
        want = _epochs(whole, epochs)
        steps = [
            (e, epoch[i : i + G]) for e, epoch in enumerate(want) for i in range(0, len(epoch), G)
        ]
        trained = {e: sum(len(b) for ee, b in steps[:resume_at] if ee == e) for e in range(epochs)}
        got = _epochs(resumed, epochs)
        assert got == [want[e][trained[e] :] for e in range(epochs)], (q, resume_at)
    assert len({str(_epochs(x, 1)) for x in _prepared_loaders(n, seedable)}) == W  # 4 shards
