"""The rank's side of validation rounds: its agent on the capture's pause trap (greyhound 4.3).

A validation round pauses every rank at the same collective, runs GEMM and link tests, and
resumes (:mod:`failslow.core.control.validator` is the controller side). Inside the rank that
takes three parts: the capture layer's trap, which parks the training thread
(:mod:`failslow.nccl_hook.trap`); the :class:`~failslow.runtime.agent.RankAgent`, which polls the
control store, arms the trap and runs the tasks while parked; and this module, which joins them:
it gives the agent the rank's position on the pause group (the group's next call index and the
iteration's phase, :mod:`failslow.core.control.phase`) and hands the trap the agent's
``while_parked``.

One agent per process (one trap per process), started in one place: :func:`attach` - by the
session (with its store) or, for an unmodified script under ``failslow run --controller``, by
:mod:`failslow.runtime.auto` from ``$FAILSLOW_STORE`` once the capture's ring exists.
:func:`detach` stops it and closes the store it owns; the runtime calls it at exit.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from failslow import envvars
from failslow.core.control.phase import iteration_phase
from failslow.core.control.store import Store
from failslow.runtime.agent import RankAgent

log = logging.getLogger(__name__)


class RankControl:
    """One process's agent on one capture; owns the agent's thread and, if asked, its store."""

    def __init__(self, capture: Any, store: Store, *, owns_store: bool, **options: Any) -> None:
        writer = capture.ensure_ring()
        if writer is None or capture.trap is None:
            raise RuntimeError("failslow: no ring yet; attach after init_process_group")
        self.capture = capture
        self.store = store
        self.owns_store = owns_store
        options.setdefault("position", self.position)
        options.setdefault("park", capture.park_here)
        self.agent = RankAgent(
            store, rank=capture.global_rank, set_header_word=writer.set_header_word, **options
        )
        capture.trap.on_parked = self.agent.while_parked

    def position(self) -> tuple[int, ...] | None:
        """``(group_key, next call_index, *phase)`` of this rank on the pause group, or None
        before the default process group exists or any group spans every rank."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        entry = self.capture.pause_group(dist.get_world_size())
        if entry is None:
            return None
        phase = iteration_phase(self.capture.recent_pause_calls())
        return (entry.key, entry.calls.peek(), *(phase or ()))

    def start(self) -> RankControl:
        self.agent.start()
        return self

    def stop(self) -> None:
        """Stop the agent's thread, unhook it from the trap and disarm it, close the store if
        owned. Once the agent is gone nothing can release a pause it armed: a later collective
        at the target (an exit handler's, a next session's) would park until the trap's own
        timeout, its peers waiting in that collective."""
        self.agent.stop()
        trap = self.capture.trap
        if trap is not None and trap.on_parked == self.agent.while_parked:
            trap.on_parked = None
            if not trap.writer._mm.closed:
                self.agent.disarm()
        if self.owns_store:
            self.store.close()


_lock = threading.Lock()
_current: RankControl | None = None


def attach(capture: Any, store: Store, *, owns_store: bool = False, **options: Any) -> RankAgent:
    """Start this process's rank agent on ``capture``'s trap, talking to ``store`` (a running
    one is stopped first); ``options`` go to :class:`~failslow.runtime.agent.RankAgent`.
    Needs the ring: call after ``init_process_group`` or install capture with the rank known."""
    global _current
    with _lock:
        if _current is not None:
            _current.stop()
            _current = None
        control = RankControl(capture, store, owns_store=owns_store, **options)
        _current = control.start()
        return control.agent


def attach_from_environment(capture: Any) -> RankAgent | None:
    """With ``$FAILSLOW_STORE`` set (``failslow run --controller`` sets it) and no agent yet,
    attach one on a store that reconnects by itself; monitoring never stops training."""
    url = os.environ.get(envvars.STORE)
    if not url or current() is not None:
        return None
    from failslow.core.control.resilient import ResilientStore

    try:
        token = os.environ.get(envvars.JOB_TOKEN) or None
        return attach(capture, ResilientStore(url), owns_store=True, token=token)
    except Exception:
        log.warning("failslow: no control agent (store %s)", url, exc_info=True)
        return None


def follow_steps(steps: Any, profile: Any = None) -> None:
    """The running agent learns the training step from ``steps()`` (a session's): it publishes
    it and can park at a step boundary (:meth:`RankAgent.at_step`); ``profile()`` (the
    session's step profile summary) goes into the same progress record."""
    control = _current
    if control is not None:
        control.agent.steps = steps
        control.agent.profile = profile


def at_step(step: int) -> None:
    """Called by the session before every step: park if a step pause targets ``step``."""
    control = _current
    if control is not None:
        control.agent.at_step(step)


def current() -> RankAgent | None:
    """The running agent of this process, if any."""
    control = _current
    return control.agent if control is not None else None


def detach() -> None:
    """Stop the agent (if any) and close the store it owns: no control thread is left inside
    a store call at interpreter exit."""
    global _current
    with _lock:
        control, _current = _current, None
    if control is not None:
        control.stop()
