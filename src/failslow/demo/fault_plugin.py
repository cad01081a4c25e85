"""Faults injected into a demo or test job through the plugin API (issue 18; never in the
core's code paths): a rank that hangs, on one machine, from one step on; a rank whose loss
goes NaN; a machine whose gradients or matmuls are silently wrong.

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
  slot ``S`` computes the gradient of the model's largest parameter 10,000 times too large
  (:func:`corrupt`) - silent data corruption in a backward matmul, persistent as a faulty GPU's:
  the all-reduce hands it to every replica, and every rank's loss jumps a step later. A
  reattempt from memory replays it; dual-phase replay finds the machine.
- ``{"kind": "matmul", "slot": S, "step": N}``: from step ``N`` on, in every process of the
  machine of slot ``S``, every ``torch.nn.functional.linear`` output comes out
  :data:`MATMUL_FACTOR` times too large (:func:`corrupt_linear`) - a defective device or fused
  kernel. Its loss jumps at step ``N + 1``; the stop-time checks' bitwise-alignment step sees it
  too (this module, registered through ``$FAILSLOW_PLUGINS``, installs it there,
  :func:`failslow_stop_check_start`) and name the machine; the GEMM check (``torch.mm``) does
  not.
- ``{"kind": "slow", "slot": S, "step": N}``: from step ``N`` on, in every launch, the rank on
  slot ``S`` spends :data:`SLOW_S` in :func:`injected_slow_data` after each step - a data
  loader that fell behind, a CPU-bound rank: every rank's step gets slower, yet the validation
  round's GEMM and link tests find every rank healthy (an unexplained decline, byterobust 5.1).
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
    """One element of ``model``'s first parameter becomes NaN (of this rank's shard, where the
    parameter is a sharded DTensor: FSDP2 gathers it into every forward of its replica)."""
    import torch

    parameter = next(iter(model.parameters()))
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    with torch.no_grad():
        local.view(-1)[0] = float("nan")


SDC_FACTOR = 1e4


def corrupt(model: Any, active: Any) -> None:
    """While ``active()``, the gradient of ``model``'s largest parameter (the first of them)
    comes out scaled by :data:`SDC_FACTOR` (a tensor hook: the corruption happens where the
    gradient is made). The largest, not the first: the first of a pipeline stage past the
    first is a norm's weight, whose gradient was small enough that the grad-norm jump only
    just cleared the 5x check (5.9x)."""
    parameter = max(model.parameters(), key=lambda p: p.numel())
    parameter.register_hook(lambda grad: grad * SDC_FACTOR if active() else grad)


MATMUL_FACTOR = 8.0


def corrupt_linear() -> None:
    """From now on, in this process, ``torch.nn.functional.linear`` (every ``nn.Linear``, the
    attention projections) returns its output times :data:`MATMUL_FACTOR` (once per process)."""
    import torch.nn.functional as F

    if getattr(F.linear, "failslow_fault", False):
        return
    exact = F.linear

    def linear(input: Any, weight: Any, bias: Any = None) -> Any:
        return exact(input, weight, bias) * MATMUL_FACTOR

    linear.failslow_fault = True  # type: ignore[attr-defined]
    F.linear = linear


SLOW_S = 0.6


def injected_slow_data() -> None:
    """Where a slow rank spends :data:`SLOW_S` per step (its stack names it)."""
    time.sleep(SLOW_S)


KINDS = ("hang", "nan", "sdc", "matmul", "slow")


@hookimpl
def failslow_stop_check_start(rank: int, incident: dict[str, Any]) -> None:
    """The machine's stop-time checks: a ``matmul`` fault of this slot that began before the
    incident is there too (the device is faulty, whatever runs on it)."""
    for kind, slot, step in _specs():
        here = os.environ.get(envvars.SLOT) == str(slot)
        if kind == "matmul" and here and int(incident.get("step", 0)) > step:
            corrupt_linear()


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
        here = os.environ.get(envvars.SLOT) == str(self.slot)
        if self.kind == "sdc" and here:
            corrupt(self.model, lambda: self.current_step() >= self.step)
        if self.kind == "matmul" and here and self.current_step() > self.step:
            corrupt_linear()  # resumed past the step: the machine is faulty already

    @hookimpl
    def failslow_on_step(self, step: int, step_time_s: float) -> None:
        if os.environ.get(envvars.SLOT) != str(self.slot):
            return
        if self.kind == "slow" and step >= self.step:
            injected_slow_data()
        if step != self.step:
            return
        if self.kind == "hang":
            injected_hang()
        elif self.kind == "nan" and os.environ.get(envvars.RESTART, "0") == "0":
            poison(self.model)
        elif self.kind == "matmul":
            corrupt_linear()


def from_env(model: Any = None, current_step: Any = None) -> list[InjectedFault]:
    """The faults ``$FAILSLOW_DEMO_FAULT`` describes (empty: none); ConfigError naming a bad
    one. ``model``: the module a ``nan`` fault poisons or an ``sdc`` one corrupts;
    ``current_step``: the step being trained (``sdc``, ``matmul``)."""
    faults = []
    for kind, slot, step in _specs():
        if kind in ("nan", "sdc") and model is None:
            raise ConfigError(
                f"${ENV}: a {kind} fault needs the job's model (from_env(model=...))"
            )
        if kind in ("sdc", "matmul") and current_step is None:
            raise ConfigError(
                f"${ENV}: an {kind} fault needs the step (from_env(current_step=...))"
            )
        faults.append(InjectedFault(kind, slot, step, model, current_step))
    return faults


def _specs() -> list[tuple[str, int, int]]:
    """``(kind, slot, step)`` of each fault ``$FAILSLOW_DEMO_FAULT`` describes."""
    text = os.environ.get(ENV)
    if not text:
        return []
    try:
        specs: Any = json.loads(text)
    except ValueError:
        specs = None
    found = []
    for spec in specs if isinstance(specs, list) else [specs]:
        try:
            kind, slot, step = str(spec["kind"]), int(spec["slot"]), int(spec["step"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"${ENV}: expected {{'kind', 'slot', 'step'}}, got {text}"
            ) from None
        if kind not in KINDS:
            raise ConfigError(f"${ENV}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        found.append((kind, slot, step))
    return found
