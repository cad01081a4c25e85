"""S2 over a data iterator the training loop built itself (greyhound 5.2's S2; issue 45).

Megatron-LM's loop - and one written from Megatron-core's examples - reads its micro-batches
from ``iter(DataLoader(dataset, batch_sampler=...))`` whose batch sampler hands this DP replica
its own stream: a ``DistributedSampler`` (``rank`` of ``num_replicas``) under the DataLoader's
``BatchSampler``, or Megatron-LM's pretraining samplers (``data_parallel_rank`` of
``data_parallel_size``). Under the even split step ``s`` reads, on every replica ``q``, the next
``G`` batches of ``q``'s stream; the global batch is those ``G * D`` batches. A micro-batch plan
moves whole micro-batches between replicas (the count form of
:class:`~failslow.adapters.common.recut.RecutSampler`): replica ``r`` runs ``counts[r]`` of the
step's batches, from position ``sum(counts[:r])`` of the replica-major order (replica 0's ``G``,
then replica 1's ...). Drawing more or fewer of its own stream would train on other data than
the even split, so a replica under a plan reads other replicas' batches.

**Whose batches.** Those samplers depend on the replica only through their rank attribute: a
copy with another rank hands out that replica's stream (:func:`replica_views`). That is checked
on the first step of every epoch: the copy with this replica's own rank must give what the
loop's sampler gave, else :attr:`LoaderRecut.broken` says what differed and plans are refused.
A copy costs what the sampler costs (a ``DistributedSampler`` draws its epoch's permutation);
only the replicas a share overlaps are read.

**Where.** The live iterator's index stream (``_sampler_iter``: what the DataLoader and its
workers fetch next) is replaced by the recut's, and the loop's batch sampler becomes an instance
of a subclass whose ``__iter__`` is the recut's, so the loop's next ``iter(loader)`` (the next
epoch, a cyclic iterator) goes through it too. Under the even split it hands out exactly the
sampler's own batches: attaching changes nothing until a plan applies. Plans reach it before it
hands out a step (``before_step``), so a loader with workers that reads ahead reads the plan's
share; batches its workers fetched before the recut was installed must fall in even steps.

**Epochs.** Every replica's stream has the same number of batches per epoch (both samplers pad
or drop to it). A step that crosses the end of an epoch hands out its batches of this epoch,
ends the iteration (the loop starts the next one as it does without failslow), and hands out
the rest from the next epoch's first batches.

Megatron-LM's own loop builds its iterator this way with ``dataloader_type="single"``
(``MegatronPretrainingSampler``); its ``"cyclic"`` iterator is a generator around the loader,
which hides the sampler: declared, with the reason.

**By size** (:class:`SizeRecut`, :func:`recut_by_size`): where the loop runs its own ``G``
micro-batches per step on every replica and an epoch's end ends a step (PyTorch Lightning's
loop: a step every ``G`` batches of an epoch and one at its last batch), a plan changes how many
samples this replica's ``G`` micro-batches hold instead (the size form of
:mod:`failslow.adapters.common.recut`): the step's ``G * D`` batches, read from the same copies
of the sampler, laid out replica by replica, this replica's ``counts[r] * B`` samples of them
cut into ``G``. A step the epoch does not fill runs the loop's own batches whatever the plan.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from failslow.adapters.common.data import READS_KEPT, StepPlans
from failslow.adapters.common.recut import share_of
from failslow.errors import FailslowError

View = Callable[[Any, int], Any]
"""``view(template, q)``: a copy of the loop's batch sampler handing out replica ``q``'s batches."""

_RANKS = (("data_parallel_rank", "data_parallel_size"), ("rank", "num_replicas"))
_SUBCLASSES: dict[type, type] = {}


def _replicas(holder: Any, size_name: str) -> Any:
    """The replicas ``holder`` says it shards over: its ``size_name``, else (Megatron-LM's
    ``MegatronPretrainingSampler`` keeps no data-parallel size of its own) its
    ``micro_batch_times_data_parallel_size`` over its ``micro_batch_size``."""
    size = getattr(holder, size_name, None)
    if size is None and size_name == "data_parallel_size":
        width = getattr(holder, "micro_batch_times_data_parallel_size", None)
        micro = getattr(holder, "micro_batch_size", None)
        if isinstance(width, int) and isinstance(micro, int) and micro > 0:
            size = width // micro
    return size


def _plain(sampler: Any) -> Any:
    """A shallow copy of the loop's batch sampler as its own class made it (not the recut's)."""
    out = copy.copy(sampler)
    out.__dict__.pop("_failslow_recut", None)
    out.__class__ = getattr(type(sampler), "_failslow_base", type(sampler))
    return out


def replica_views(sampler: Any, replica: int, replicas: int) -> tuple[View | None, str]:
    """``(view, "")`` where the batch sampler says which replica it reads for and it is this
    one of ``replicas``; ``(None, why)`` otherwise."""
    holders: list[tuple[Any, str | None]] = [(sampler, None)]
    inner = getattr(sampler, "sampler", None)
    if inner is not None:
        holders.append((inner, "sampler"))
    for holder, path in holders:
        for rank_name, size_name in _RANKS:
            rank, size = getattr(holder, rank_name, None), _replicas(holder, size_name)
            if not isinstance(rank, int) or not isinstance(size, int):
                continue
            if (rank, size) != (replica, replicas):
                return None, (
                    f"its sampler reads for {rank_name} {rank} of {size} and this rank is "
                    f"data-parallel replica {replica} of {replicas}"
                )

            def view(template: Any, q: int, path: str | None = path, name: str = rank_name) -> Any:
                out = _plain(template)
                if path is None:
                    setattr(out, name, q)
                else:
                    part = copy.copy(getattr(out, path))
                    setattr(part, name, q)
                    setattr(out, path, part)
                return out

            return view, ""
    return None, (
        f"its batch sampler ({type(sampler).__name__}) does not say which data-parallel replica "
        "it reads for (a DistributedSampler's rank, Megatron-LM's data_parallel_rank)"
    )


class LoaderRecut(StepPlans):
    """This replica's micro-batches of every step from the loop's own batch sampler, moved
    whole between replicas under the plan in effect (see the module docstring). Reads are
    counted in micro-batches."""

    def __init__(
        self, sampler: Any, view: View, *, replica: int, replicas: int, accumulation: int,
        start_step: int,
    ) -> None:  # fmt: skip
        super().__init__(
            (accumulation,) * replicas, replica=replica, replicas=replicas,
            micro_batches=accumulation * replicas, start_step=start_step,
        )  # fmt: skip
        self.sampler = sampler
        self.source = replica
        """The replica whose stream the loop's sampler hands out (a swap changes ``replica``)."""
        self.accumulation = accumulation
        self.view = view
        self.broken = ""
        """Why this loader cannot be re-cut, found while reading it ("" while it can)."""
        self._template: Any = None
        self._streams: dict[int, list[Any]] = {}
        self._start = 0
        """Stream position (in this epoch) of the current step's first batch."""
        self._pending: list[tuple[int, int]] | None = None
        """(replica, stream position) of the current step's batches not handed out yet."""
        self._own: dict[int, list[int]] = {}
        self._own_pos = 0
        self._checked = 0
        """Stream positions of this epoch checked against the view of this replica's rank."""
        self._generators: weakref.WeakSet[Any] = weakref.WeakSet()
        self._live: object | None = None
        """The iteration handing out now (one at a time; a superseded one ends)."""

    def hands_out(self, index_stream: Any) -> bool:
        """True when ``index_stream`` (a DataLoader iterator's) is one of this recut's."""
        return index_stream in self._generators

    def epoch(self, own: Iterator[Any], drawn: int = 0) -> Iterator[list[int]]:
        """The index stream over one iteration of the loop's sampler (``own``; ``drawn``: how
        many batches of it were fetched before the recut took it over)."""
        generator = self._hand_out(own, drawn)
        self._generators.add(generator)
        return generator

    def skip(self, step_start: int, fetched: int) -> None:
        """Count ``fetched`` batches of the loop's sampler, fetched from stream position
        ``step_start`` on before the recut took the live iterator over, as handed out under the
        even split (FailslowError where a plan is in force there)."""
        self._start, g = step_start, self.accumulation
        while fetched > 0:
            counts = self.counts_at(self.step)
            if any(c != g for c in counts) or self.replica != self.source:
                raise FailslowError(
                    f"the loop's data iterator fetched {fetched} batches of step {self.step} "
                    f"ahead under the even split, and the plan in force gives this replica "
                    f"{counts[self.replica]}"
                )
            n = min(fetched, g)
            self._count_read(n)
            if n == g:
                self.step, self._start = self.step + 1, self._start + g
            else:
                self.offset = n
                self._pending = [(self.source, self._start + j) for j in range(n, g)]
            fetched -= n

    def _in_force(self) -> bool:
        """A plan other than the even split is in force at the current step."""
        g = self.accumulation
        return self.replica != self.source or any(c != g for c in self.counts_at(self.step))

    def _hand_out(self, own: Iterator[Any], drawn: int) -> Iterator[list[int]]:
        token = object()
        if self._live is not None and self._pending == []:  # started over at a step's end
            self.step, self.offset, self._pending = self.step + 1, 0, None
        if self._live is not None and self._pending is None:
            self._start = 0  # the next step reads the new stream from its start
        elif self._live is not None:  # started over inside a step
            if self._in_force():
                raise FailslowError(
                    f"the loop started its data iterator over in step {self.step} (batch "
                    f"{self.offset}) under a plan, which failslow cannot re-cut exactly; "
                    "iterate each epoch to its end"
                )
            g = self.accumulation  # even split: the new stream goes on with the step
            self._start = -self.offset
            self._pending = [(self.source, j - self.offset) for j in range(self.offset, g)]
        self._live = token
        self._template = _plain(self.sampler)
        self._streams.clear()
        self._own.clear()
        self._own_pos = self._checked = drawn
        g, end = self.accumulation, None
        while self._live is token:
            if self._pending is None:
                if self.before_step is not None:
                    self.before_step(self.step)
                counts = self.counts_at(self.step)
                lo = sum(counts[: self.replica])
                items = range(lo, lo + counts[self.replica])
                self._pending = [(p // g, self._start + p % g) for p in items]
            while end is None and self._own_pos < self._start + g:
                try:
                    batch = list(next(own))
                except StopIteration:
                    end = self._own_pos
                    break
                self._compare(self._own_pos, batch)
                self._own[self._own_pos] = batch
                self._own_pos += 1
            while self._pending:  # the step's batches in this epoch, in the plan's order
                now = next((i for i, (_, t) in enumerate(self._pending) if end is None or t < end),
                           None)  # fmt: skip
                if now is None:
                    break
                q, t = self._pending.pop(now)
                batch = self._own[t] if q == self.source else self._batch(q, t)
                self.offset += 1
                self._count_read()
                yield batch
            if not self._pending:
                self.step, self.offset, self._pending = self.step + 1, 0, None
                self._start += g
                for t in [t for t in self._own if t < self._start]:
                    del self._own[t]
            if end is not None and (self._pending or self._start >= end):
                self._start -= end  # the rest of the step lies in the next epoch
                self._pending = [(q, t - end) for q, t in self._pending or []] or None
                self._live = None
                return

    def _compare(self, position: int, batch: list[int]) -> None:
        """The view of this replica's own rank must hand out what the loop's sampler did (on
        each epoch's first step; the first difference is kept in :attr:`broken`)."""
        if self.broken or position >= self._checked + self.accumulation:
            return
        mine = self._batch(self.source, position)
        if mine != batch:
            self.broken = (
                f"a copy of its sampler for replica {self.source} read {mine[:4]}... where the "
                f"loop's read {batch[:4]}... (it depends on more than its rank)"
            )
            if self._in_force():  # the other replicas' batches read so far were wrong too
                raise FailslowError(f"the plan in force cannot be re-cut exactly: {self.broken}")
        if position + 1 >= self._checked + self.accumulation:
            self._streams.pop(self.source, None)  # checked: only other replicas are read

    def _batch(self, q: int, t: int) -> list[int]:
        """Replica ``q``'s batch at stream position ``t`` of this epoch."""
        stream = self._streams.get(q)
        if stream is None or stream[1] > t:
            stream = self._streams[q] = [iter(self.view(self._template, q)), 0]
        try:
            while stream[1] < t:
                next(stream[0])
                stream[1] += 1
            batch = list(next(stream[0]))
        except StopIteration:
            raise FailslowError(
                f"replica {q}'s sampler holds {stream[1]} batches this epoch, fewer than "
                f"replica {self.source}'s {t + 1}: its replicas' streams must be as long"
            ) from None
        stream[1] += 1
        return batch


class SizeRecut(LoaderRecut):
    """This replica's ``G`` micro-batches of every step from the loop's own batch sampler,
    re-cut by size under the plan in effect (see the module docstring): a step is ``G``
    batches of one epoch, the epoch's last one what is left. Reads are counted in samples;
    ``unit``: samples per micro-batch of the even split (``B``)."""

    def __init__(
        self, sampler: Any, view: View, *, replica: int, replicas: int, accumulation: int,
        unit: int, start_step: int,
    ) -> None:  # fmt: skip
        super().__init__(
            sampler, view, replica=replica, replicas=replicas, accumulation=accumulation,
            start_step=start_step,
        )  # fmt: skip
        self.unit = unit
        self._handed: dict[int, int] = {}
        self._cut: dict[int, list[int]] = {}

    def handed_out(self, step: int) -> int | None:
        """Micro-batches handed out for ``step`` (None before its first, or long after)."""
        return self._handed.get(step)

    def cut_sizes(self, step: int) -> list[int] | None:
        """The samples of each micro-batch of ``step`` where it was re-cut under a plan; None
        where the loop's own batches were handed out (or before, or long after)."""
        return self._cut.get(step)

    def _hand_out(self, own: Iterator[Any], drawn: int) -> Iterator[list[int]]:
        token = object()
        if self._live is not None and self.offset:  # the last epoch's last step, or a step left
            if self.offset < self._handed.get(self.step, 0) and self._in_force():
                raise FailslowError(
                    f"the loop ended an epoch inside step {self.step} (batch {self.offset}) "
                    "under a plan, which failslow cannot re-cut exactly"
                )
            self.step, self.offset = self.step + 1, 0
        self._live = token
        self._template = _plain(self.sampler)
        self._streams.clear()
        g, b, position = self.accumulation, self.unit, drawn
        self._checked = drawn
        for _ in range(drawn):  # fetched by the loader's workers before the take-over: even
            self.offset += 1
            self._count_read(b)
            if self.offset == g:
                self.step, self.offset = self.step + 1, 0
        while self._live is token:
            begun = self.offset  # batches of this step handed out before the take-over
            mine = [list(batch) for batch in itertools.islice(own, g - begun)]
            if not mine:
                return
            if not begun and self.before_step is not None:
                self.before_step(self.step)
            for j, batch in enumerate(mine):
                self._compare(position + j, batch)
            if begun and self._in_force():
                raise FailslowError(
                    f"the loop's loader fetched {begun} batches of step {self.step} ahead "
                    "under the even split, and a plan is in force there"
                )
            counts = self.counts_at(self.step)
            full = len(mine) == g and all(len(batch) == b for batch in mine)
            batches = mine
            if full and self._in_force():
                at, ours = position, mine
                batches = share_of(
                    counts, self.replica, g, b,
                    lambda q, j: ours[j] if q == self.source else self._full(q, at + j),  # noqa: B023 - called here
                )  # fmt: skip
            self._handed[self.step] = begun + len(batches)
            if batches is not mine:
                self._cut[self.step] = [len(batch) for batch in batches]
            for kept in (self._handed, self._cut):
                if len(kept) > READS_KEPT:
                    del kept[min(kept)]
            for batch in batches:
                self.offset += 1
                self._count_read(len(batch))
                yield batch
            self.step, self.offset, position = self.step + 1, 0, position + len(mine)

    def _full(self, q: int, t: int) -> list[int]:
        """Replica ``q``'s batch at position ``t``, which must hold ``unit`` samples as this
        replica's does."""
        batch = self._batch(q, t)
        if len(batch) != self.unit:
            raise FailslowError(
                f"replica {q}'s batch {t} of this epoch holds {len(batch)} samples where replica "
                f"{self.source}'s holds {self.unit}: its replicas' streams must be cut alike"
            )
        return batch


def recut_by_size(
    loader: Any, split: Any, *, start_step: int, live: Any = None
) -> tuple[SizeRecut | None, str]:
    """Re-cut ``loader`` (a DataLoader the loop iterates epoch by epoch) by size per plan from
    ``start_step`` on, tracked by ``split`` (``split.by_size``: ``B``); ``live``: the loop's
    iterator of it already made for this epoch (its next batch is ``start_step``'s first; what
    its workers fetched ahead is counted as handed out under the even split). ``(None, why)``
    where it cannot be."""
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is None:
        return None, "its DataLoader has no batch sampler (an iterable dataset, or batch_size=None)"
    if "_failslow_recut" in sampler.__dict__:
        return None, "its batch sampler is re-cut for another loop already"
    unit = getattr(sampler, "batch_size", None)
    if unit != split.by_size:
        return None, (
            f"its batch sampler's batch size is {unit!r}, not the {split.by_size} samples per "
            "micro-batch failslow sizes plans in"
        )
    view, why = replica_views(sampler, split.replica, split.replicas)
    if view is None:
        return None, why
    recut = SizeRecut(
        sampler, view, replica=split.replica, replicas=split.replicas,
        accumulation=split.configured // split.replicas, unit=unit, start_step=start_step,
    )  # fmt: skip
    split.track(recut)
    sampler.__dict__["_failslow_recut"] = recut
    sampler.__class__ = _recut_class(type(sampler))
    if live is not None and getattr(live, "_index_sampler", None) is sampler:
        drawn = getattr(live, "_send_idx", live._num_yielded)
        live._sampler_iter = recut.epoch(live._sampler_iter, drawn)
    return recut, ""


def recut_of(iterator: Any) -> LoaderRecut | None:
    """The recut handing out ``iterator``'s batches, if any."""
    sampler = getattr(iterator, "_index_sampler", None)
    recut = getattr(sampler, "__dict__", {}).get("_failslow_recut")
    if recut is not None and recut.hands_out(getattr(iterator, "_sampler_iter", None)):
        return recut  # type: ignore[no-any-return]
    return None


def _recut_class(cls: type) -> type:
    """``cls`` with the recut's ``__iter__`` (one subclass per sampler class)."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:

        def __iter__(self: Any) -> Iterator[list[int]]:
            return self.__dict__["_failslow_recut"].epoch(cls.__iter__(self))  # type: ignore[attr-defined]

        sub = type(cls.__name__, (cls,), {"__iter__": __iter__, "_failslow_base": cls})
        sub.__module__ = cls.__module__
        _SUBCLASSES[cls] = sub
    return sub


def take_over(iterator: Any, split: Any, *, start_step: int) -> tuple[LoaderRecut | None, str]:
    """Re-cut the loop's live DataLoader iterator per plan from ``start_step`` on (the step its
    next batch belongs to), tracked by ``split``; ``(None, why)`` where it cannot be."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

    recut = recut_of(iterator)
    if recut is not None:
        return recut, ""
    if not isinstance(iterator, _BaseDataLoaderIter):
        return None, (
            f"the data iterator is a {type(iterator).__name__}, not a DataLoader's iterator (a "
            "generator over a loader hides its sampler)"
        )
    if iterator._dataset_kind == _DatasetKind.Iterable or not iterator._auto_collation:
        return None, "its DataLoader reads an iterable dataset or has no batch sampler"
    sampler = iterator._index_sampler
    if "_failslow_recut" in sampler.__dict__:
        return None, "its batch sampler is re-cut for another iterator already"
    if split.micro_batches != split.configured:
        return None, (
            f"this world runs a larger world's global batch ({split.micro_batches} micro-batches"
            f" on {split.replicas} replicas), which its sampler does not shard"
        )
    view, why = replica_views(sampler, split.replica, split.replicas)
    if view is None:
        return None, why
    g = split.configured // split.replicas
    recut = LoaderRecut(
        sampler, view, replica=split.replica, replicas=split.replicas, accumulation=g,
        start_step=start_step,
    )  # fmt: skip
    yielded = iterator._num_yielded
    drawn = getattr(iterator, "_send_idx", yielded)  # workers fetch ahead
    split.track(recut)  # a resumed rank: the snapshot's plans
    recut.step, recut.offset = start_step, 0
    try:
        recut.skip(yielded, drawn - yielded)
    except FailslowError as error:
        split.samplers.remove(recut)
        return None, str(error)
    sampler.__dict__["_failslow_recut"] = recut
    sampler.__class__ = _recut_class(type(sampler))
    iterator._sampler_iter = recut.epoch(iterator._sampler_iter, drawn)
    return recut, ""
