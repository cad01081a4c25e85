"""The warm processes' fork server (failslow.node.fork_server, failslow.node.warm.serve_forks):
a node's ranks and spares pay the preloads' import once, each rank is still a process of its
own (its own group, its exit status as the launcher's ``Popen`` would report it), and a server
that dies under its children is said, not silently taken for their exits.

Real processes: the preload is a module of the test's that writes down every process that
imports it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from failslow.node.fork_server import ForkServer, available
from failslow.node.ranks import LocalRanks, RankOptions

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not available(),
        reason="the fork server is Linux-only (pidfds, socket.send_fds); elsewhere "
        "failslow run starts each rank process on its own, as test_ranks.py checks",
    ),
]

JOB = textwrap.dedent(
    """
    import json, os, sys
    rank = os.environ["RANK"]
    import numpy, random
    record = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
              "imported": "heavy" in sys.modules, "code": int(os.environ.get("CODE", "0")),
              "draws": [float(numpy.random.rand()), random.random()]}
    with open(os.path.join(sys.argv[1], f"rank{rank}-{os.getpid()}.json"), "w") as f:
        json.dump(record, f)
    sys.exit(record["code"] if rank == "1" else 0)
    """
)


def _setup(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "heavy.py").write_text(
        "import os\n"
        "import numpy.random  # seeded at import (torch imports it): in the fork server\n"
        f"with open({str(tmp_path / 'imports')!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
    )
    (tmp_path / "job.py").write_text(JOB)
    path = os.pathsep.join([str(lib), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return lib, {**os.environ, "PYTHONPATH": path}


def _launch(tmp_path: Path, ranks: LocalRanks, env: dict[str, str], name: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    group = ranks.spawn([str(tmp_path / "job.py"), str(out)], env, str(tmp_path))
    group.wait(timeout=60)
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("fork_server", [True, False])
def test_ranks_and_spares_import_the_preloads_once_per_node(
    tmp_path: Path, fork_server: bool
) -> None:
    _, env = _setup(tmp_path)
    ranks = LocalRanks(
        RankOptions(nproc=3, preload=("heavy",), refill_delay_s=0.0, fork_server=fork_server),
        say=lambda _: None,
    )
    try:
        first = _launch(tmp_path, ranks, env, "first")
        deadline = time.monotonic() + 60
        while ranks.ready_spares() < 3 and time.monotonic() < deadline:
            ranks.tick()
            time.sleep(0.02)
        assert ranks.ready_spares() == 3
        second = _launch(tmp_path, ranks, env, "second")  # the restart takes the spares
    finally:
        ranks.close()
    importers = (tmp_path / "imports").read_text().split()
    records = first + second
    assert len(records) == 6 and all(r["imported"] for r in records)
    assert all(r["pgid"] == r["pid"] for r in records)  # each rank leads its own group
    # unseeded random draws differ between ranks, as between processes started on their own
    for i in range(2):  # numpy's global generator, Python's random
        assert len({r["draws"][i] for r in records}) == len(records)
    if fork_server:
        assert len(importers) == 1  # the server; every rank and spare was forked from it
        assert {r["ppid"] for r in records} == {int(importers[0])}
    else:
        assert len(importers) == 6  # three ranks and three spares, each importing for itself
        assert {r["pid"] for r in records} == {int(p) for p in importers}


def _activate(sock: socket.socket, tmp_path: Path, out: Path, rank: int, **env: str) -> None:
    assert sock.recv(64).startswith(b"ready")
    message = {
        "env": {**os.environ, "RANK": str(rank), **env},
        "cwd": str(tmp_path),
        "argv": [str(tmp_path / "job.py"), str(out)],
    }
    sock.sendall(json.dumps(message).encode() + b"\n")
    sock.close()


def test_exit_statuses_come_through_the_server_and_a_dead_server_is_said(
    tmp_path: Path,
) -> None:
    _, env = _setup(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    said: list[str] = []
    server = ForkServer(sys.executable, env, ("heavy",), say=said.append)
    try:
        child, sock = server.fork()
        _activate(sock, tmp_path, out, 1, CODE="5")
        assert child.wait(timeout=30) == 5  # the job's own exit status
        killed, sock = server.fork()
        assert sock.recv(64).startswith(b"ready")
        os.killpg(killed.pid, signal.SIGKILL)  # by group, as the launcher signals ranks
        assert killed.wait(timeout=30) == -signal.SIGKILL
        orphan, sock = server.fork()
        assert sock.recv(64).startswith(b"ready")
        os.kill(server.process.pid, signal.SIGKILL)  # the server dies under its child
        server.process.wait()
        assert orphan.poll() is None  # the child does not die with it
        os.kill(orphan.pid, signal.SIGKILL)
        assert orphan.wait(timeout=30) == -signal.SIGKILL  # its status is lost: read as killed
        assert any("fork server" in s and "is lost" in s for s in said)
        sock.close()
    finally:
        server.close()


def test_a_preload_that_cannot_be_imported_is_named(tmp_path: Path) -> None:
    server = ForkServer(sys.executable, dict(os.environ), ("no_such_module_here",))
    try:
        with pytest.raises(Exception, match="cannot import no_such_module_here"):
            server.fork()
    finally:
        server.close()


def test_a_fork_server_that_died_is_replaced_at_the_next_launch(tmp_path: Path) -> None:
    _, env = _setup(tmp_path)
    ranks = LocalRanks(RankOptions(nproc=2, preload=("heavy",), warm=False), say=lambda _: None)
    try:
        first = _launch(tmp_path, ranks, env, "first")
        [server] = ranks._servers.values()
        os.kill(server.process.pid, signal.SIGKILL)  # between launches: no rank of its runs
        server.process.wait()
        second = _launch(tmp_path, ranks, env, "second")
        [replaced] = ranks._servers.values()
        assert replaced is not server and server.gone
    finally:
        ranks.close()
    assert len(first) == len(second) == 2 and all(r["imported"] for r in first + second)
    importers = (tmp_path / "imports").read_text().split()
    assert len(importers) == 2  # the first server, then the one that took its place
    assert {r["ppid"] for r in second} == {int(importers[1])}
