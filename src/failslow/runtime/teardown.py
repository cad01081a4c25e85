"""Clean exits: a job that finished training must never be reported failed because of failslow.

A rank that ends with a thread inside a C++ call that needs the GIL after interpreter
finalization began dies with "terminate called without an active exception" (SIGABRT), and the
launcher reports the job failed. Python 3.11 kills such a thread mid frame; when its stack holds a
``noexcept`` C++ frame (pybind11's GIL guards, destructors), libstdc++ calls ``std::terminate``.
Two kinds of threads do it:

- failslow's own: a rank agent or plan receiver polling the control store (torch's store calls
  release the GIL and take it back on return), the store's reconnect thread;
- the backend's: a gloo worker thread releasing the last reference to a Python object it holds
  (a completion callback, or the context every work launched in backward captures) - upstream
  pytorch/pytorch#190489. ``destroy_process_group()`` at the end of a script joins those threads
  while the interpreter is still alive, unless something (DDP) keeps the group alive.

:func:`install` registers one ``atexit`` handler per process (the runtime calls it when it starts:
a session, or :mod:`failslow.runtime.auto` under ``failslow run``). It runs after the script's
own exit handlers (registered later) and, in this order: closes every session still open (plan
receiver, job report, snapshots, backups), stops the rank agent and its store, quiesces capture
(no new callbacks; waits until torch released the ones it holds), destroys the default process
group if the script did not (saying so in one line) - not after an uncaught exception, when a
peer may be gone - and waits, bounded, until the gloo worker threads are idle.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_installed = False
_crashed = False
_sessions: weakref.WeakSet[Any] = weakref.WeakSet()
GLOO_THREAD = "pt_gloo_runloop"


def install() -> None:
    """Register the exit handler (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    previous = sys.excepthook

    def note_crash(*args: Any) -> None:
        global _crashed
        _crashed = True
        from failslow.runtime import crash_record

        crash_record.record(*args)  # for the launcher: a code update it is traceable to
        previous(*args)

    sys.excepthook = note_crash
    atexit.register(at_exit)


def track(session: Any) -> None:
    """Close ``session`` at exit if the script did not (weakly held)."""
    _sessions.add(session)


def at_exit() -> None:
    """The exit handler (see the module docstring); never raises."""
    for step in (_close_sessions, _stop_rank_control, _quiesce_capture, _destroy_default_group):
        try:
            step()
        except Exception as exc:  # an exit handler must not turn a good exit into a bad one
            sys.stderr.write(f"failslow: at exit, {step.__name__[1:]} failed: {exc!r}\n")
    wait_gloo_idle()


def _close_sessions() -> None:
    for session in list(_sessions):
        session.close()


def _stop_rank_control() -> None:
    from failslow.runtime import rank_control

    rank_control.detach()


def _quiesce_capture() -> None:
    from failslow.nccl_hook import capture

    installed = capture.installed()
    if installed is not None:
        installed.quiesce()


def _destroy_default_group() -> None:
    if _crashed or "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    rank = dist.get_rank()
    dist.destroy_process_group()
    sys.stderr.write(
        f"failslow: rank {rank}: the default process group was still up at exit; failslow "
        "destroyed it (end training with torch.distributed.destroy_process_group())\n"
    )


def _gloo_threads() -> dict[str, tuple[str, int]]:
    """State and context switches of every gloo worker thread of this process, by thread id."""
    found = {}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return found
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() != GLOO_THREAD:
                continue
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        switches = sum(
            int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line
        )
        found[task.name] = (state, switches)
    return found


def wait_gloo_idle(timeout_s: float = 1.0, sample_s: float = 0.01) -> bool:
    """Wait until every gloo worker thread sleeps and did not run between two samples (a
    worker still releasing a work's references is running); bounded, the GIL released while
    waiting. True when they were idle (or there are none)."""
    deadline = time.monotonic() + timeout_s
    before = _gloo_threads()
    while True:
        time.sleep(sample_s)
        now = _gloo_threads()
        if all(state == "S" for state, _ in now.values()) and now == before:
            return True
        if time.monotonic() >= deadline:
            return False
        before = now
