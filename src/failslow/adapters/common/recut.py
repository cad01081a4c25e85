"""S2 by size over a loader the framework built (greyhound 5.2's S2; issue 46's size form).

Where the training loop, not failslow, decides how many micro-batches a replica runs per step -
the Hugging Face Trainer draws ``G = gradient_accumulation_steps`` batches per optimizer step
on every rank and counts its own accumulation boundary - a micro-batch plan cannot change the
count. It can change the *size*: every replica still runs ``G`` micro-batches (so every
gradient reduction happens on every rank), and replica ``r``'s micro-batches together hold
``counts[r] * B`` samples of the step instead of ``G * B`` (``B`` the per-device batch size;
the plan's counts stay in units of the even split's micro-batches, so the planner is the same).
The global batch of a step is unchanged, only who computes which of its samples.

**Which samples.** The framework's own sharded loader defines each step's global batch: with
Accelerate's ``BatchSamplerShard`` (``split_batches=False``) micro-step ``j`` of the step hands
process ``q`` the underlying batch ``j * W + q``, so the step reads the ``G * W`` underlying
batches in order. :class:`RecutSampler` lets the framework's sampler hand out this replica's
``G`` batches as it always does, sees the ``G * W`` underlying batches it consumed for them, and
lays the step's samples out replica by replica in the even split's order (replica 0's ``G``
batches, then replica 1's ...); replica ``r`` takes its ``counts[r] * B`` of them from offset
``sum(counts[:r]) * B``, cut into ``G`` micro-batches as even as they go (the first
``n mod G`` one larger). Under the even split that is exactly the framework's own batches, so
attaching failslow changes nothing until a plan applies. A step the framework's sampler does
not fill (the epoch's last, padded or short) runs the framework's own batches whatever the
plan (the plan's check after its apply step says so if it was that step).

**The gradient.** Replicas of unequal sizes give the even split's gradient only where the loss
is a sum over the global batch's items divided by their global count - the Trainer's
``num_items_in_batch`` gathered across ranks (``average_tokens_across_devices``) with a model
that takes it. The adapter checks that before it allows plans (:mod:`failslow.adapters.
transformers.plugin`). Per-sample cost must be about linear in the batch size for the plan's
prediction to hold (the closed loop measures what it bought).

**The count form** (``by_count=True``): where the loop runs as many micro-batches per step as the
loader hands it and lets failslow decide the last (Accelerate's ``accumulate``, whose
``_do_sync`` the Accelerate adapter answers), the same share is handed out as ``counts[r]``
micro-batches of ``B`` samples - the even split's micro-batches, moved whole between replicas,
so every micro-loss keeps its ``1 / G`` and shapes do not change. Reads are counted in
micro-batches.

**A resumed rank** (byterobust 4.3, 6.3: a restart or a hot update from an in-memory snapshot of
step ``N``) builds the framework's loader afresh, at the start of its first epoch, while training
goes on at step ``N``. ``skip_steps=N`` makes the sampler walk the framework's sampler over the
``N`` steps already trained without handing their batches out: epoch by epoch, each of them a
real iteration of the framework's loader (its shuffle drawn, its per-epoch seeds and state
synchronised as in the uninterrupted run), a whole epoch already trained handing out nothing
(the loop's ``for batch in loader`` of that epoch ends at once, and the epoch still counts), the
epoch of step ``N`` from its first untrained step. So the resumed run reads the same samples at
the same steps as the run without the restart, where the framework's shuffle depends only on
the loader's own generator or epoch (``shuffle=True`` with the loader's ``generator``, a
seedable sampler), not on the process's global random state at each epoch. ``epoch`` (the
loader's epoch counter and its setter) lets an epoch that handed out nothing still count in a
loader that counts only epochs that yielded (Accelerate's ``DataLoaderShard``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from failslow.adapters.common.data import READS_KEPT, StepPlans, cut
from failslow.errors import ConfigError


class _Recording:
    """The framework's underlying batch sampler, every batch it yields also kept in
    ``seen``; anything else is the wrapped sampler's."""

    def __init__(self, inner: Any, seen: list[list[int]]) -> None:
        self.inner = inner
        self.seen = seen

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.inner:
            self.seen.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)


