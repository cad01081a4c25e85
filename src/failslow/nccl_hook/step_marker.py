"""Step markers: a record at the end of every optimizer step (greyhound 4.2, iteration time).

greyhound derives an iteration time from the gap between a call and its occurrence one period
later. That gap is the iteration only as far as the call's place in the step stays put: DDP's
first bucket all-reduce is issued mid-backward, and on shared CPUs its offset from the step's
end moves by milliseconds from step to step (``benchmarks/iteration_time_accuracy.py``: 7.6%
median error on DDP). The step's end is where frameworks time their iterations: after
``optimizer.step()``. The Python hook therefore also writes one record there.

torch runs every global optimizer step post-hook
(:func:`torch.optim.optimizer.register_optimizer_step_post_hook`) after any
``torch.optim.Optimizer``'s ``step`` - the optimizer the user's loop steps, or the torch
optimizer inside DeepSpeed's ZeRO or Megatron's distributed optimizer - so no framework or
script needs to change. Frameworks do more after the torch optimizer returns (DeepSpeed's ZeRO
all-gathers the updated parameters before ``engine.step()`` returns, Megatron's distributed
optimizer likewise): on an optimizer's first step the hook finds the outermost ``step`` method
on the stack (the engine's, the wrapper optimizer's) and wraps that class's ``step``, so from
then on the marker is written when it returns - once per call that stepped an optimizer, none
for a gradient-accumulation micro-step. (That first step is not marked: its end is past reach.)
The marker is a record with op :attr:`OpCode.STEP`, ``t_start_ns = t_end_ns`` at the end of the
step, ``group_key`` naming the optimizer and ``call_index`` counting the markers of that key.
The key is computed from what the optimizer steps (its class, parameter count and element
count), not from its identity, so an optimizer rebuilt over the same model keeps its key and two
chained optimizers (Megatron's dense and expert parameters) have two. The iteration tracker
measures iterations between one key's markers (:mod:`failslow.core.tracking.iteration`). Its
cost is one ring write per step.

Only Python jobs write markers: under the C shim alone the tracker keeps the ACF anchor.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

from failslow.core.events import OpCode, Source, group_key
from failslow.core.ring import RingWriter

log = logging.getLogger(__name__)


def optimizer_key(optimizer: Any) -> int:
    """The marker key of an optimizer: equal for optimizers over the same parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    numel = sum(int(p.numel()) for p in params)
    return group_key(f"failslow:step:{type(optimizer).__qualname__}", [len(params), numel])


class StepMarker:
    """Writes a marker into a ring at the end of every optimizer step while it is attached."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._writer_of: Callable[[], RingWriter | None] = lambda: None
        self._keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._steps: dict[int, int] = {}  # markers written per key
        self._open = threading.local()  # .calls: the outer steps running in this thread

    def attach(self, writer_of: Callable[[], RingWriter | None]) -> None:
        """Register the global post-hook; ``writer_of()`` gives the ring writer (or None before
        the ring exists: steps before it are not marked)."""
        global _active
        if self._handle is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._writer_of = writer_of
        self._handle = register_optimizer_step_post_hook(self._after_step)
        _active = self

    def detach(self) -> None:
        global _active
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if _active is self:
            _active = None

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        t = time.monotonic_ns()
        try:
            key = self._keys.get(optimizer)
            if key is None:
                key = self._keys[optimizer] = optimizer_key(optimizer)
                if _wrap_outer_step(optimizer):  # once per optimizer
                    return  # this step's end is past the hook's reach: its marker is lost
            calls = getattr(self._open, "calls", None)
            if calls:  # the outermost step marks the end when it returns
                if calls[0] is None:
                    calls[0] = key
                return
            self._write(key, t)
        except Exception:  # a marker must never break the optimizer step
            log.debug("failslow: step marker failed", exc_info=True)

    def _enter(self) -> tuple[list[int | None], bool]:
        """(this thread's open outer steps, whether this call is the outermost)."""
        calls: list[int | None] | None = getattr(self._open, "calls", None)
        if calls is None:
            calls = self._open.calls = []
        if calls:
            return calls, False
        calls.append(None)  # the key of the first optimizer stepped inside
        return calls, True

    def _leave(self, calls: list[int | None], outermost: bool) -> None:
        if not outermost:
            return
        key = calls.pop() if calls else None
        if key is not None:
            self._write(key, time.monotonic_ns())

    def _write(self, key: int, t: int) -> None:
        writer = self._writer_of()
        if writer is None or writer._mm.closed:
            return
        index = self._steps.get(key, 0)
        self._steps[key] = index + 1
        writer.write(
            t_start_ns=t,
            t_end_ns=t,
            nbytes=0,
            group_key=key,
            op=int(OpCode.STEP),
            source=int(Source.PYTHON),
            call_index=index,
        )


_active: StepMarker | None = None
_WRAPPED = "__failslow_step_marker__"


def _outer_step_owner(optimizer: Any) -> Any:
    """The object of the outermost ``step`` method running now that is not ``optimizer``
    (DeepSpeed's engine, Megatron's or Accelerate's optimizer wrapper), or None."""
    owner = None
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "step":
            obj = frame.f_locals.get("self")
            if obj is not None and obj is not optimizer and callable(getattr(obj, "step", None)):
                owner = obj
        frame = frame.f_back
    return owner


def _wrap_outer_step(optimizer: Any) -> bool:
    """Mark steps where the framework's own ``step()`` returns, not where the torch optimizer
    inside it does: the class of the outermost ``step`` on the stack gets a wrapper that writes
    the marker when an optimizer stepped inside the call (a gradient-accumulation micro-step
    that steps none writes none). The class, not the instance: a copied object keeps calling
    its own method. True when it wrapped a class now (the running call is not wrapped)."""
    owner = _outer_step_owner(optimizer)
    if owner is None:
        return False
    cls = type(owner)
    original = getattr(cls, "step", None)
    if original is None or getattr(original, _WRAPPED, False):
        return False

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        marker = _active
        if marker is None:
            return original(self, *args, **kwargs)
        calls, outermost = marker._enter()
        try:
            return original(self, *args, **kwargs)
        finally:
            try:
                marker._leave(calls, outermost)
            except Exception:
                log.debug("failslow: step marker failed", exc_info=True)

    setattr(step, _WRAPPED, True)
    try:
        cls.step = step
    except (AttributeError, TypeError):  # a class that refuses new attributes
        log.debug("failslow: cannot mark the end of %s.step", cls.__qualname__)
        return False
    return True
