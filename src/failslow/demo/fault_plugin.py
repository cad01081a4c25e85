"""Faults injected into a demo or test job through the plugin API (issue 18; never in the
core's code paths): a rank that hangs, on one machine, from one step on.

The demo workers register :func:`from_env` on their session's plugin manager when
``FAILSLOW_DEMO_FAULT`` is set, a JSON object:

- ``{"kind": "hang", "slot": S, "step": N}``: the rank running on slot ``S`` (a machine, with
  ``failslow run --slots-as-hosts``) stops in :func:`injected_hang` when step ``N`` ends -
  its training thread never reaches the next collective, so its peers wait in theirs, as behind
  a GPU stuck in a kernel or a data loader that never returns. A rank moved to another slot
  (evicted onto a standby) runs normally: the fault is the machine's.
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


@dataclass
class InjectedFault:
    kind: str
    slot: int
    step: int

    @hookimpl
    def failslow_on_step(self, step: int, step_time_s: float) -> None:
        if step != self.step or os.environ.get(envvars.SLOT) != str(self.slot):
            return
        if self.kind == "hang":
            injected_hang()


def from_env() -> InjectedFault | None:
    """The fault ``$FAILSLOW_DEMO_FAULT`` describes (None: none); ConfigError naming a bad one."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        spec: Any = json.loads(text)
        fault = InjectedFault(str(spec["kind"]), int(spec["slot"]), int(spec["step"]))
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"${ENV}: expected {{'kind', 'slot', 'step'}}, got {text}") from None
    if fault.kind != "hang":
        raise ConfigError(f"${ENV}: kind must be hang, got {fault.kind!r}")
    return fault
