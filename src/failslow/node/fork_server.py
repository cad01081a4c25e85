"""The launcher's side of a fork server: one process per environment imports the job's framework
once, and every warm process (a rank, a spare, a stop-time check) is forked from it
(byterobust 6.1-6.2: restarts and standbys that skip the imports).

A warm process started by ``python -m failslow.node.warm`` pays the interpreter, torch and the
framework on its own - seconds of CPU each (``import megatron.core`` about 6 s here, most of it
torch's compiler stack that Megatron's fused kernels pull in). A node of N ranks keeps N spares,
and every restart or stop-time check starts more; on a busy host those imports compete with the
training they are meant to speed up. Forked from a process that imported everything, a warm
process costs a fork and shares the imported code and data with it copy-on-write.

The server (:func:`failslow.node.warm.serve_forks`) is the launcher's child; the warm processes
are the server's, each in a process group of its own (the launcher signals ranks by group, as
before). A warm process's exit status is the server's to collect, so the server reports it on
its socket and :class:`Forked` - the launcher's handle, ``poll``/``wait``/``pid``/
``returncode`` as :class:`subprocess.Popen` has them - reads it there. Should the server die
before a child it forked, that child's status is lost: a child that has exited then reads as
killed (``-SIGKILL``), and the launcher says so once.

Fork safety: the server only imports; it starts no thread of its own and runs no tensor op
(OpenBLAS's idle pool, which numpy starts, has its own fork handlers), as a DataLoader forking
its workers after the same imports does. Each forked child gets a new seed for Python's
``random`` (at fork) and its activation's environment, as a freshly started one would.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from failslow import envvars
from failslow.errors import FailslowError

__all__ = ["ForkServer", "Forked", "available", "read_nowait"]

STATUS_WAIT_S = 5.0
"""How long a child seen to have exited waits for its status from the server."""


def read_nowait(sock: socket.socket) -> bytes | None:
    """What ``sock`` has to read (one message on a message socket), without waiting: None when
    nothing yet, ``b""`` when its peer is gone."""
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def available() -> bool:
    """Whether warm processes can be forked here (Linux: pidfds and descriptor passing)."""
    return sys.platform == "linux" and hasattr(socket, "send_fds") and hasattr(os, "pidfd_open")


class ForkServer:
    """One process that imported ``preload`` with ``env`` and forks warm processes on request."""

    def __init__(
        self, python: str, env: dict[str, str], preload: tuple[str, ...],
        say: Callable[[str], None] = print, log: Path | None = None,
    ) -> None:  # fmt: skip
        """``log``: where the server's own output goes (its imports' messages; default: the
        launcher's). The processes it forks write where their activation says."""
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child_env = dict(env)
        child_env[envvars.WARM_FD] = str(theirs.fileno())
        child_env[envvars.WARM_PRELOAD] = ",".join(preload)
        child_env[envvars.WARM_FORK] = "1"
        try:
            with contextlib.ExitStack() as files:
                output = None if log is None else files.enter_context(log.open("ab"))
                self.process = subprocess.Popen(
                    [python, "-m", "failslow.node.warm"],
                    env=child_env,
                    pass_fds=(theirs.fileno(),),
                    process_group=0,
                    stdout=output,
                    stderr=None if output is None else subprocess.STDOUT,
                )
        except OSError as exc:
            self.sock.close()
            raise FailslowError(f"cannot start a rank process: {exc.strerror}") from None
        finally:
            theirs.close()
        self.ready = False
        self.gone = False
        self._error: str | None = None
        self._pids: list[int] = []
        self._children: dict[int, Forked] = {}
        self._early: dict[int, int] = {}
        """Exits read before their child was handed out (one that died at once)."""
        self._say = say

    # -- messages ------------------------------------------------------------------------------
    def pump(self, timeout: float = 0.0) -> None:
        """Read what the server said (waiting up to ``timeout`` for the first message)."""
        if self.gone:
            return
        wait: float | None = timeout
        while True:
            if wait is not None and wait > 0:
                with selectors.DefaultSelector() as selector:
                    selector.register(self.sock, selectors.EVENT_READ)
                    selector.select(wait)
            data = read_nowait(self.sock)
            if data is None:
                return
            if not data:
                self._lost()
                return
            self._handle(data.decode(errors="replace"))
            wait = None

    def _handle(self, message: str) -> None:
        word, _, rest = message.partition(" ")
        if word == "ready":
            self.ready = True
        elif word == "error":
            self._error = rest
        elif word == "pid":
            self._pids.append(int(rest))
        elif word == "exit":
            pid, code = (int(x) for x in rest.split())
            child = self._children.pop(pid, None)
            if child is not None:
                child._exited(code)
            else:
                self._early[pid] = code

    def _lost(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._children:
            self._say(
                f"the fork server of the warm processes (pid {self.process.pid}) is gone: "
                f"the exit status of {len(self._children)} of its processes is lost"
            )

    def check(self) -> bool:
        """Whether the server finished its imports, without waiting (raises its import
        error, as a warm process that failed to import would)."""
        self.pump()
        if self._error is not None:
            raise FailslowError(f"warm rank process: error {self._error}")
        if self.gone and not self.ready:
            raise FailslowError(
                f"warm rank process: its fork server exited ({self.process.wait()}) "
                "before it was ready"
            )
        return self.ready

    # -- forking -------------------------------------------------------------------------------
    def fork(self) -> tuple[Forked, socket.socket]:
        """A new warm process and the launcher's end of its socket (it says ``ready`` there, and
        reads its activation from it, as one started on its own does). Waits for the server's
        imports."""
        while not self.check():  # asked only once ready: an import error is read, not lost
            self.pump(timeout=1.0)
        ours, theirs = socket.socketpair()
        try:
            with contextlib.suppress(OSError):  # it is gone: said below
                socket.send_fds(self.sock, [b"fork"], [theirs.fileno()])
        finally:
            theirs.close()
        while not self._pids:
            if self.gone:
                ours.close()
                raise FailslowError("cannot start a rank process: its fork server is gone")
            self.pump(timeout=1.0)
        child = Forked(self, self._pids.pop(0))
        if child.pid in self._early:
            child._exited(self._early.pop(child.pid))
        else:
            self._children[child.pid] = child
        return child, ours

    def start(
        self, env: dict[str, str], argv: list[str], *, cwd: str | None = None,
        log: Path | None = None,
    ) -> Forked:  # fmt: skip
        """Fork a process and run ``argv`` (what follows ``python``: ``["-m", module, ...]`` or
        ``["script.py", ...]``) in it with ``env`` - as ``subprocess.Popen([python, *argv])``
        would, the imports skipped; its output to ``log`` (truncated) when given."""
        child, sock = self.fork()
        message = {"env": env, "cwd": cwd or os.getcwd(), "argv": list(argv)}
        if log is not None:
            message["log"] = str(log)
        try:
            sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            child.kill()
            raise FailslowError(f"cannot start {argv}: its process is gone ({exc})") from None
        finally:
            sock.close()
        return child

    def idle(self) -> bool:
        """Whether every process it forked has exited (and was seen to)."""
        self.pump()
        return not self._children

    def close(self) -> None:
        """End the server (the processes it forked are not touched)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.gone = True
        for child in list(self._children.values()):
            child._orphaned()
        self._children.clear()


class Forked:
    """A warm process forked by a :class:`ForkServer`, as the launcher sees it: what
    :class:`subprocess.Popen` offers the rank group (``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``kill``), its status read from the server."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(pid)

    def _exited(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def _orphaned(self) -> None:
        """The server is gone: the status of this process is lost once it exits."""
        self._server = None  # type: ignore[assignment]

    def _has_exited(self) -> bool:
        if self._pidfd is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return False
        readable, _, _ = select.select([self._pidfd], [], [], 0)  # each poll: no epoll set
        return bool(readable)

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        server = self._server
        if server is not None and not server.gone:
            server.pump()
            if self.returncode is not None or not self._has_exited():
                return self.returncode
            deadline = time.monotonic() + STATUS_WAIT_S  # it exited: its status is on its way
            while self.returncode is None and not server.gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                server.pump(timeout=left)  # (another process's message may come first)
            if self.returncode is not None:
                return self.returncode
        if self._has_exited():
            self._exited(-signal.SIGKILL)  # the server that held its status is gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 0.5 if deadline is None else min(deadline - time.monotonic(), 0.5)
            if left <= 0:
                raise subprocess.TimeoutExpired([f"warm process {self.pid}"], timeout or 0.0)
            server = self._server
            if server is not None and not server.gone:
                server.pump(timeout=left)
            else:
                time.sleep(min(left, 0.05))
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
