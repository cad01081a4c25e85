"""Peer backups and restore after a real eviction (byterobust 6.3, over-eviction 5; Invariant 4).

Each test runs a 4-rank gloo world on two simulated nodes (one directory per host under a tmp
dir in /dev/shm plays the node's tmpfs), trains a tiny model with a snapshot and a peer backup
every step, SIGKILLs the processes of the evicted node(s), deletes their directories (the nodes are
gone), starts a new world of fresh processes with the same rank ids and restores. Every rank must
end with its state of one common step, bitwise equal to what it had then.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from failslow.core.checkpoint.backup import backup_path
from failslow.core.checkpoint.placement import backup_holders
from failslow.core.topology import Topology

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(120),
]

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_backup_worker.py"
WORLD = 4


@pytest.fixture
def shm() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="failslow-backup-test-", dir="/dev/shm"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


class World:
    """Worker processes of one world; the TCPStore (port 0) belongs to this pytest process."""

    def __init__(
        self,
        phase: str,
        spec: dict[str, Any],
        out: Path,
        world: int = WORLD,
        env_of: Any = None,
        **flags: Any,
    ) -> None:
        self.world = world
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.out = out
        self.logs = []
        self.procs: list[subprocess.Popen[bytes]] = []
        extra = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        for rank in range(world):
            log = open(out / f"{phase}-rank{rank}.log", "w")
            self.logs.append(log)
            cmd = [
                sys.executable, str(WORKER), phase, "--rank", str(rank),
                "--port", str(self.store.port), "--spec", json.dumps(spec), "--out", str(out),
                *extra,
            ]  # fmt: skip
            rank_env = {**env, **(env_of(rank) if env_of is not None else {})}
            self.procs.append(
                subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT)
            )

    def wait_for(self, names: list[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all((self.out / n).exists() for n in names):
            dead = [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if dead or time.monotonic() > deadline:
                self.kill(range(self.world))
                raise AssertionError(f"ranks {dead} failed or timed out:\n{self.tails()}")
            time.sleep(0.05)

    def join(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            for p in self.procs:
                p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        bad = [r for r, p in enumerate(self.procs) if p.returncode != 0]
        self.kill(range(self.world))
        assert not bad, f"ranks {bad} failed:\n{self.tails()}"

    def kill(self, ranks: Any) -> None:
        for r in ranks:
            p = self.procs[r]
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)  # the node dies: no cleanup, no goodbye
                p.wait()
        if all(p.poll() is not None for p in self.procs):
            for log in self.logs:
                log.close()

    def tails(self) -> str:
        return "\n".join(
            f"--- {log.name} ---\n{Path(log.name).read_text()[-3000:]}" for log in self.logs
        )


def spec_of(topo: Topology, shm: Path) -> dict[str, Any]:
    return {
        "tp": topo.tp, "dp": topo.dp, "pp": topo.pp,
        "coords": [list(c) for c in topo.coords], "hosts": list(topo.hosts),
        "host_dirs": {h: str(shm / h) for h in topo.host_names},
    }  # fmt: skip


def assert_bitwise(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(raw[0], raw[1]), where  # bitwise, NaNs and signed zeros included
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def evict_and_restore(
    topo: Topology, shm: Path, out: Path, evicted_hosts: set[str], *, then: str = "idle",
    corrupt: Any = None,
) -> list[dict[str, Any]]:  # fmt: skip
    spec = spec_of(topo, shm)
    steps = 4
    train = World("train", spec, out, steps=steps, then=then)
    train.wait_for([f"ready-rank{r}" for r in range(WORLD)])
    if then == "train":
        time.sleep(0.6)  # killed mid-training, between or during snapshots and backups
    evicted = [r for r in range(WORLD) if topo.hosts[r] in evicted_hosts]
    train.kill(evicted)
    for host in evicted_hosts:
        shutil.rmtree(shm / host)  # the node is gone, and its tmpfs with it
    train.kill(range(WORLD))  # the survivors' processes restart too (same node memory)
    if corrupt is not None:
        corrupt(shm)
    new = World("restore", spec, out, steps=2)
    new.join()
    results = []
    for rank in range(WORLD):
        got = json.loads((out / f"restored-rank{rank}.json").read_text())
        restored = torch.load(out / f"restored-rank{rank}.pt", weights_only=False)
        before = torch.load(out / f"rank{rank}-step{got['step']}.pt", weights_only=False)
        assert_bitwise(restored, before, f"rank {rank} step {got['step']}")
        assert (out / f"done-rank{rank}").exists()
        results.append(got)
    assert len({r["step"] for r in results}) == 1, results
    for rank in evicted:
        assert results[rank]["source"] == "backup", results
    return results


def test_host_eviction_mid_training(shm: Path, tmp_path: Path) -> None:
    """PP=2 x DP=2 on two nodes (one stage each); node1 dies while training runs."""
    topo = Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=2, micro_batches=1)
    results = evict_and_restore(topo, shm, tmp_path, {"node00001"}, then="train")
    assert results[0]["step"] >= 4
    assert [r["source"] for r in results[:2]] == ["local", "local"]


def test_whole_pp_group_evicted(shm: Path, tmp_path: Path) -> None:
    """Each node runs one pipeline (PP group); evicting a node evicts the whole PP group."""
    base = Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=1, micro_batches=1)
    topo = base.with_hosts(["pipeA" if base.coords[r][1] == 0 else "pipeB" for r in range(WORLD)])
    holders = backup_holders(topo)
    group = set(topo.pp_group(0, 0))
    assert {r for r in range(WORLD) if topo.hosts[r] == "pipeA"} == group
    assert not group & {holders[r] for r in group}
    results = evict_and_restore(topo, shm, tmp_path, {"pipeA"})
    assert results[0]["step"] == 4


def test_corrupt_backup_falls_back_to_previous_step(shm: Path, tmp_path: Path) -> None:
    """DP-only (ZeRO-like: neighbouring node holds the backup); the newest backup of an evicted
    rank is damaged on its holder: every rank restores the previous step, consistently."""
    topo = Topology.megatron(tp=1, dp=4, pp=1, gpus_per_host=2, micro_batches=1)
    holders = backup_holders(topo)
    victim = 2
    holder_dir = shm / topo.hosts[holders[victim]]

    def corrupt(root: Path) -> None:
        newest = max(
            (backup_path(holder_dir, victim, k) for k in range(2)),
            key=lambda p: int.from_bytes(p.read_bytes()[16:24], "little", signed=True),
        )
        data = bytearray(newest.read_bytes())
        data[len(data) - 10] ^= 0xFF  # a flipped payload bit: the commit word still says "ok"
        newest.write_bytes(bytes(data))

    results = evict_and_restore(topo, shm, tmp_path, {"node00001"}, corrupt=corrupt)
    assert {r["step"] for r in results} == {3}
    assert all(r["attempts"] == 2 for r in results)


@pytest.mark.parametrize("through", ["restore_resharded", "the snapshot service"])
def test_a_smaller_world_gathers_every_old_ranks_state(
    shm: Path, tmp_path: Path, through: str
) -> None:
    """odyssey's reroute/reconfigure after a lost host with no standby: the three survivors of
    a DP=4 world (one rank per host) each get all four old ranks' states of one common step,
    the lost rank's from its holder's backup, bitwise what each old rank had then. Through the
    rank runtime's snapshot service, the launcher's list of worlds comes first with a newer,
    smaller world that never wrote a snapshot (killed while it restored): the service says so
    and takes the next one."""
    topo = Topology.megatron(tp=1, dp=4, pp=1, gpus_per_host=1, micro_batches=1)
    holders = backup_holders(topo)
    lost = 2
    spec = spec_of(topo, shm)
    train = World("train", spec, tmp_path, steps=4, then="train")
    train.wait_for([f"ready-rank{r}" for r in range(WORLD)])
    time.sleep(0.6)  # killed mid-training, between or during snapshots and backups
    train.kill([lost])
    shutil.rmtree(shm / topo.hosts[lost])
    train.kill(range(WORLD))
    old_ranks = [r for r in range(WORLD) if r != lost]

    def env_of(new: int) -> dict[str, str]:
        if through == "restore_resharded":
            return {}
        old = old_ranks[new]
        kept = Path(spec["host_dirs"][topo.hosts[old]])
        (kept / "placement.json").write_text(json.dumps(list(holders)))  # the service's record
        empty = shm / "world1" / f"slot{new}"  # a smaller world that wrote nothing
        empty.mkdir(parents=True)
        sources = [
            {"directory": str(empty), "rank": new},
            {"directory": str(kept), "rank": old},
        ]
        return {
            "FAILSLOW_RESHARD_FROM": json.dumps(sources),
            "FAILSLOW_SNAPSHOT_DIR": str(shm / "world2" / f"slot{new}"),
        }

    old = ",".join(map(str, old_ranks))
    World("reshard", spec, tmp_path, world=3, env_of=env_of, old_ranks=old).join()
    records = [json.loads((tmp_path / f"resharded-rank{r}.json").read_text()) for r in range(3)]
    assert len({json.dumps(r) for r in records}) == 1, records  # one agreement everywhere
    step = records[0]["step"]
    assert step >= 4
    if through == "restore_resharded":
        assert records[0]["providers"][lost] == old_ranks.index(holders[lost])
        sources = ["backup" if r == lost else "snapshot" for r in range(WORLD)]
        assert records[0]["sources"] == sources
    else:
        log = (tmp_path / "reshard-rank0.log").read_text()
        assert f"resumed step {step} of the 4-rank world on 3 ranks" in log, log[-2000:]
    for new in range(3):
        states = torch.load(tmp_path / f"resharded-rank{new}.pt", weights_only=False)
        assert len(states) == WORLD
        for old in range(WORLD):
            before = torch.load(tmp_path / f"rank{old}-step{step}.pt", weights_only=False)
            assert_bitwise(states[old], before, f"new rank {new}: old rank {old} step {step}")


def test_a_smaller_world_without_a_lost_ranks_backup_says_so(shm: Path, tmp_path: Path) -> None:
    """The lost rank's holder is lost too (over-eviction beyond what backups cover): one clear
    error on every survivor, naming the old rank whose state is gone."""
    topo = Topology.megatron(tp=1, dp=4, pp=1, gpus_per_host=1, micro_batches=1)
    holders = backup_holders(topo)
    lost = {2, holders[2]}
    spec = spec_of(topo, shm)
    train = World("train", spec, tmp_path, steps=2)
    train.wait_for([f"ready-rank{r}" for r in range(WORLD)])
    train.kill(range(WORLD))
    for r in lost:
        shutil.rmtree(shm / topo.hosts[r])
    old_ranks = [r for r in range(WORLD) if r not in lost]
    new = World("reshard", spec, tmp_path, world=2, old_ranks=",".join(map(str, old_ranks)))
    for p in new.procs:
        p.wait(60)
    assert all(p.returncode != 0 for p in new.procs)
    new.kill(range(2))
    for r in range(2):
        text = (tmp_path / f"reshard-rank{r}.log").read_text()
        assert "the state of old rank(s) [2] is gone" in text, text[-2000:]
