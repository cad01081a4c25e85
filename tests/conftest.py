"""Shared test helpers: a real ``redis-server`` on 127.0.0.1 on a free port.

The Redis backend of the control store (greyhound section 6; DESIGN.md channel 2) is tested
against the real server from the Debian package ``redis-server`` (``./dev test`` installs it),
also with a password and over TLS (a CA and a server certificate made with ``openssl`` per
test).
When it is missing the Redis tests fail with a message saying so, unless
``FAILSLOW_SKIP_REDIS=1`` is set, which skips them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

REDIS_MISSING = (
    "redis-server is not installed: install the Debian package "
    "(apt-get install -y redis-server, which ./dev test does) or set FAILSLOW_SKIP_REDIS=1"
)


SPAWNED_WORLDS = "spawned-worlds"
BESIDE = "beside-the-worlds"
"""``./dev test`` runs the suite on two xdist workers (``-n 2 --dist loadgroup``) as two work
units (issue 49: the suite's 30 minutes):

- :data:`SPAWNED_WORLDS`: every test marked ``multiprocess`` (it spawns a world) and not
  ``untimed``, on one worker, in collection order, one at a time, at normal CPU priority. These
  are the tests whose outcome a busy machine can move: a straggler found by its step times, a
  hang by its silence, a healthy job that must raise nothing.
- :data:`BESIDE`: the single-process tests and the ``untimed`` worlds (what they assert holds at
  any speed: parameters, records, exit codes, with generous deadlines), on the other worker, in
  collection order, at a lower CPU priority (:data:`BESIDE_NICE`): they run on what the timed
  worlds leave idle and cannot take more than a small share from them when both want the cores.

The timed worlds marked ``quiet`` (a healthy job must raise nothing: their outcome moves with
any load beside them) run last, once every :data:`BESIDE` test has finished: the controller's
scheduler creates the file ``$FAILSLOW_TEST_BESIDE_DONE`` names then, and the timed worker waits
for it before a ``quiet`` test (:func:`pytest_runtest_protocol`; by then it is usually there).

xdist's own ``loadgroup`` reads ``xdist_group`` marks from a suffix it adds to each node id, which
pytest 9.2's structured node ids ignore (pytest-dev/pytest-xdist#1386: the tests are then spread
as if unmarked). So the workers write the timed worlds' ids to a file the controller named
(:data:`_WORLDS_FILE`) while they collect, and the controller's scheduler
(:func:`pytest_xdist_make_scheduler`) reads it once every worker has collected."""
_WORLDS_FILE = "FAILSLOW_TEST_WORLDS_FILE"
_BESIDE_DONE = "FAILSLOW_TEST_BESIDE_DONE"
QUIET_WAIT_S = 1200.0
"""The longest a ``quiet`` test waits for the :data:`BESIDE` tests (a worker that crashed never
finishes them: the test then runs beside whatever is left)."""
BESIDE_NICE = 5
"""The niceness the :data:`BESIDE` worker (and every process it starts) runs at. Linux's
scheduler weighs nice 0 against nice 5 as 1024 to 335, so when both workers want both cores the
timed worlds keep three quarters of the CPU - less than a one-core busy loop at nice 0 takes
from them, beside which the timed e2e tests are checked - and the untimed work still gets a
quarter (its deadlines are minutes for tests of seconds)."""


def _timed_world(item: pytest.Item) -> bool:
    return (
        item.get_closest_marker("multiprocess") is not None
        and item.get_closest_marker("untimed") is None
    )


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="failslow-worlds-", suffix=".txt")
        os.close(fd)
        os.environ[_WORLDS_FILE] = path  # the workers start after this and inherit it
        done = f"{path}.beside-done"
        os.environ[_BESIDE_DONE] = done  # created by the scheduler, not now
        config.add_cleanup(lambda: [Path(f).unlink(missing_ok=True) for f in (path, done)])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``quiet`` tests last (every process sorts the same way, so the workers' collections
    stay equal), and a worker's timed-world tests written to the controller's file (whole or not
    at all: both workers write the same ids)."""
    items.sort(key=lambda item: item.get_closest_marker("quiet") is not None)  # stable
    path = os.environ.get(_WORLDS_FILE)
    if path is None or not hasattr(config, "workerinput"):
        return
    ids = [item.nodeid for item in items if _timed_world(item)]
    part = f"{path}.{config.workerinput['workerid']}"
    Path(part).write_text("".join(f"{i}\n" for i in ids))
    os.replace(part, path)


