"""Every key of the job's control store, defined once (DESIGN.md: the second channel).

Prefixes own a protocol each; the module that speaks the protocol documents the keys below its
prefix. The store backends keep their own bookkeeping keys (``failslow/k/``, ``failslow/i/``,
...) out of this namespace.
"""

from __future__ import annotations

import hmac

JOB = "failslow/job"
"""The job record rank 0's session writes once: topology, capabilities, world size."""
STEPS = "failslow/steps"
"""Rank 0's recent step times (``{"steps": [[step, seconds], ...], "wall": t}``)."""
DIAGNOSES = "failslow/diagnoses"
"""A counter of diagnoses and ``{DIAGNOSES}/{n}``: each diagnosis as JSON."""
VALIDATE = "failslow/validate"
"""Validation rounds: pause requests, the ranks' positions, tasks, results
(:mod:`failslow.core.control.validator`, :mod:`failslow.runtime.agent`)."""
NODE = "failslow/node"
"""What node publishers write: onsets, reliefs, group summaries
(:mod:`failslow.node.publisher`)."""
PROFILE = "profile"
"""Below the node prefix: the controller's counter of summary requests, and per request ``n``
``profile/{n}/ranks``, the ranks whose publishers answered (:mod:`failslow.node.publisher`)."""
TRANSIENTS = "transients"
"""Below the node prefix: a counter of transients and ``transients/{n}``, each one's record
(slowdowns over before they persisted, issue 47: journaled, never acted on)."""
PLANS = "failslow/plans"
"""The two-phase plan channel (:mod:`failslow.core.control.plan_channel`)."""
STANDBYS = "failslow/standbys"
"""``{STANDBYS}/{node}``: the free standby slots of each node's rank launcher
(``{"free": n, "slots": [...], "wall": t}``, written at every launch); S4 evicts no more hosts
than they can replace."""
NODES = "failslow/nodes"
"""The launchers of a job of several nodes (``failslow run --nnodes``): the run's joins, each
launch's rendezvous and its stop (:mod:`failslow.node.nodes`)."""
STATUS = "failslow/status"
"""The control plane's status: state, last diagnosis, plan in effect, last action, newest step
(:class:`failslow.core.control.journal.StatusBoard`; ``failslow top`` reads it)."""


def authorized(record: dict[str, object], token: str | None) -> bool:
    """Whether a request (a pause request, a plan) may act on a rank that holds ``token``: a
    rank without a token takes every request; one with a token only requests that carry it
    (anyone who can reach the store could otherwise stall or restart the job)."""
    if not token:
        return True
    sent = record.get("token")
    return isinstance(sent, str) and hmac.compare_digest(sent.encode(), token.encode())
