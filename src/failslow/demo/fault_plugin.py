"""Faults injected into a demo or test job through the plugin API (issue 18; never in the
core's code paths): a rank that hangs, on one machine, from one step on; a rank whose loss
goes NaN.

The demo workers register :func:`from_env` on their session's plugin manager when
``FAILSLOW_DEMO_FAULT`` is set, a JSON object:

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


KINDS = ("hang", "nan")


@dataclass
class InjectedFault:
    kind: str
    slot: int
    step: int
    model: Any = None
    """The module ``nan`` poisons."""

    @hookimpl
    def failslow_on_step(self, step: int, step_time_s: float) -> None:
        if step != self.step or os.environ.get(envvars.SLOT) != str(self.slot):
            return
        if self.kind == "hang":
            injected_hang()
        elif self.kind == "nan" and os.environ.get(envvars.RESTART, "0") == "0":
            poison(self.model)


def from_env(model: Any = None) -> InjectedFault | None:
    """The fault ``$FAILSLOW_DEMO_FAULT`` describes (None: none); ConfigError naming a bad one.
    ``model``: the module a ``nan`` fault poisons."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        spec: Any = json.loads(text)
        fault = InjectedFault(str(spec["kind"]), int(spec["slot"]), int(spec["step"]), model)
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"${ENV}: expected {{'kind', 'slot', 'step'}}, got {text}") from None
    if fault.kind not in KINDS:
        raise ConfigError(f"${ENV}: kind must be one of {', '.join(KINDS)}, got {fault.kind!r}")
    if fault.kind == "nan" and model is None:
        raise ConfigError(f"${ENV}: a nan fault needs the job's model (from_env(model=...))")
    return fault
