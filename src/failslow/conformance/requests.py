"""How the suite asks a session for each capability (DESIGN.md: unsupported fails loudly).

One entry per :class:`~failslow.capabilities.Capabilities` field: a request that exercises the
capability through the session the way a user or the controller does (``session.schedule`` for
plans: a no-op plan for the step after the last one run, so nothing changes). For a capability
the adapter declares unsupported, the request must raise
:class:`~failslow.capabilities.Unsupported` carrying the declared reason; for a supported one it
must not raise. Snapshots and hot update have no session entry point yet, so their request is
the capability check the session will make before calling the adapter, plus the adapter's hook,
which must refuse (raise ``Unsupported``) or answer nothing (``None``) - never a result. Later
issues replace those two entries with the session calls they add.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from failslow.capabilities import Unsupported
from failslow.core.planner.allocation import even_plan
from failslow.core.planner.plans import TopologyPlan
from failslow.runtime.session import Session


def _microbatch_plans(session: Session) -> None:
    session.schedule(even_plan(session.topology), session.step + 1)


def _topology_plans(session: Session) -> None:
    identity = TopologyPlan(hosts=session.topology.hosts)  # every role stays where it is
    session.schedule(identity, session.step + 1)


def _snapshots(session: Session) -> None:
    if not session.capabilities.supports("snapshots"):
        answer = session.pm.hook.failslow_snapshot_state(step=session.step)
        if answer is not None:  # a silent snapshot from an adapter that declared none
            raise AssertionError("snapshots declared unsupported, yet the hook returned state")
    session.capabilities.require("snapshots")


def _hot_update(session: Session) -> None:
    if not session.capabilities.supports("hot_update"):
        answer = session.pm.hook.failslow_hot_update(code={}, step=session.step)
        if answer is not None:
            raise AssertionError("hot_update declared unsupported, yet the hook applied it")
    session.capabilities.require("hot_update")


REQUESTS: dict[str, Callable[[Session], None]] = {
    "microbatch_plans": _microbatch_plans,
    "topology_plans": _topology_plans,
    "snapshots": _snapshots,
    "hot_update": _hot_update,
}
"""Capability name -> a request through the session (checked by AbstractCapabilityTests)."""


def request_each(session: Session) -> dict[str, dict[str, Any]]:
    """Ask for every capability; record what was declared and what the request raised."""
    caps = session.capabilities
    outcome: dict[str, dict[str, Any]] = {}
    for name in caps.names():
        request = REQUESTS.get(name, lambda s, name=name: s.capabilities.require(name))
        record: dict[str, Any] = {"declared": getattr(caps, name), "raised": None}
        try:
            request(session)
        except Unsupported as exc:
            record.update(
                raised="Unsupported", message=str(exc), capability=exc.capability, reason=exc.reason
            )
        except Exception as exc:
            record.update(
                raised=type(exc).__name__, message=str(exc), traceback=traceback.format_exc()
            )
        outcome[name] = record
    return outcome
