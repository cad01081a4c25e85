"""Shared test helpers: a real ``redis-server`` on 127.0.0.1 on a free port.

The Redis backend of the control store (greyhound section 6; DESIGN.md channel 2) is tested
against the real server from the Debian package ``redis-server`` (``./dev test`` installs it).
When it is missing the Redis tests fail with a message saying so, unless
``FAILSLOW_SKIP_REDIS=1`` is set, which skips them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

REDIS_MISSING = (
    "redis-server is not installed: install the Debian package "
    "(apt-get install -y redis-server, which ./dev test does) or set FAILSLOW_SKIP_REDIS=1"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def unused_port() -> int:
    """A port nothing listens on (bound to 127.0.0.1:0 and released)."""
    return free_port()


def _ping(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1; ``stop`` kills it, ``start`` reuses the port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("FAILSLOW_SKIP_REDIS") == "1":
                pytest.skip("FAILSLOW_SKIP_REDIS=1 and redis-server is not installed")
            pytest.fail(REDIS_MISSING)
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self.process.poll() is not None:
                err = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                pytest.fail(f"redis-server on port {self.port} exited: {err.strip()[:300]}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(
                    f"redis-server on port {self.port} did not answer PING in {timeout_s} s"
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Kill the server by its PID (SIGKILL: a crash, not a clean shutdown)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A running redis-server for this test, killed at teardown."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
