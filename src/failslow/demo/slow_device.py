"""The ``device`` fault: a rank whose device computes ``factor`` times slower while its host and
its part in the collectives run at full speed - a GPU throttled by heat or power, a degraded
clock (greyhound 3.2, Case 2: GPU degradation; the SIGSTOP throttle of
:class:`failslow.faults.DutyCycleThrottle` is Case 1, CPU contention, and stops the whole
process, collectives included).

On the CPU demos a "device" is the rank's training thread: :class:`SlowDevice` is a
``TorchDispatchMode`` on it that measures the CPU time of every operator the thread runs
(forward, backward - the autograd engine runs a CPU graph on the thread that called
``backward`` and carries the mode with its thread-local state - and the optimizer) and then
waits ``factor - 1`` times as long, as a device whose kernels take ``factor`` times as long
would keep its host waiting. CPU time, not wall time: where ranks share cores (4 ranks on the
2 cores here) an operator's wall time depends on how busy the others are, so a slowdown in
wall time grows and shrinks with the load a plan moves; the thread's own CPU time is the work
it did, which a slower device takes ``factor`` times as long whatever the others do (one
intra-op thread per rank, as the demos run: the thread's CPU time is the operator's). The
communication operators (``c10d``, ``_c10d_functional``: gloo's all-reduce, reduce-scatter,
all-gather, p2p) pass untimed, so a collective takes as long as on a healthy rank and a share
of work taken off the rank shrinks its step in proportion - the fault S2's size form is for
(issue 46: the SIGSTOP throttle slows every micro-step's reduce-scatter too, which smaller
micro-batches cannot shorten). The wait is a sleep (a slow device does not keep its host's
CPU busy), paid once at least :data:`MIN_WAIT_S` is owed (a sleep of a few microseconds costs
tens), the rest carried to the next operator.

The demo launcher switches it on and off from outside through a small JSON file
(``$FAILSLOW_DEMO_SLOW_DEVICE``, :func:`switch`): ``{"rank": R, "factor": F}`` while the fault
lasts, absent otherwise. Every rank loads this module as a plugin (``$FAILSLOW_PLUGINS``) and
looks at the file once per step, at its step boundary (:func:`failslow_on_step`, on the
training thread: a dispatch mode is the thread's), so the fault starts and ends at a step
boundary. The validation GEMM of a pause on that thread is slowed with it: the device is slow,
whatever it runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from failslow import hookimpl
from failslow.errors import ConfigError

ENV = "FAILSLOW_DEMO_SLOW_DEVICE"
"""The switch file's path, set in every rank's environment by the demo launcher."""
MIN_WAIT_S = 0.0005
"""The least a rank owes before it sleeps (shorter waits ride on the next operator's)."""
COMMUNICATION = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
"""Operator namespaces that are the rank's part in a collective, not its device's compute."""


def switch(path: Path, rank: int | None, factor: float = 4.0) -> None:
    """The launcher's side: rank ``rank``'s device ``factor`` times slower from its next step
    boundary on; ``rank=None`` ends the fault (the file goes)."""
    if rank is None:
        path.unlink(missing_ok=True)
        return
    if not factor >= 1.0:
        raise ConfigError(f"slow device: factor must be >= 1, got {factor}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": int(rank), "factor": float(factor)}))
    tmp.replace(path)


class SlowDevice:
    """A dispatch mode that makes every non-communication operator of the thread that entered
    it take ``factor`` times its CPU time (see the module docstring). ``waited_s``: what it
    added so far; ``timed_s``: the operators' own CPU time."""

    def __init__(self, factor: float) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        if not factor >= 1.0:
            raise ConfigError(f"slow device: factor must be >= 1, got {factor}")
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func.namespace in COMMUNICATION:
                    return func(*args, **(kwargs or {}))
                start = time.thread_time()
                out = func(*args, **(kwargs or {}))
                outer._owe(time.thread_time() - start)
                return out

        self.factor = factor
        self.timed_s = 0.0
        self.waited_s = 0.0
        self._debt = 0.0
        self._mode = _Mode()

    def _owe(self, elapsed: float) -> None:
        self.timed_s += elapsed
        self._debt += (self.factor - 1.0) * elapsed
        if self._debt >= MIN_WAIT_S:
            start = time.perf_counter()
            time.sleep(self._debt)
            slept = time.perf_counter() - start
            self.waited_s += slept
            self._debt -= slept

    def __enter__(self) -> SlowDevice:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


_active: SlowDevice | None = None
_seen: tuple[tuple[int, int], float | None] | None = None
"""The switch file's (mtime_ns, size) when last read, and this rank's factor from it: the
file is read again only when it changed (one ``stat`` per step on every rank)."""


def _wanted() -> float | None:
    """This rank's factor from the switch file now (None: no fault here)."""
    global _seen
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _seen = None
        return None
    key = (st.st_mtime_ns, st.st_size)
    if _seen is not None and _seen[0] == key:
        return _seen[1]
    try:
        spec: Any = json.loads(Path(path).read_text())
        rank, factor = int(spec["rank"]), float(spec["factor"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # mid-replace or gone: as if off, read again next step
    _seen = (key, factor if str(rank) == os.environ.get("RANK") else None)
    return _seen[1]


@hookimpl
def failslow_on_step(step: int, step_time_s: float) -> None:
    """At the step boundary (the training thread): the fault on or off as the file says."""
    global _active
    factor = _wanted()
    if _active is not None and (factor is None or factor != _active.factor):
        _active.__exit__(None, None, None)
        _active = None
    if factor is not None and _active is None:
        _active = SlowDevice(factor).__enter__()
