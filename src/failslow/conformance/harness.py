"""What an adapter provides to the conformance suite: a harness and the jobs it builds.

The suite (DESIGN.md, "Invariants the conformance suite checks for every adapter") is shipped
in the package, fsspec-style: the test mixins (``Abstract*Tests``) hold the checks, and an
adapter opts in with one class that also derives from its :class:`AdapterHarness`::

    class TestDeepSpeedConformance(AbstractAdapterTests, DeepSpeedHarness):
        pass

Every method here raises :class:`NotImplementedError` until the adapter's harness overrides it
(the "required fixtures"). The harness lives in two places at once: in the pytest process it
names the world (``world_size``, :meth:`layouts`, :meth:`rank_env`); in every rank process of
that world (spawned by :mod:`failslow.conformance.world`, after gloo init) it builds jobs
(:meth:`build`). A harness class must therefore be importable by its module path and
constructible without arguments.

What the suite needs from a job is small: the failslow
:class:`~failslow.runtime.session.Session` the adapter drives, one global step on data the
harness owns (:meth:`AdapterJob.run_step`), the parameters (:meth:`AdapterJob.parameters`), how
many micro-batches the rank ran (:meth:`AdapterJob.micro_batches_run`) and, for invariant 1, the
collectives one step must issue (:meth:`AdapterJob.expected_collectives`) - computed from the
model and the layout, never from the capture, so the capture cannot match it by accident.
Capabilities come from the session (``session.capabilities``), declared by the adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from failslow.runtime.session import Session


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective or point-to-point call a step must issue on this rank.

    ``op`` is a :class:`failslow.core.events.OpCode` name (``"ALLREDUCE"``, ``"SEND"``, ...),
    ``group`` the global ranks of its process group (order ignored), ``nbytes`` this rank's
    payload as the capture records it (:mod:`failslow.nccl_hook.c10d_ops`), ``peer`` the global
    rank of the peer or root (-1 for none).
    """

    op: str
    group: tuple[int, ...]
    nbytes: int
    peer: int = -1

    def key(self) -> tuple[str, tuple[int, ...], int, int]:
        return (self.op, tuple(sorted(self.group)), int(self.nbytes), int(self.peer))

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "group": list(self.group), "nbytes": self.nbytes, "peer": self.peer}


class AdapterJob:
    """One training job built by :meth:`AdapterHarness.build` in a rank process."""

    session: Session
    """The failslow session the adapter drives (started, capture on)."""

    def run_step(self, step: int) -> None:
        """Run global step ``step`` (0, 1, ... from the job's start) on the harness's fixed,
        seeded data: the adapter passes ``session.step_boundary(step)`` inside it, so plans
        scheduled with ``session.schedule(plan, step)`` take effect here."""
        raise NotImplementedError

    def parameters(self) -> dict[str, np.ndarray]:
        """This rank's model parameters by name, full values (gathered if sharded), float32.

        Called on every rank at the same point (gathering may be a collective)."""
        raise NotImplementedError

    def micro_batches_run(self) -> int:
        """Micro-batches this rank has run forward since the job was built (the harness owns
        the model, so it counts them, e.g. with a forward pre-hook)."""
        raise NotImplementedError

    def samples_read(self) -> Sequence[int] | None:
        """The dataset indices of every sample this rank's training forwards have read since
        the job was built, in order, as the harness sees them in the model's input (None: not
        tracked here; the size form of invariant 2 needs them). Ranks that read no data (a
        pipeline's later stages) return an empty sequence."""
        return None

    def expected_collectives(self, step: int) -> Sequence[Collective] | None:
        """Every collective global step ``step`` issues on this rank under the even split, as
        a multiset; ``None`` marks a step the harness does not model (at most half of them,
        for example a first step that also fetches ZeRO-3 parameters)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the job (close the session, free the engine); the rank keeps running."""
        raise NotImplementedError


class AdapterHarness:
    """The adapter's required fixtures (fsspec's ``AbstractFixtures``)."""

    world_size: int
    """Ranks in the spawned world (2-4). A subclass sets it as a class attribute."""

    world_timeout_s: float = 240.0
    """The whole world (every layout's scenarios) must finish within this long."""

    def layouts(self) -> Sequence[str]:
        """Names of the parallel layouts to check ("zero0", "pipeline", ...)."""
        raise NotImplementedError

    def rank_env(self) -> Mapping[str, str]:
        """Extra environment for the rank processes (for example ``DS_ACCELERATOR=cpu``)."""
        return {}

    def setup_rank(self) -> None:
        """Called once in each rank process after ``init_process_group("gloo")`` and the
        capture install, before the first :meth:`build` (framework-level init)."""

    def build(
        self, layout: str, seed: int, failslow: Mapping[str, Any] | None = None
    ) -> AdapterJob:
        """A fresh job for ``layout``: same ``seed``, same model and data, every time.

        ``failslow``: settings merged into the job's failslow block (the snapshot scenario
        turns on ``checkpoint``); the harness keeps ``capture`` on."""
        raise NotImplementedError

    # ---- pytest side ---------------------------------------------------------------------------
    @classmethod
    def harness_class(cls) -> type[AdapterHarness]:
        """The most derived harness in this class's bases, not the test class itself (the
        worker imports it by ``module:Class``)."""
        for klass in cls.__mro__:
            if (
                issubclass(klass, AdapterHarness)
                and klass is not AdapterHarness
                and not getattr(klass, "_conformance_tests", False)
            ):
                return klass
        raise NotImplementedError(f"{cls.__name__}: no AdapterHarness subclass in its bases")