class RecutSampler(StepPlans):
    """This replica's micro-batches of every step, re-cut by size under the plan in effect
    (see the module docstring). ``shard``: the framework's per-process batch sampler; its
    ``batch_sampler`` (the underlying, global one) is wrapped to be seen. ``accumulation``:
    the micro-batches every replica runs per step (``G``); ``unit``: samples per micro-batch
    of the even split (``B``). Reads are counted in samples; with ``by_count`` the share is
    handed out as ``counts[r]`` micro-batches of ``B`` (reads counted in micro-batches)."""

    def __init__(
        self,
        shard: Any,
        *,
        replica: int,
        replicas: int,
        accumulation: int,
        unit: int,
        start_step: int = 0,
        by_count: bool = False,
        skip_steps: int = 0,
        epoch: tuple[Callable[[], int], Callable[[int], None]] | None = None,
    ) -> None:
        if accumulation < 1 or unit < 1:
            raise ConfigError(
                f"RecutSampler: accumulation and unit must be >= 1, got {accumulation}, {unit}"
            )
        super().__init__(
            (accumulation,) * replicas, replica=replica, replicas=replicas,
            micro_batches=accumulation * replicas, start_step=start_step,
        )  # fmt: skip
        self.shard = shard
        self.accumulation = accumulation
        self.unit = unit
        self.by_count = by_count
        self._handed: dict[int, int] = {}
        """Micro-batches of each recent step, as cut when its first was handed out."""
        self._seen: list[list[int]] = []
        shard.batch_sampler = _Recording(shard.batch_sampler, self._seen)
        if skip_steps < 0:
            raise ConfigError(f"RecutSampler: skip_steps must be >= 0, got {skip_steps}")
        self._skip = skip_steps
        """Steps already trained whose batches the framework's sampler has yet to be walked
        over (a resumed rank's; see the module docstring)."""
        self._epoch = epoch
        self._empty_epoch: int | None = None
        """The loader's epoch counter when an epoch handed out nothing (skipped whole)."""

    def __getattr__(self, name: str) -> Any:  # the framework reads its sampler's attributes
        if "shard" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["shard"], name)

    def __len__(self) -> int:
        return len(self.shard)

    def __iter__(self) -> Iterator[list[int]]:
        if self._epoch is not None and self._empty_epoch is not None:
            counter, set_epoch = self._epoch
            if counter() == self._empty_epoch:  # the loader did not count the empty epoch
                set_epoch(self._empty_epoch + 1)
        self._empty_epoch = None
        own_batches = iter(self.shard)
        walked = self._skip > 0
        while self._skip:  # a resumed rank: walk over the steps already trained
            if not list(itertools.islice(own_batches, self.accumulation)):
                break  # this epoch was trained whole: it hands out nothing
            self._skip -= 1
        self._seen.clear()
        first = True
        while True:
            own = list(itertools.islice(own_batches, self.accumulation))
            if not own:
                if first and walked and self._epoch is not None:
                    self._empty_epoch = self._epoch[0]()
                return
            first = False
            group, self._seen[:] = list(self._seen), []
            if self.before_step is not None:
                self.before_step(self.step)
            batches = self.batches(self.step, own, group)
            self._handed[self.step] = len(batches)
            if len(self._handed) > READS_KEPT:
                del self._handed[min(self._handed)]
            for batch in batches:
                self.offset += 1
                self._count_read(1 if self.by_count else len(batch))
                yield batch
            self.step += 1
            self.offset = 0

    def handed_out(self, step: int) -> int | None:
        """The micro-batches this replica is handed in ``step`` (known from its first one on;
        None before, or long after): the plan's count, or in a step the framework's sampler
        did not fill (the epoch's last), the framework's own."""
        return self._handed.get(step)

    def batches(
        self, step: int, own: Sequence[Sequence[int]], group: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """This replica's micro-batches of ``step``: the framework's own (``own``) under the
        even split or where the step is not a full one, else its share of the ``group`` the
        framework's sampler consumed for the step, cut by size (or in micro-batches of ``B``,
        ``by_count``)."""
        counts = self.counts_at(step)
        g, w, b = self.accumulation, self.replicas, self.unit
        full = len(own) == g and len(group) == g * w and all(len(x) == b for x in group)
        if all(c == g for c in counts) or not full:
            return [list(x) for x in own]
        if any(list(own[j]) != list(group[j * w + self.replica]) for j in range(g)):
            raise ConfigError(
                "RecutSampler: the framework's sampler did not hand this process the underlying "
                "batch of its position in every micro-step (only split_batches=False is known)"
            )
        return share_of(
            counts, self.replica, g, b, lambda q, j: group[j * w + q], by_count=self.by_count
        )


def share_of(
    counts: Sequence[int],
    replica: int,
    g: int,
    b: int,
    batch_of: Callable[[int, int], Sequence[int]],
    *,
    by_count: bool = False,
) -> list[list[int]]:
    """Replica ``replica``'s micro-batches of a full step under ``counts``: its
    ``counts[replica] * b`` samples from offset ``sum(counts[:replica]) * b`` of the step's
    samples laid out replica by replica in the even split's order (``batch_of(q, j)``:
    replica ``q``'s micro-batch ``j`` of ``g``, each of ``b`` samples; only the replicas the
    share overlaps are read), cut into ``g`` micro-batches by size, or (``by_count``) handed
    out as micro-batches of ``b``."""
    lo = sum(counts[:replica]) * b
    hi = lo + counts[replica] * b
    per = g * b  # one replica's samples under the even split
    first, last = lo // per, -(-hi // per)
    order = list(
        itertools.chain.from_iterable(batch_of(q, j) for q in range(first, last) for j in range(g))
    )
    share = order[lo - first * per : hi - first * per]
    if by_count:  # the even split's micro-batches of B, moved whole
        return [share[i : i + b] for i in range(0, len(share), b)]
    return cut(share, g)
