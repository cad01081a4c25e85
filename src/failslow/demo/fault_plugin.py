"""Faults injected into a demo or test job through the plugin API (issue 18; never in the
core's code paths): a rank that hangs, on one machine, from one step on; a rank whose loss
goes NaN.

The demo workers register what :func:`from_env` returns on their session's plugin manager when
``FAILSLOW_DEMO_FAULT`` is set: a JSON object, or a list of them (several faults in one job):

- ``{"kind": "hang", "slot": S, "step": N}``: the rank running on slot ``S`` (a machine, with
  ``failslow run --slots-as-hosts``) stops in :func:`injected_hang` when step ``N`` ends -
  its training thread never reaches the next collective, so its peers wait in theirs, as behind
  a GPU stuck in a kernel or a data loader that never returns. A rank moved to another slot
  (evicted onto a standby) runs normally: the fault is the machine's.
- ``{"kind": "nan", "slot": S, "step": N}``: when step ``N`` ends, the rank on slot ``S`` sets
  one element of its model's first parameter to NaN (:func:`poison`) - a silent corruption, in
  the first launch only (a transient fault: the job's rollback replays step ``N + 1`` cleanly).
  Its loss of step ``N + 1`` is NaN, and so, through the gradient all-reduce, is every rank's
  model after it.
- ``{"kind": "sdc", "slot": S, "step": N}``: from step ``N`` on, in every launch, the machine of
  slot ``S`` computes the gradient of the model's first parameter 10,000 times too large
  (:func:`corrupt`) - silent data corruption in a backward matmul, persistent as a faulty GPU's:
  the all-reduce hands it to every replica, and every rank's loss jumps a step later. A
  reattempt from memory replays it; dual-phase replay finds the machine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from failslow import envvars, hookimpl
from failslow.errors import ConfigError

ENV = "FAILSLOW_DEMO_FAULT"


def injected_hang() -> None:
    """Where a hung rank's training thread stays (its stack names it)."""
    while True:
        time.sleep(0.05)


def poison(model: Any) -> None:
    """One element of ``model``'s first parameter becomes NaN."""
    import torch

    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] = float("nan")


SDC_FACTOR = 1e4


def corrupt(model: Any, active: Any) -> None:
    """While ``active()``, the gradient of ``model``'s first parameter comes out scaled by
    :data:`SDC_FACTOR` (a tensor hook: the corruption happens where the gradient is made)."""
    parameter = next(iter(model.parameters()))
    parameter.register_hook(lambda grad: grad * SDC_FACTOR if active() else grad)


KINDS = ("hang", "nan", "sdc")


@dataclass
class InjectedFault:
    kind: str
    slot: int
    step: int
    model: Any = None
    """The module ``nan`` poisons and ``sdc`` corrupts."""
    current_step: Any = None
    """``sdc``: the step being trained (a callable)."""

    def __post_init__(self) -> None:
        if self.kind == "sdc" and os.environ.get(envvars.SLOT) == str(self.slot):
            corrupt(self.model, lambda: self.current_step() >= self.step)

    @hookimpl
    def failslow_on_step(self, step: int, step_time_s: float) -> None:
        if step != self.step or os.environ.get(envvars.SLOT) != str(self.slot):
            return
        if self.kind == "hang":
            injected_hang()
        elif self.kind == "nan" and os.environ.get(envvars.RESTART, "0") == "0":
            poison(self.model)


def from_env(model: Any = None, current_step: Any = None) -> list[InjectedFault]:
    """The faults ``$FAILSLOW_DEMO_FAULT`` describes (empty: none); ConfigError naming a bad
    one. ``model``: the module a ``nan`` fault poisons or an ``sdc`` one corrupts;
    ``current_step``: the step being trained (``sdc``)."""
    text = os.environ.get(ENV)
    if not text:
        return []
    try:
        specs: Any = json.loads(text)
    except ValueError:
        specs = None
    specs = specs if isinstance(specs, list) else [specs]
    return [_fault(spec, text, model, current_step) for spec in specs]


def _fault(spec: Any, text: str, model: Any, current_step: Any) -> InjectedFault:
    try:
        kind, slot, step = str(spec["kind"]), int(spec["slot"]), int(spec["step"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"${ENV}: expected {{'kind', 'slot', 'step'}}, got {text}") from None
    if kind not in KINDS:
        raise ConfigError(f"${ENV}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind in ("nan", "sdc") and model is None:
        raise ConfigError(f"${ENV}: a {kind} fault needs the job's model (from_env(model=...))")
    if kind == "sdc" and current_step is None:
        raise ConfigError(f"${ENV}: an sdc fault needs the step (from_env(current_step=...))")
    return InjectedFault(kind, slot, step, model, current_step)