_niced = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker beside another (the :data:`BESIDE` one), lower this process's CPU
    priority before its first test; the processes its tests start inherit it."""
    global _niced
    workerinput = getattr(item.config, "workerinput", None)
    if _niced or workerinput is None or workerinput.get("workercount", 1) < 2:
        return
    if _timed_world(item) or os.environ.get(_WORLDS_FILE) is None:
        return
    os.nice(BESIDE_NICE)
    _niced = True


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Before a ``quiet`` test on an xdist worker beside another, wait until the
    :data:`BESIDE` tests have finished (before pytest-timeout's clock starts)."""
    done = os.environ.get(_BESIDE_DONE)
    workerinput = getattr(item.config, "workerinput", None)
    if done and workerinput and workerinput.get("workercount", 1) >= 2:
        if item.get_closest_marker("quiet") is not None:
            deadline = time.monotonic() + QUIET_WAIT_S
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(1.0)
    yield


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: xdist's scope scheduler with two scopes, :data:`SPAWNED_WORLDS` and
    :data:`BESIDE` (with more workers than two, the others have nothing to do)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    path = os.environ[_WORLDS_FILE]

    done = os.environ[_BESIDE_DONE]

    class TimedWorldsApart(LoadScopeScheduling):
        worlds: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.worlds is None:  # first called once every worker's collection is in
                self.worlds = frozenset(Path(path).read_text().splitlines())
            return SPAWNED_WORLDS if nodeid in self.worlds else BESIDE

        def schedule(self) -> None:
            super().schedule()
            if self.collection is not None and not any(
                BESIDE in work for work in self.assigned_work.values()
            ):
                Path(done).touch()  # nothing runs beside the timed worlds

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            beside = self.assigned_work[node].get(BESIDE)
            if beside is not None and all(beside.values()):
                Path(done).touch()

    return TimedWorldsApart(config, log)


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


@dataclass(frozen=True)
class Tls:
    """A test CA and a server certificate signed by it (EC P-256, one day)."""

    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> Tls:
    """A CA and a server certificate for ``ips`` and ``localhost`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=failslow-test-ca")  # fmt: skip
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=server")
    san = ",".join([*(f"IP:{ip}" for ip in ips), "DNS:localhost"])
    (directory / "server.ext").write_text(
        f"subjectAltName={san}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"
    )
    sign = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1"]
    run("x509", "-req", "-in", "server.csr", *sign, "-out", "server.crt", "-extfile", "server.ext")
    return Tls(directory / "ca.crt", directory / "server.crt", directory / "server.key")


class RedisServer:
    """One ``redis-server`` process; ``stop`` kills it, ``start`` reuses the port. Optionally
    with a password (``requirepass``) and TLS only (``tls``: the plain port is off)."""

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        tls: Tls | None = None,
        host: str = "127.0.0.1",
        unixsocket: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.unixsocket = unixsocket
        """Also listen here (a test reaches a server in another network namespace by it)."""
        self.password = password
        self.tls = tls
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None
        self.argv_prefix: list[str] = []
        """Prepended to the server's command line (``ip netns exec NS`` for another host)."""

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}{self.host}:{self.port}/0"
        return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca))}"

    def _args(self) -> list[str]:
        args = ["--bind", self.host, "--save", "", "--appendonly", "no", "--daemonize", "no"]
        args += ["--loglevel", "warning"]
        if self.unixsocket is not None:
            args += ["--unixsocket", str(self.unixsocket), "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is None:
            return ["--port", str(self.port), *args]
        return [
            "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
            "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
            "--tls-auth-clients", "no", *args,
        ]  # fmt: skip

    def _ready(self) -> bool:
        if self.password is None and self.tls is None and self.host == "127.0.0.1":
            return _ping(self.port)
        import redis

        url = self.url
        if self.unixsocket is not None:
            auth = f":{quote(self.password, safe='')}@" if self.password else ""
            url = f"unix://{auth}{self.unixsocket}?db=0"
        try:
            return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
        except (redis.exceptions.RedisError, OSError):
            return False

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
            [*self.argv_prefix, binary, *self._args()],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout_s
        while not self._ready():
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


@pytest.fixture
def make_redis(tmp_path: Path) -> Iterator[Any]:
    """``make_redis(password=..., tls=True, host=..., argv_prefix=[...])``: a started
    redis-server (TLS with a CA made for this test), all killed at teardown."""
    servers: list[RedisServer] = []

    def make(
        *,
        password: str | None = None,
        tls: bool = False,
        host: str = "127.0.0.1",
        argv_prefix: list[str] | None = None,
        port: int | None = None,
        unixsocket: Path | None = None,
    ) -> RedisServer:
        cert = make_tls(tmp_path / f"tls{len(servers)}", (host,)) if tls else None
        server = RedisServer(port, password=password, tls=cert, host=host, unixsocket=unixsocket)
        server.argv_prefix = list(argv_prefix or [])
        servers.append(server)
        return server.start()

    try:
        yield make
    finally:
        for server in servers:
            server.stop()
