"""Plans in the loop users write: where a training loop stands in its global step (greyhound 5).

Plans take effect at a step boundary, and under a micro-batch plan each DP replica runs its own
count before its optimizer step. Users do not call failslow at either point: they write the
loop their framework's tutorials teach (DeepSpeed's ``loss = engine(x); engine.backward(loss);
engine.step()``, Accelerate's ``accumulate`` loop). :class:`StepTracker` finds both from the
framework's own counters, seen before every training forward:

- a new global step began when the framework's optimizer-step counter moved (or at the first
  forward): the session's step boundary runs there, so a plan due at this step applies before
  the step's first micro-batch runs;
- the micro-batch about to run is this replica's last of the step when the micro-batches the
  framework already counted in this step, plus one, reach the replica's count under the plan in
  effect: the adapter sets its framework's accumulation boundary from that
  (:meth:`StepTracker.follow` installs it as a forward pre-hook).

Forwards without gradients or in eval mode (evaluation inside the loop) are not micro-batches
of a training step and change nothing. :func:`call_model` is the batch convention and
:func:`run_step` the micro-batch loop of the adapters' own ``train_batch``.

Who owns the accumulation loop is part of the same question: where the training loop sets the
framework's accumulation boundary itself (Accelerate's DeepSpeed wrapper does before every
backward, under the Hugging Face Trainer and ``accelerator.backward``), a plan cannot change how
many micro-batches a replica runs. :class:`ForeignCalls` notices it from the first such call.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


class StepTracker:
    """``global_step()`` counts the framework's optimizer steps, ``micro_steps()`` every
    micro-batch it stepped through, ``count()`` is this replica's micro-batches per step under
    the plan in effect, ``begin_step(step)`` is the session's step boundary and
    ``micro_batch()`` (optional) is told of every training micro-batch, after the boundary."""

    def __init__(
        self,
        *,
        global_step: Callable[[], int],
        micro_steps: Callable[[], int],
        count: Callable[[], int],
        begin_step: Callable[[int], None],
        micro_batch: Callable[[], None] | None = None,
    ) -> None:
        self._global_step = global_step
        self._micro_steps = micro_steps
        self._count = count
        self._begin_step = begin_step
        self._micro_batch = micro_batch
        self.step: int | None = None
        """The global step in progress (None before the first)."""
        self._first_micro = 0

    def sync(self) -> int:
        """Begin the step the framework is at if it has not begun yet; returns the step."""
        step = self._global_step()
        if step != self.step:
            self.step = step
            self._first_micro = self._micro_steps()
            self._begin_step(step)
        return step

    @property
    def micro_index(self) -> int:
        """The micro-batch of the step in progress the framework is in (0 for the first: its
        counter moves when a micro-batch's step ends)."""
        return self._micro_steps() - self._first_micro

    def follow(self, module: Any, set_boundary: Callable[[bool], None]) -> Any:
        """Follow the user's own loop: before every training forward of ``module``, begin the
        step if one began and ``set_boundary(is this replica's last micro-batch)``. Returns
        the hook handle (``.remove()`` it to stop)."""

        def before_forward(mod: Any, args: Any) -> None:
            if is_training_forward(mod):
                set_boundary(self.before_micro_batch())

        return module.register_forward_pre_hook(before_forward)

    def before_micro_batch(self) -> bool:
        """Before a training forward: begin a new step if one began; True when this micro-batch
        is this replica's last of the step (its accumulation boundary)."""
        self.sync()
        if self._micro_batch is not None:
            self._micro_batch()
        return self.micro_index + 1 >= self._count()


def is_training_forward(module: Any) -> bool:
    """A forward that belongs to a training step (grad enabled, module in train mode)."""
    import torch

    return torch.is_grad_enabled() and bool(getattr(module, "training", True))


def call_model(
    model: Callable[..., Any], batch: Any, loss_fn: Callable[[Any, Any], Any] | None = None
) -> Any:
    """The loss of one micro-batch: ``loss_fn(model(batch[0]), batch[1])`` with ``loss_fn``,
    else the model's own return for ``model(**batch)`` (a dict), ``model(*batch)`` (a tuple or
    list) or ``model(batch)``."""
    if loss_fn is not None:
        return loss_fn(model(batch[0]), batch[1])
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


def run_step(
    split: Any,
    data: Iterator[Any],
    *,
    forward: Callable[[Any], Any],
    backward: Callable[[Any], Any],
    step: Callable[[], Any],
) -> Any:
    """This replica's micro-batches of one global step (``split.count`` of them from ``data``):
    ``loss = forward(batch); backward(loss); step()`` each, the framework's own accumulation
    (its boundary set by :meth:`StepTracker.follow`); returns the mean loss (no collective)."""
    import torch

    total = torch.zeros(())
    for batch, _ in split.step_batches(data):
        loss = forward(batch)
        backward(loss)
        step()
        total += loss.detach().float()
    return total / split.count


class ForeignCalls:
    """Who else calls ``obj.<name>``: the instance attribute is replaced by a pass-through that
    names the module of its first caller (:attr:`caller`) and then calls ``on_first(caller)``
    once; failslow's own calls go to :attr:`original` and are not counted. :meth:`restore` puts
    the attribute back."""

    def __init__(self, obj: Any, name: str, on_first: Callable[[str], None] | None = None) -> None:
        self.obj, self.name = obj, name
        self.original: Callable[..., Any] = getattr(obj, name)
        self.caller = ""
        """The module that first called it, "" while nobody else has."""
        original = self.original

        @functools.wraps(original)
        def through(*args: Any, **kwargs: Any) -> Any:
            if not self.caller:
                self.caller = str(sys._getframe(1).f_globals.get("__name__", "?"))
                if on_first is not None:
                    try:
                        on_first(self.caller)
                    except Exception:  # never break the framework's own call
                        log.exception("failslow: could not report the loop's own %s", name)
            return original(*args, **kwargs)

        self._through = through
        setattr(obj, name, through)

    def restore(self) -> None:
        if vars(self.obj).get(self.name) is self._through:
            delattr(self.obj, self.name)


LOOP_OWNS_THE_COUNT = (
    "the training loop sets {what} itself (first from {caller}; {who}), so a plan cannot change "
    "how many micro-batches this replica runs per step"
)
"""S2's reason where the loop, not failslow, decides each micro-batch's accumulation boundary."""


class LoopOwner(ForeignCalls):
    """The training loop's own calls of the framework's accumulation-boundary setter
    ``obj.<name>`` (``what``, set by ``who``): from the first, :attr:`reason` is S2's reason
    and rank 0 says it once; ``session`` (None: not attached yet) publishes the job record
    again, so the controller plans from the reason and names it."""

    def __init__(self, obj: Any, name: str, *, what: str, who: str, session: Any) -> None:
        self.what, self.who = what, who
        super().__init__(obj, name, on_first=lambda caller: self._seen(session))

    @property
    def reason(self) -> str:
        """ "" while only failslow set it."""
        if not self.caller:
            return ""
        return LOOP_OWNS_THE_COUNT.format(what=self.what, caller=self.caller, who=self.who)

    def _seen(self, session: Any) -> None:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(
                "failslow: micro-batch plans (S2) cannot take effect in this job: %s", self.reason
            )
        if session is not None:
            session.capabilities_changed()
