"""One DP replica's micro-batches under the plan in effect (greyhound 5.2, S2).

A micro-batch plan gives DP replica ``r`` ``m_r`` of the ``M`` micro-batches of each global
step. Each replica must then (1) run ``m_r`` micro-batches, (2) on exactly its share of the
global batch and (3) weight its gradient by ``w_r = m_r * D / M``, so that the DP mean equals the
even split's gradient (:func:`failslow.core.planner.allocation.loss_weights`). Every adapter needs
the same bookkeeping, whatever its framework's loop looks like:

- :class:`ReplicaSplit` holds the counts in effect, checks a plan before it applies (the
  prepare phase) and switches the counts and every tracked loader at the agreed step (the apply
  phase); :attr:`ReplicaSplit.count` and :attr:`ReplicaSplit.weight` are what this replica
  runs and how it scales;
- :meth:`ReplicaSplit.step_batches` walks a data iterator through this replica's micro-batches
  of one step, saying which one is last (where frameworks put their accumulation boundary);
- its state (counts, loader positions) goes into snapshots and comes back on resume, also when
  the loader is built after the restore;
- a loader that reads ahead of training (DataLoader workers prefetch; the ordinary loop fetches
  a step's first micro-batch before the step boundary) learns of each plan before it reads the
  plan's apply step (:meth:`ReplicaSplit.bind`): every plan carries the step it takes effect.

A plan is in effect only when the rank ran it (DESIGN.md, the closed loop; invariant 7):
:meth:`ReplicaSplit.ready` refuses before anything changes a plan this rank could not run (no
share-aware loader where the rank reads data), and :meth:`ReplicaSplit.verify` checks, after
the apply step, what the rank actually ran against the plan from counters the plan does not
set: the training forwards the session's step profile counted, the micro-batches the
share-aware loader handed out for that step, and the gradient weight the framework applied
(its scale of each micro-loss, :attr:`ReplicaSplit.micro_loss_scale`, times the
micro-batches run).

Where the framework scales each micro-loss by ``1 / G`` with ``G = M / D`` (DeepSpeed's
``engine.backward``, Accelerate's ``accumulate``), summing ``m_r`` such losses already is the
weight ``w_r`` on the replica's mean - no extra scaling; :meth:`ReplicaSplit.loss_scale` says
what to multiply by otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from failslow.adapters.common.data import (
    READS_KEPT,
    StepPlans,
    check_counts,
    cut_size,
    share_loader,
)
from failslow.core.planner.allocation import even_counts
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import ConfigError, FailslowError


class ReplicaSplit:
    """``counts[r]`` micro-batches per DP replica ``r`` of ``micro_batches`` per global step."""

    loader_hint = "build the training loader with failslow's loader"
    """What a refusal tells a job without a share-aware loader to build (each adapter names
    its own)."""

    def __init__(
        self,
        *,
        replica: int,
        replicas: int,
        micro_batches: int,
        minimum: int = 1,
        framework: str = "training",
    ) -> None:
        if micro_batches % replicas:
            raise ConfigError(
                f"{micro_batches} micro-batches per step do not split evenly over {replicas} "
                "data-parallel replicas"
            )
        self.configured = micro_batches
        """The global batch the framework was configured for (``G * D``): it divides each
        micro-loss by ``G = configured / D``."""
        self.replica = replica
        self.replicas = replicas
        self.micro_batches = micro_batches
        self.minimum = minimum
        """The fewest micro-batches a replica may run (frameworks that must step every
        replica's optimizer need 1)."""
        self.framework = framework
        """Named in refusals ("every DP replica of a DeepSpeed job must run ...")."""
        self.counts: tuple[int, ...] = (micro_batches // replicas,) * replicas
        self.forwards_per_micro_batch = 1
        """Training forwards the session counts per micro-batch (Megatron's interleaved
        schedule: one per model chunk)."""
        self.reads_data: Callable[[], bool] = lambda: True
        """Whether this rank reads micro-batches of the data in its steps (pipeline engines:
        the first and last stages only)."""
        self.micro_loss_scale: Callable[[], float | None] = lambda: None
        """What the framework multiplies each micro-loss by in the step that just ran (None:
        the adapter cannot tell); times the micro-batches run it is the replica's gradient
        weight."""
        self.by_size: int | None = None
        """The size form (:mod:`failslow.adapters.common.recut`): where the loop runs its own
        ``G`` micro-batches per step on every replica, a count unit is this many samples and a
        plan changes how many samples the replica's ``G`` micro-batches hold (None: the count
        form)."""
        self.samplers: list[StepPlans] = []
        self._weights: dict[int, float] = {}
        """The gradient weight the adapter applied per recent step (size form: the sum of its
        micro-losses' factors, :meth:`note_weight`)."""
        self._pending_samplers: list[dict[str, Any]] = []
        self._plans_for_data: Callable[[int], list[tuple[int, Any]]] | None = None
        self._training_steps: Callable[[], tuple[int | None, int]] = lambda: (None, -1)

    def bind(
        self,
        plans_for_data: Callable[[int], list[tuple[int, Any]]],
        training_steps: Callable[[], tuple[int | None, int]] | None = None,
    ) -> None:
        """Ask ``plans_for_data(step)`` (the session's) before a tracked loader reads a step:
        plans decided for that step reach the loader first, even one that reads ahead.
        ``training_steps()``: the first step this process trained and the one it is in (the
        session's boundaries)."""
        self._plans_for_data = plans_for_data
        if training_steps is not None:
            self._training_steps = training_steps

    # ---- what this replica runs --------------------------------------------------------------
    @property
    def count(self) -> int:
        """Micro-batches this replica runs per step under the plan in effect (the size form:
        the loop's ``G`` whatever the plan)."""
        if self.by_size is not None:
            return self.configured // self.replicas
        return self.counts[self.replica]

    @property
    def weight(self) -> float:
        """This replica's gradient weight ``w_r = m_r * D / M`` (1 under the even split)."""
        return self.count * self.replicas / self.micro_batches

    def note_weight(self, step: int, weight: float) -> None:
        """The adapter multiplied a micro-loss of ``step`` so that it weighs ``weight`` in the
        DP mean (its own factor times the framework's): summed per step, checked against the
        plan after its apply step."""
        self._weights[step] = self._weights.get(step, 0.0) + weight
        if len(self._weights) > READS_KEPT:
            del self._weights[min(self._weights)]

    def sample_share(self, j: int) -> float:
        """In the size form, micro-batch ``j`` of this replica's step under the plan in
        effect holds this many even-split micro-batches' worth of samples (``n_j / B``: the
        factor on its mean micro-loss that weighs each of its samples as the even split does;
        1.0 under the even split). The count form: 1.0."""
        if self.by_size is None:
            return 1.0
        g = self.count
        return cut_size(self.counts[self.replica] * self.by_size, g, j) / self.by_size

    def loss_scale(self, *, framework_divides_by_accumulation: bool) -> float:
        """The factor for each micro-loss that makes the DP mean the even split's gradient.

        Frameworks that divide every micro-loss by the configured accumulation steps
        ``G = M / D`` and sum them need nothing more (1.0): ``m_r`` losses over ``G`` is the
        weight ``w_r`` on the replica's mean. After :meth:`keep_global_batch` the framework
        divides by ``G' = configured / D`` and the DP mean by ``D``, so each micro-loss needs
        ``D * G' / M``. A loop that averages over the micro-batches it ran (``1 / m_r``)
        needs ``w_r``."""
        if framework_divides_by_accumulation:
            return self.configured / self.micro_batches
        return self.weight

    def keep_global_batch(self, micro_batches: int) -> tuple[int, ...]:
        """Run a larger old world's global batch of ``micro_batches`` on these replicas
        (odyssey Eq. 12-13: the survivors take the lost replicas' micro-batches): counts as even
        as they go, the first ``M mod D`` replicas one more. Before any loader is built (a
        restore runs at the session's start). Returns the counts."""
        if self.samplers:
            raise FailslowError(
                "keep_global_batch: a data loader was built before the restore; build it "
                "after the failslow session started"
            )
        if micro_batches < self.replicas * self.minimum:
            raise ConfigError(
                f"a global batch of {micro_batches} micro-batches cannot give each of "
                f"{self.replicas} DP replicas at least {self.minimum}"
            )
        counts = even_counts(micro_batches, self.replicas)
        self.micro_batches = micro_batches
        self.counts = counts
        self._pending_samplers = []  # positions in the old world's layout: steps say it all
        return counts

    # ---- the two phases of a plan ------------------------------------------------------------
    def check(self, plan: MicroBatchPlan) -> tuple[int, ...]:
        """The plan's counts if this job can run them, else ConfigError (changes nothing)."""
        counts = check_counts(plan.counts, replicas=self.replicas, micro_batches=self.micro_batches)
        if min(counts) < self.minimum:
            unit = "micro-batch" if self.minimum == 1 else "micro-batches"
            raise ConfigError(
                f"micro-batch counts {list(counts)}: every DP replica of a {self.framework} "
                f"job must run at least {self.minimum} {unit} per step"
            )
        if self.by_size is not None and min(counts) * self.by_size < self.count:
            raise ConfigError(
                f"micro-batch counts {list(counts)}: a replica's {min(counts) * self.by_size} "
                f"samples per step cannot fill the {self.count} micro-batches the training "
                f"loop runs on every replica (at least {-(-self.count // self.by_size)} of "
                f"{self.by_size} samples each)"
            )
        return counts

    def ready(self, plan: MicroBatchPlan) -> tuple[int, ...]:
        """:meth:`check`, and that this rank can run the plan's data share: a rank that reads
        data must read it through a share-aware loader failslow re-cuts per plan
        (ConfigError naming what to build otherwise). Changes nothing."""
        counts = self.check(plan)
        if not self.reads_data():
            return counts
        if not self.samplers:
            raise ConfigError(
                f"micro-batch counts {list(counts)}: this rank reads its micro-batches from a "
                f"loader failslow does not re-cut per plan, so its replica would read more or "
                f"fewer batches of its own stream than the plan's share; {self.loader_hint}"
            )
        first, now = self._training_steps()
        last = now - 1  # the last step that ran to its end in this process
        if first is not None and last >= first and not any(s.read_in(last) for s in self.samplers):
            raise ConfigError(
                f"micro-batch counts {list(counts)}: step {last} trained on micro-batches the "
                "share-aware loader did not hand out (the loop reads a loader of its own), so "
                f"a plan would not change this replica's data; {self.loader_hint}"
            )
        return counts

    def verify(self, plan: MicroBatchPlan, step: int, forwards: int) -> str:
        """What this rank ran in ``step`` (``plan``'s apply step) against ``plan``: "" when
        it ran its replica's count with its weight on its share, else one line saying what it
        ran. ``forwards``: the training forwards the session's step profile counted in the
        step (the adapters announce every one); the rest is read from the share-aware loaders
        and the framework's scale of the micro-losses."""
        if self.by_size is not None:
            return self._verify_size(plan, step, forwards)
        want = plan.counts[self.replica]
        per = self.forwards_per_micro_batch
        if self.count != want:
            return f"its split runs {self.count} micro-batches per step, the plan {want}"
        if forwards != want * per:
            ran = f"{forwards // per}" if forwards % per == 0 else f"{forwards / per:.2f}"
            return (
                f"ran {ran} micro-batches in step {step}, the plan gives its replica {want} "
                "(the training loop decides the count, not failslow)"
            )
        scale = self.micro_loss_scale()
        if scale is not None:
            weight = want * scale
            if abs(weight - plan.weights[self.replica]) > 1e-6 * max(1.0, abs(weight)):
                return (
                    f"weighted its gradient {weight:.6g} in step {step} ({want} micro-losses "
                    f"x {scale:.6g}), the plan {plan.weights[self.replica]:.6g}"
                )
        reads = [sampler.read_in(step) for sampler in self.samplers]
        wrong = [r for r in reads if r and r != want]
        if wrong:  # whoever reads them (a middle pipeline stage may read none)
            return (
                f"read {wrong[0]} micro-batches of step {step} from the share-aware loader, the "
                f"plan gives its replica {want}"
            )
        if not self.reads_data():
            return ""
        if not self.samplers:
            return (
                f"read its micro-batches of step {step} from a loader failslow does not re-cut; "
                f"{self.loader_hint}"
            )
        if not any(reads):
            return (
                f"read none of step {step}'s micro-batches from the share-aware loader (the "
                "loop feeds other data)"
            )
        return ""

    def _verify_size(self, plan: MicroBatchPlan, step: int, forwards: int) -> str:
        """:meth:`verify` in the size form: the loop's ``G`` micro-batches, holding the
        replica's ``counts[r] * unit`` samples of the step."""
        assert self.by_size is not None
        if forwards != self.count * self.forwards_per_micro_batch:
            return (
                f"ran {forwards} training forwards in step {step}, the loop's "
                f"{self.count} micro-batches per step were expected"
            )
        want = plan.counts[self.replica] * self.by_size
        reads = [sampler.read_in(step) for sampler in self.samplers]
        if not any(reads):
            return (
                f"read none of step {step}'s samples through the re-cut loader (the loop feeds "
                "other data)"
            )
        wrong = [r for r in reads if r and r != want]
        if wrong:
            return f"read {wrong[0]} samples in step {step}, the plan gives its replica {want}"
        weight = self._weights.get(step)
        if weight is not None and abs(weight - plan.weights[self.replica]) > 1e-6 * max(
            1.0, abs(weight)
        ):
            return (
                f"weighted its gradient {weight:.6g} in step {step} (its micro-losses' factors "
                f"by their samples), the plan {plan.weights[self.replica]:.6g}"
            )
        return ""

    def apply(self, plan: MicroBatchPlan, step: int) -> None:
        """Run ``plan``'s counts from global step ``step`` on (every tracked loader too)."""
        counts = self.check(plan)
        for sampler in self.samplers:
            sampler.set_counts(counts, step=step)
        self.counts = counts

    def set_replica(self, replica: int, step: int, part: int | None = None) -> None:
        """Run as DP replica ``replica`` from global step ``step`` on (a topology swap gave this
        rank another role); every tracked loader reads that replica's share from ``step``
        (``part``: this rank's part of each of its micro-batches, where a replica's ranks
        split them). FailslowError if a loader already handed out micro-batches of ``step``."""
        if not 0 <= replica < self.replicas:
            raise ConfigError(f"replica must be in [0, {self.replicas}), got {replica}")
        for sampler in self.samplers:
            if sampler.has_read(step):
                raise FailslowError(
                    f"the data loader already read step {step} as replica {self.replica}; "
                    "a topology swap needs a loader that does not read ahead (num_workers=0)"
                )
        for sampler in self.samplers:
            sampler.replica = replica
            if part is not None:
                sampler.part = part
        self.replica = replica

    # ---- data --------------------------------------------------------------------------------
    def track(self, sampler: StepPlans) -> None:
        """Keep ``sampler`` in step with the plans applied here (restoring its position first
        when this rank resumed from a snapshot before the loader existed)."""
        if self._pending_samplers:
            sampler.load_state_dict(self._pending_samplers.pop(0))
        sampler.before_step = self._before_data
        self.samplers.append(sampler)

    def _before_data(self, step: int) -> None:
        """A tracked loader is about to read ``step``: register the plans decided for it."""
        if self._plans_for_data is None:
            return
        for apply_step, plan in self._plans_for_data(step):
            if isinstance(plan, MicroBatchPlan):
                counts = self.check(plan)
                for sampler in self.samplers:
                    sampler.set_counts(counts, step=apply_step)

    def loader(
        self,
        dataset: Any,
        *,
        micro_batch_size: int,
        start_step: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        part: int = 0,
        parts: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> Any:
        """A DataLoader of this replica's exact share of every global batch, one micro-batch
        per item, steps numbered from ``start_step`` (:func:`~.data.share_loader`; ``part`` of
        ``parts``: this rank's part of each where the replica's ranks split its micro-batches;
        in the size form the loop's ``G`` micro-batches of the replica's samples), tracked."""
        if self.by_size is not None and micro_batch_size != self.by_size:
            raise ConfigError(
                f"a loader of micro-batches of {micro_batch_size} samples, where plans are "
                f"sized in units of {self.by_size}"
            )
        loader = share_loader(
            dataset,
            micro_batch_size=micro_batch_size,
            micro_batches=self.micro_batches,
            replica=self.replica,
            replicas=self.replicas,
            counts=self.counts,
            shuffle=shuffle,
            seed=seed,
            start_step=start_step,
            part=part,
            parts=parts,
            by_size=self.by_size is not None,
            collate_fn=collate_fn,
            **loader_kwargs,
        )
        self.track(loader.batch_sampler)
        return loader

    def step_batches(self, data: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
        """This replica's micro-batches of one step from ``data``: ``(batch, is_last)``."""
        count = self.count
        for i in range(count):
            try:
                batch = next(data)
            except StopIteration:
                raise FailslowError(
                    f"the data ran out after {i} of this replica's {count} micro-batches; "
                    "use a repeating loader"
                ) from None
            yield batch, i == count - 1

    # ---- snapshots ---------------------------------------------------------------------------
    def state_dict(self, step: int) -> dict[str, Any]:
        """Counts and loader positions as of the start of global step ``step`` (a snapshot at
        that step boundary; loaders may have read ahead)."""
        return {
            "counts": list(self.counts),
            "samplers": [sampler.state_dict(at_step=step) for sampler in self.samplers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Counts and loader positions of a snapshot of this world. Its global batch is the
        counts' sum: a world that went on from a larger one's snapshots kept that one's
        (:meth:`keep_global_batch`), and an in-place restart of it keeps it too."""
        self.counts = tuple(int(c) for c in state["counts"])
        self.micro_batches = sum(self.counts)
        pending = list(state["samplers"])
        for sampler in self.samplers:
            if pending:
                sampler.load_state_dict(pending.pop(0))
        self._pending_samplers = pending
