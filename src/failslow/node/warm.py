"""A warm rank process: the interpreter and the training framework already imported, waiting to
be given a rank (byterobust 6.2, warm standbys; 6.1, restarts in place that skip the imports).

``failslow run --nproc-per-node N`` (:mod:`failslow.node.ranks`) starts these with the job's
environment (the capture hook's ``sitecustomize`` included, so the hook is installed as torch is
imported). Each one

1. imports the modules named in ``$FAILSLOW_WARM_PRELOAD`` (default ``torch``; the framework
   too, ``torch,deepspeed``: most of a rank's start-up time here; a name with a leading ``?``
   is optional);
2. tells the launcher ``ready`` on the socket it inherited (``$FAILSLOW_WARM_FD``);
3. waits for one activation message: the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), the
   working directory, optionally a file for its output, and what to run -
   ``["-m", "module", args...]`` or ``["script.py", args...]``, as after ``python``; where a
   code update moved the code directory on ``PYTHONPATH``, the new one takes the old one's
   place on ``sys.path`` (nothing was imported from it: the launcher gives a process that
   preloaded the job's own code only its version);
4. runs it as ``python`` would have (``__main__``, ``sys.argv``, ``sys.path[0]``).

Started as a fork server (``$FAILSLOW_WARM_FORK``, :mod:`failslow.node.fork_server`), the
process stops after step 1 and forks the warm processes on request (:func:`serve_forks`): each
child goes on from step 2 with a socket of its own, the imports already done.

A warm process whose socket closes before an activation (the launcher drained its pool) exits
0 without running anything. A preload that fails is reported on the socket (``error ...``) and
the process exits 1: the launcher says which module could not be imported.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Any

from failslow import envvars


def _receive(sock: socket.socket) -> dict[str, Any] | None:
    chunks = []
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return None  # drained: the launcher closed our socket
        chunks.append(data)
        if data.endswith(b"\n"):
            return dict(json.loads(b"".join(chunks)))


def _run(argv: list[str]) -> None:
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("failslow warm process: -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def _move_pythonpath(old: str, new: str) -> None:
    """``sys.path`` as if the interpreter had started with PYTHONPATH ``new``, not ``old``."""
    if old == new:
        return
    olds = {os.path.abspath(p) for p in old.split(os.pathsep) if p}
    news = [os.path.abspath(p) for p in new.split(os.pathsep) if p]
    stale = [i for i, p in enumerate(sys.path) if os.path.abspath(p) in olds - set(news)]
    at = stale[0] if stale else 0  # PYTHONPATH leads sys.path (its first entry was deleted)
    sys.path[:] = [p for i, p in enumerate(sys.path) if i not in stale]
    present = {os.path.abspath(p) for p in sys.path}
    for offset, path in enumerate(p for p in news if p not in present):
        sys.path.insert(at + offset, path)
    importlib.invalidate_caches()


def _output_to(path: str) -> None:
    """stdout and stderr to ``path`` (truncated), as ``Popen(stdout=f, stderr=STDOUT)``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _capture_where_told() -> None:
    """The Python hook that the job's environment installed as torch was imported records where
    the activation says: a replay group's ranks get a ring directory of their own (else the
    node's analyzer would take them for restarts of the job's ranks), a stop-time check none.
    The LD_PRELOAD shim needs nothing: it reads ``$FAILSLOW_RING_DIR`` at its first NCCL call,
    after the activation set the environment (``tests/nccl_hook/test_shim.py``)."""
    hook = sys.modules.get("failslow.nccl_hook.capture")
    capture = hook.installed() if hook is not None else None
    if capture is None or not capture.active:
        return
    want = os.environ.get(envvars.RING_DIR)
    if want and os.environ.get(envvars.CAPTURE) == "1":
        if os.path.realpath(want) == str(capture.ring_dir):
            return
        hook.uninstall()
        hook.install(want)
    else:
        hook.uninstall()


def _reseed() -> None:
    """A forked process's global random states, as a process of its own would start with them:
    Python's ``random`` is reseeded at fork by Python itself; numpy's global generator (seeded
    from the OS when ``numpy.random`` was imported - in the server, for every child alike) is
    reseeded from the OS here. torch's default generator starts from a fixed seed in every process
    anyway."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def serve_forks(control: socket.socket) -> socket.socket | None:
    """The fork server's loop (:mod:`failslow.node.fork_server`), after its imports: for each
    ``fork`` request (with the new process's socket attached) fork a child in a process group of
    its own and answer ``pid N``; report each child's exit as ``exit PID CODE`` (``CODE`` as
    :attr:`subprocess.Popen.returncode` has it). Returns in a forked child - its socket to the
    launcher, to go on as a warm process - and with None in the server once the launcher closed
    its end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears it
    children: set[int] = set()
    gc.freeze()  # what the imports made is never collected in a child: not copied by the GC
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    control.sendall(b"ready")
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(OSError):
                    os.read(wake_r, 4096)
                continue
            try:
                message, fds, _, _ = socket.recv_fds(control, 64, 1)
            except OSError:
                message, fds = b"", []
            if not message:
                return None  # the launcher is gone or closed the pool: its children go on
            if message != b"fork" or not fds:
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:  # the new warm process: nothing of the server's loop is its
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                control.close()
                with contextlib.suppress(OSError):
                    os.setpgid(0, 0)
                _reseed()
                return socket.socket(fileno=fds[0])
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)  # before the launcher knows the pid: it signals groups
            os.close(fds[0])
            children.add(pid)
            control.sendall(f"pid {pid}".encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            with contextlib.suppress(OSError):
                control.sendall(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())


def main() -> None:
    fd = int(os.environ.pop(envvars.WARM_FD))
    preload = [m for m in os.environ.pop(envvars.WARM_PRELOAD, "torch").split(",") if m]
    fork_server = os.environ.pop(envvars.WARM_FORK, "") == "1"
    sock = socket.socket(fileno=fd)
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]  # python -m put the launcher's directory first; the target sets its own
    for name in preload:
        try:
            importlib.import_module(name.lstrip("?"))
        except Exception as exc:  # reported to the launcher, then exit
            if name.startswith("?") and isinstance(exc, ImportError):
                continue  # optional: not in this version of the framework
            with contextlib.suppress(OSError):
                sock.sendall(f"error cannot import {name}: {exc!r}\n".encode())
            raise SystemExit(f"failslow warm process: cannot import {name}: {exc!r}") from None
    if fork_server:
        forked = serve_forks(sock)
        if forked is None:
            return
        sock = forked
    try:
        sock.sendall(b"ready\n")
    except OSError:
        pass  # the launcher already sent the activation and closed its end: read it
    try:
        message = _receive(sock)
    except OSError:
        return  # the launcher is gone
    sock.close()
    if message is None:
        return
    started_with = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(message["env"])
    _move_pythonpath(started_with, os.environ.get("PYTHONPATH", ""))
    _capture_where_told()
    if message.get("log"):
        _output_to(message["log"])
    if message.get("cwd"):
        os.chdir(message["cwd"])
    _run(list(message["argv"]))


if __name__ == "__main__":
    main()
