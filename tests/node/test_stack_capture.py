"""``failslow stacks``: real processes dumped with py-spy, grouped, the outliers' parallel group
named (byterobust 5.1; failslow.node.stacks over failslow.core.diagnosis.stacks).

Four "ranks" (Python processes) each with a data loader worker (a child process): ranks 0, 1
and 3 wait for their peers in one function, rank 2 sits in another (stuck in a receive); rank
3's worker reads a shard while the others' wait for work. The ranks are found from ring names
in a ring directory, the topology (TP1 x DP2 x PP2, a machine per rank) from a real control
store's job record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from failslow.core.control import keys
from failslow.core.topology import Topology
from failslow.node.control import host_store

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

RANK = textwrap.dedent(
    """
    import subprocess, sys, time
    rank = int(sys.argv[1])
    worker = "read_shard" if rank == 3 else "wait_for_work"
    child = subprocess.Popen([sys.executable, "-c",
        f"import time\\ndef {worker}():\\n    while True: time.sleep(0.05)\\n{worker}()"])

    def wait_for_peers():
        while True:
            time.sleep(0.05)

    def stuck_in_recv():
        while True:
            time.sleep(0.05)

    print("ready", child.pid, flush=True)
    (stuck_in_recv if rank == 2 else wait_for_peers)()
    """
)


@pytest.fixture
def job(tmp_path: Path):
    pytest.importorskip("failslow.node.stacks").py_spy()  # py-spy is a test dependency
    rings = tmp_path / "rings"
    rings.mkdir()
    procs = []
    try:
        for rank in range(4):
            p = subprocess.Popen(
                [sys.executable, "-c", RANK, str(rank)], stdout=subprocess.PIPE, text=True
            )
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().startswith("ready")
            (rings / f"rank{rank:05d}-pid{p.pid}.ring").touch()  # as the capture names it
        yield rings
    finally:
        for p in procs:
            for kid in _children(p.pid):
                os.kill(kid, 9)
            p.kill()
            p.wait()


def _children(pid: int) -> list[int]:
    from failslow.node.stacks import descendants

    return descendants(pid)


def test_failslow_stacks_names_the_outliers_and_the_pipeline_they_share(job: Path, capsys):
    from failslow.cli import main

    topology = Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=1, micro_batches=2)
    store = host_store()
    try:
        store.set_json(keys.JOB, {"topology": topology.to_dict(), "world_size": 4})
        time.sleep(0.2)  # the ranks reach their loops
        assert main(["stacks", "--ring-dir", str(job), "--store", store.url, "--json", "-"]) == 0
    finally:
        store.close()
    found = json.loads(capsys.readouterr().out)
    assert found["outliers"] == [2, 3]
    kinds = {(g["kind"], g["healthy"]): g["ranks"] for g in found["groups"]}
    assert kinds[("rank", True)] == [0, 1, 3] and kinds[("rank", False)] == [2]
    assert kinds[("child", True)] == [0, 1, 2] and kinds[("child", False)] == [3]
    # ranks 2 and 3 are the last stage of both replicas: one DP group, two machines
    assert found["suspects"] == {
        "kind": "dp", "groups": [[2, 3]], "ranks": [2, 3], "hosts": ["node00002", "node00003"]
    }  # fmt: skip
    assert not found["unreadable"]


def test_the_table_names_what_to_over_evict(job: Path, capsys):
    from failslow.cli import main

    time.sleep(0.2)
    assert main(["stacks", "--ring-dir", str(job), "--native", "--no-children"]) == 0
    out = capsys.readouterr().out
    assert "OUTLIER" in out and "stuck_in_recv" in out
    assert "outliers: ranks 2; they share 1 RANKS group(s) - over-evict ranks 2" in out
