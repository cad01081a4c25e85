"""Exact shares of every global batch for uneven micro-batch plans (greyhound 5.2, S2).

A micro-batch plan gives DP replica ``r`` ``counts[r]`` of the ``M`` micro-batches of each global
step. For the gradient to equal the even split's, the replicas together must read exactly the
global batch the even split would have read - no sample dropped, none read twice. This module
defines that global batch once, independently of the counts, and cuts it into the replicas'
shares:

- epoch ``e`` is a permutation of the dataset (``torch.randperm`` seeded with ``seed + e``, like
  ``DistributedSampler.set_epoch``; the identity when ``shuffle=False``);
- step ``s`` of an epoch reads the next ``M * micro_batch_size`` indices of that permutation as
  ``M`` micro-batches of ``micro_batch_size``; replica ``r`` reads micro-batches
  ``[sum(counts[:r]), sum(counts[:r + 1]))``;
- **epoch boundary rule**: an epoch has ``len(dataset) // (M * micro_batch_size)`` steps; the
  remaining ``len(dataset) % (M * micro_batch_size)`` indices of its permutation are not read
  (``drop_last=True`` applied to the *global* batch), so every step is a full global batch
  whatever the counts.

:class:`ShareSampler` is a batch sampler (one micro-batch of indices per item) for
``DataLoader(dataset, batch_sampler=...)``; :func:`share_loader` builds that loader. Where
several ranks run one replica on different samples (an HSDP shard group: every shard rank
computes on its own part of the replica's micro-batch), each micro-batch holds ``parts *
micro_batch_size`` indices and rank ``part`` of the replica reads its contiguous
``micro_batch_size`` of them (``parts=1``: the replica's ranks read the same micro-batch, as
Megatron's TP ranks do). A new
``counts`` takes effect at a step boundary (:meth:`ShareSampler.set_counts`). The sampler hands
out indices lazily, step by step; a DataLoader with workers reads it ahead of training (each
worker prefetches). So before it hands out the first indices of a step, the sampler asks
``before_step(step)`` (set by the adapter kit: the plans decided for that step and earlier, from
the plan channel - every plan carries its apply step) and registers their counts; a plan for a
step whose indices were already handed out still raises instead of silently reading the wrong
share.

A replica's share is a contiguous block of the step's global batch. Samplers that interleave
the replicas - Megatron-LM's pretraining sampler (global micro-batch ``j``'s slice ``r``),
torch's ``DistributedSampler`` (every ``D``-th sample) - read the same samples per step and
assign them otherwise, so a job moved from one to the other sums the same gradients in another
grouping: the same model up to rounding, not bitwise (a Megatron job: 1.02e-6 of a tensor's
largest value after 91 steps, ``tests/e2e/conftest.py``).

**By size** (``by_size=True``; issue 46): where every replica must run the same ``G = M / D``
micro-batches per step (DeepSpeed ZeRO 2/3 reduce gradients inside every micro-step's backward),
replica ``r`` reads the same samples a count plan would give it - the ``counts[r] *
micro_batch_size`` indices from offset ``sum(counts[:r]) * micro_batch_size`` of the step's
global batch - cut into ``G`` micro-batches as even as they go (:func:`cut`). Under the even
split those are exactly the count form's micro-batches. Reads are counted in samples.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from failslow.errors import ConfigError, FailslowError

READS_KEPT = 16
"""Steps whose read counts a :class:`ShareSampler` keeps (a loader reads a few steps ahead at
most; a plan is checked one step after it applied)."""


def check_counts(counts: Sequence[int], *, replicas: int, micro_batches: int) -> tuple[int, ...]:
    """``counts`` as a tuple if it is a valid split of ``micro_batches`` over ``replicas``
    (one non-negative integer per replica, summing to ``micro_batches``), else ConfigError."""
    counts = tuple(counts)
    if len(counts) != replicas:
        raise ConfigError(
            f"micro-batch counts {list(counts)}: expected one count per DP replica "
            f"({replicas}), got {len(counts)}"
        )
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ConfigError(f"micro-batch counts {list(counts)}: every count must be an integer >= 0")
    if sum(counts) != micro_batches:
        raise ConfigError(
            f"micro-batch counts {list(counts)}: must sum to the {micro_batches} micro-batches "
            f"of a global batch, got {sum(counts)}"
        )
    return counts


def cut(samples: Sequence[int], parts: int) -> list[list[int]]:
    """``samples`` in ``parts`` consecutive pieces as even as they go (the first
    ``len % parts`` one larger)."""
    size, extra = divmod(len(samples), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(list(samples[at : at + n]))
        at += n
    return out


def cut_size(samples: int, parts: int, j: int) -> int:
    """The length of piece ``j`` of :func:`cut` of ``samples`` indices into ``parts``."""
    size, extra = divmod(samples, parts)
    return size + (1 if j < extra else 0)


class StepPlans(Sampler[list[int]]):
    """A batch sampler's schedule of micro-batch counts by global step, and what it handed out.

    :attr:`step` is the global step whose batches are handed out next and :attr:`offset` how
    many of them are out; subclasses hand batches out (``__iter__``) and count each with
    :meth:`_count_read` (``size`` in their unit: micro-batches, or samples). A new count takes
    effect at a step boundary (:meth:`set_counts`); :attr:`before_step` is called with a step
    before its first batch is handed out (the kit registers the plans decided for it there,
    :class:`failslow.adapters.common.microbatch.ReplicaSplit`)."""

    def __init__(
        self, counts: Sequence[int], *, replica: int, replicas: int, micro_batches: int,
        start_step: int,
    ) -> None:  # fmt: skip
        self.replica = replica
        self.replicas = replicas
        self.micro_batches = micro_batches
        self._plan_steps = [start_step]
        self._plan_counts = [self._check(counts)]
        self.step = start_step
        """Global step whose batches are handed out next."""
        self.offset = 0
        """Batches of ``step`` already handed out."""
        self.before_step: Callable[[int], None] | None = None
        self._reads: dict[int, int] = {}
        """What was handed out per step, for the last :data:`READS_KEPT` steps read (what the
        kit checks a plan against after its apply step)."""

    def _check(self, counts: Sequence[int]) -> tuple[int, ...]:
        return check_counts(counts, replicas=self.replicas, micro_batches=self.micro_batches)

    def set_counts(self, counts: Sequence[int], step: int | None = None) -> None:
        """Use ``counts`` from global step ``step`` on (default: the next step not yet
        started). Raises FailslowError if batches of ``step`` were already handed out."""
        counts = self._check(counts)
        if step is None:
            step = self.step + (1 if self.offset else 0)
        if step in self._plan_steps and self._plan_counts[self._plan_steps.index(step)] == counts:
            return  # registered already (ahead of a loader that reads ahead)
        later = (c for s, c in zip(self._plan_steps, self._plan_counts, strict=True) if s > step)
        if self.counts_at(step) == counts and all(c == counts for c in later):
            return  # these counts are in force from there on: nothing changes (a rollback)
        if step < self.step or (step == self.step and self.offset):
            raise FailslowError(
                f"{type(self).__name__}: cannot change micro-batch counts from step {step}: "
                f"replica {self.replica} already read up to step {self.step} (batch "
                f"{self.offset}); use num_workers=0 or schedule the plan further ahead"
            )
        i = bisect.bisect_right(self._plan_steps, step)
        del self._plan_steps[i:], self._plan_counts[i:]
        self._plan_steps.append(step)
        self._plan_counts.append(counts)

    def counts_at(self, step: int) -> tuple[int, ...]:
        """Micro-batches per replica of global step ``step``."""
        i = bisect.bisect_right(self._plan_steps, step) - 1
        return self._plan_counts[max(i, 0)]

    def read_in(self, step: int) -> int:
        """What this sampler handed out of global step ``step`` (0: nothing, or the step is
        more than :data:`READS_KEPT` steps behind the newest read)."""
        return self._reads.get(step, 0)

    def has_read(self, step: int) -> bool:
        """True once a batch of global step ``step`` (or a later one) was handed out."""
        return self.step > step or (self.step == step and self.offset > 0)

    def _count_read(self, size: int = 1) -> None:
        reads = self._reads
        reads[self.step] = reads.get(self.step, 0) + size
        if len(reads) > READS_KEPT:
            del reads[min(reads)]

    def state_dict(self, at_step: int | None = None) -> dict[str, Any]:
        """The position and the plans. ``at_step``: as of the start of that step instead (a
        snapshot at a step boundary: a loader that read ahead of training resumes where training
        stood, without the plans registered for later steps)."""
        plans = zip(self._plan_steps, self._plan_counts, strict=True)
        if at_step is None:
            step, offset = self.step, self.offset
        else:
            step, offset = at_step, 0
            plans = ((s, c) for s, c in plans if s <= at_step)  # type: ignore[assignment]
        return {"step": step, "offset": offset, "plans": [[s, list(c)] for s, c in plans]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.offset = int(state["step"]), int(state["offset"])
        self._plan_steps = [int(s) for s, _ in state["plans"]]
        self._plan_counts = [self._check(c) for _, c in state["plans"]]


class ShareSampler(StepPlans):
    """Batch sampler: replica ``replica``'s micro-batches of every global step, in order.

    Iterating yields from the current position to the end of the epoch that contains it (so
    ``for batch in loader`` is one epoch, and the next ``for`` the next epoch); the position
    only moves as indices are handed out. ``step`` numbers global steps from the start of
    training (``start_step`` for a resumed run), across epochs.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        micro_batch_size: int,
        micro_batches: int,
        replica: int,
        replicas: int,
        counts: Sequence[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        start_step: int = 0,
        part: int = 0,
        parts: int = 1,
        by_size: bool = False,
    ) -> None:
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("micro_batches", micro_batches),
            ("replicas", replicas),
            ("parts", parts),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ShareSampler: {name} must be an integer >= 1, got {value!r}")
        if not 0 <= replica < replicas:
            raise ConfigError(f"ShareSampler: replica must be in [0, {replicas}), got {replica}")
        if not 0 <= part < parts:
            raise ConfigError(f"ShareSampler: part must be in [0, {parts}), got {part}")
        if by_size and (parts != 1 or micro_batches % replicas):
            raise ConfigError(
                "ShareSampler: by_size needs one rank's part per micro-batch (parts=1) and "
                f"micro-batches that split evenly over the replicas; got parts={parts}, "
                f"{micro_batches} micro-batches over {replicas} replicas"
            )
        self.by_size = by_size
        """The size form: ``G = M / D`` micro-batches per step whatever the counts, holding
        the replica's ``counts[r] * micro_batch_size`` samples (see the module docstring)."""
        self.global_batch = micro_batches * micro_batch_size * parts
        if dataset_len < self.global_batch:
            raise ConfigError(
                f"ShareSampler: the dataset has {dataset_len} samples, fewer than one global "
                f"batch ({micro_batches} micro-batches x {parts * micro_batch_size})"
            )
        self.part = part
        self.parts = parts
        self.dataset_len = dataset_len
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self.replicas = replicas
        self.shuffle = shuffle
        self.seed = seed
        self.steps_per_epoch = dataset_len // self.global_batch
        if counts is None:
            if micro_batches % replicas:
                raise ConfigError(
                    f"ShareSampler: {micro_batches} micro-batches do not split evenly over "
                    f"{replicas} replicas; pass counts"
                )
            counts = (micro_batches // replicas,) * replicas
        super().__init__(
            counts, replica=replica, replicas=replicas, micro_batches=micro_batches,
            start_step=start_step,
        )  # fmt: skip
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    # -- indices ---------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.dataset_len, generator=g)
            else:
                self._perm = torch.arange(self.dataset_len)
            self._perm_epoch = epoch
        return self._perm

    def global_batch_indices(self, step: int) -> list[list[int]]:
        """All ``M`` micro-batches of global step ``step`` (every replica's, all ``parts`` of
        each), in order."""
        epoch, k = divmod(step, self.steps_per_epoch)
        flat = self._permutation(epoch)[k * self.global_batch : (k + 1) * self.global_batch]
        return [chunk.tolist() for chunk in flat.split(self.micro_batch_size * self.parts)]

    def per_step(self, step: int) -> int:
        """Micro-batches this replica is handed in global step ``step``."""
        if self.by_size:
            return self.micro_batches // self.replicas
        return self.counts_at(step)[self.replica]

    def share(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of global step ``step`` (its replica's, its part)."""
        counts = self.counts_at(step)
        first = sum(counts[: self.replica])
        if self.by_size:
            b = self.micro_batch_size
            flat = [i for batch in self.global_batch_indices(step) for i in batch]
            return cut(flat[first * b : (first + counts[self.replica]) * b], self.per_step(step))
        lo = self.part * self.micro_batch_size
        mine = self.global_batch_indices(step)[first : first + counts[self.replica]]
        return [batch[lo : lo + self.micro_batch_size] for batch in mine]

    def _skip_finished_step(self) -> None:
        if self.offset and self.offset >= self.per_step(self.step):
            self.step, self.offset = self.step + 1, 0  # the last step was read to its end

    @property
    def next_step(self) -> int:
        """The global step the next micro-batch handed out belongs to (reads only: a live
        iterator keeps its own place in the step it last handed out from)."""
        if self.offset and self.offset >= self.per_step(self.step):
            return self.step + 1
        return self.step

    def __iter__(self) -> Iterator[list[int]]:
        self._skip_finished_step()
        end = (self.step // self.steps_per_epoch + 1) * self.steps_per_epoch
        while self.step < end:
            if self.offset == 0 and self.before_step is not None:
                self.before_step(self.step)
            mine = self.share(self.step)
            while self.offset < len(mine):
                batch = mine[self.offset]
                self.offset += 1
                self._count_read(len(batch) if self.by_size else 1)
                yield batch
            self.step += 1
            self.offset = 0

    def __len__(self) -> int:
        """Micro-batches in one epoch for this replica under the counts in effect now."""
        return self.steps_per_epoch * self.per_step(self.step)


def share_loader(
    dataset: Dataset[Any],
    *,
    micro_batch_size: int,
    micro_batches: int,
    replica: int,
    replicas: int,
    counts: Sequence[int] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    start_step: int = 0,
    part: int = 0,
    parts: int = 1,
    by_size: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> DataLoader[Any]:
    """A DataLoader yielding replica ``replica``'s micro-batches of ``dataset`` (one per item;
    part ``part`` of ``parts`` of each; ``by_size``: the size form); its :class:`ShareSampler` is
    ``loader.batch_sampler``.
    ``loader_kwargs`` go to DataLoader (``num_workers`` defaults to 0, see the module
    docstring)."""
    sampler = ShareSampler(
        len(dataset),  # type: ignore[arg-type]
        micro_batch_size=micro_batch_size,
        micro_batches=micro_batches,
        replica=replica,
        replicas=replicas,
        counts=counts,
        shuffle=shuffle,
        seed=seed,
        start_step=start_step,
        part=part,
        parts=parts,
        by_size=by_size,
    )
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, **loader_kwargs)
