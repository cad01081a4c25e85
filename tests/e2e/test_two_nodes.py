"""Two machines, one flag each: ``failslow run --store`` on every node, a straggler on the second.

Two network namespaces are the two nodes (:mod:`failslow.demo.netns`: ``10.77.0.1`` and
``10.77.0.2`` on one bridge); a real ``redis-server`` with a password and TLS only (a CA and a
server certificate made for this test) listens on the bridge's own address, ``10.77.0.254``. On
each node a launcher runs the same command a user would, with torchrun's own two-node
rendezvous::

    failslow run --store rediss://:PW@10.77.0.254:PORT/0?ssl_ca_certs=CA --job-token T \
        [--controller 4] -- torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d ...

Node 0's launcher also hosts the job's controller (the ranks, four CPU processes on two shared
cores, take turns for the GEMM and time it in fp32: ``FAILSLOW__VALIDATION__*`` settings). The
training script uses nothing of failslow but its fault injector: the second node's local rank 1
is duty-cycled (``failslow.faults.throttle_self``: a forked helper SIGSTOPs it 75% of every
10 ms) from step 60 until a diagnosis exists; every rank
stops at one step (a one-float all-reduce per step agrees on it). The controller must name
exactly that rank, kind compute, with evidence gathered across both nodes through the store;
both launchers must exit 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from failslow.demo.netns import BRIDGE, NetnsUnavailable, _must, netns_network

pytestmark = [pytest.mark.timeout(420), pytest.mark.multiprocess, pytest.mark.slow]

SUBNET = "10.77.0"
"""The nodes' subnet, fixed: these namespaces never attach to the root namespace, so no other
network's route can take their traffic."""
REDIS_ADDRESS = f"{SUBNET}.254"
RDZV_PORT = 29400  # node 0's namespace is brand new: nothing else listens there
TOKEN = "two-node-e2e-token"

TRAIN = textwrap.dedent(
    """\
    import os, sys, time
    import torch, torch.distributed as dist
    from failslow.faults import throttle_self
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = os.environ["GROUP_RANK"] == "1" and os.environ["LOCAL_RANK"] == "1"
    out, diagnoses = sys.argv[1], sys.argv[2]
    if slow:
        with open(os.path.join(out, "slow-rank"), "w") as f:
            f.write(str(rank))
    w = torch.randn(256, 256) / 16
    x = torch.randn(64, 256)
    helper, step, started = None, 0, time.time()
    while True:
        if slow and step == 60:
            helper = throttle_self(0.75, 0.01)  # 75% of every 10 ms stopped
        for _ in range(10):
            y = torch.tanh(x @ w)
        grad = (y.T @ x) / 64
        dist.all_reduce(grad)
        w -= 1e-3 * grad / dist.get_world_size()
        time.sleep(0.01)
        step += 1
        done = step >= 80 and (time.time() - started > 240 or (  # a diagnosis, not the journal
            os.path.isdir(diagnoses)
            and any(n.startswith("diagnosis-") for n in os.listdir(diagnoses))))
        flag = torch.tensor([1.0 if done else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            break
    if helper:
        helper.stop()
    dist.destroy_process_group()
    """
)


def _launcher(node: int, store_url: str, work: Path, ring_dir: Path) -> list[str]:
    address = f"10.77.0.{node + 1}"
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
        "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"10.77.0.1:{RDZV_PORT}",
        "--rdzv-id", "two-nodes", "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=120",
        "--local-addr", address, "--max-restarts", "0",
        str(work / "train.py"), str(work), str(work / "node0-rings" / "diagnoses"),
    ]  # fmt: skip
    launcher = [
        sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--store", store_url,
        "--job-token", TOKEN, "--ring-dir", str(ring_dir),
    ]  # fmt: skip
    if node == 0:
        launcher += ["--controller", "4", "--threshold", "2.0"]
    return [*launcher, "--", *torchrun]


@contextlib.contextmanager
def _two_nodes(make_redis: Any, script: str) -> Iterator[tuple[Any, Any, Path, list[Any], dict]]:
    """Two network namespaces (the nodes) and a real redis-server with a password and TLS on
    their bridge's own address, ``script`` as ``train.py`` in a work directory:
    ``(network, redis, work, procs, env)`` - the processes the test starts go in ``procs`` (all
    ended at exit), ``env`` is theirs without failslow's variables. Skips where namespaces
    cannot be made."""
    work = Path(tempfile.mkdtemp(prefix="failslow-2n-", dir="/tmp"))  # short: unix socket path
    (work / "train.py").write_text(script)
    procs: list[subprocess.Popen[str]] = []
    try:
        network = netns_network(2, subnet=SUBNET)
        net = network.__enter__()
    except NetnsUnavailable as exc:
        subprocess.run(["rm", "-rf", str(work)], check=False)
        pytest.skip(
            "two nodes are two network namespaces, which need root (CAP_NET_ADMIN) and "
            f"iproute2: {exc}"
        )
    try:
        br = net.bridge_netns
        _must(["ip", "-n", br, "addr", "add", f"{REDIS_ADDRESS}/24", "dev", BRIDGE])
        _must(["ip", "-n", br, "link", "set", "lo", "up"])
        redis = make_redis(
            password="pw:with@odd/chars",
            tls=True,
            host=REDIS_ADDRESS,
            argv_prefix=["ip", "netns", "exec", br],
            unixsocket=work / "redis.sock",
        )
        assert redis.url.startswith("rediss://:pw%3Awith%40odd%2Fchars@10.77.0.254:")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
        env["OMP_NUM_THREADS"] = "1"
        yield net, redis, work, procs, env
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        network.__exit__(None, None, None)
        if not os.environ.get("FAILSLOW_TEST_KEEP"):
            subprocess.run(["rm", "-rf", str(work)], check=False)


def test_a_straggler_on_the_second_node_is_diagnosed_through_a_shared_store(make_redis) -> None:
    with _two_nodes(make_redis, TRAIN) as (net, redis, work, procs, env):
        # CPU ranks share 2 cores: they time the GEMM in turns, in fp32 only (bf16 matmuls on
        # this CPU take ~10 s each and scatter with the load); set the way users set them
        env["FAILSLOW__VALIDATION__GEMM_SERIAL"] = "true"
        env["FAILSLOW__VALIDATION__GEMM_DTYPES"] = "float32"
        # and long enough (about 40 ms here) that one time slice of another process on the
        # shared cores does not look like a slow device: median of five
        env["FAILSLOW__VALIDATION__GEMM_SIZE"] = "1536"
        env["FAILSLOW__VALIDATION__GEMM_REPETITIONS"] = "5"
        for node in (1, 0):  # the second node first: the rendezvous waits for its host
            node_env = {**env, "GLOO_SOCKET_IFNAME": net.ranks[node].veth}
            argv = _launcher(node, redis.url, work, work / f"node{node}-rings")
            log = open(work / f"node{node}.log", "w")
            procs.append(net.popen(node, argv, env=node_env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 360
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        if os.environ.get("FAILSLOW_TEST_KEEP"):
            import redis as redis_py

            client = redis_py.Redis(
                unix_socket_path=str(work / "redis.sock"), password=redis.password
            )
            dump = {
                k.decode(): client.get(k) for k in client.keys("*") if client.type(k) == b"string"
            }
            (work / "redis-keys.txt").write_text(
                "\n".join(f"{k} {v[:300]!r}" for k, v in sorted(dump.items()))
            )
        logs = {n: (work / f"node{n}.log").read_text() for n in (0, 1)}
        tail = "\n".join(f"--- node {n}\n{text[-3000:]}" for n, text in logs.items())
        assert all(p.poll() == 0 for p in procs), tail
        lines = [ln for ln in logs[0].splitlines() if "failslow run: diagnosis " in ln]
        assert lines, tail
        first = json.loads(lines[0].split("diagnosis ", 1)[1])
        slow = int((work / "slow-rank").read_text())
        assert first["kind"] == "compute", first
        assert [r for r, _ in first["slow_ranks"]] == [slow], (slow, first)
        assert "controller (4 ranks), store rediss://:***@10.77.0.254" in logs[0], tail
        assert "node publisher, store rediss://:***@10.77.0.254" in logs[1], tail
        assert "with@odd" not in logs[0] + logs[1]  # the password never printed
        # the controller asked for the summaries it profiled, and both nodes' publishers
        # answered for their ranks through the shared store
        journal = work / "node0-rings" / "diagnoses" / "events.jsonl"
        states = [json.loads(line) for line in journal.read_text().splitlines()]
        validating = [e for e in states if e.get("state") == "validating"]
        assert validating and validating[0]["detail"]["summarized"] == 4, validating[:1]


RESTARTED = textwrap.dedent(
    """\
    import json, os, signal, sys, time
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://: the launcher's RANK, MASTER_ADDR, ...
    rank, launch = dist.get_rank(), int(os.environ["FAILSLOW_RESTART"])
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "FAILSLOW_SLOT")
    with open(os.path.join(sys.argv[1], f"launch{launch}-rank{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in names}, f)
    for step in range(40):
        if launch == 0 and rank == 3 and step == 10:
            os.kill(os.getpid(), signal.SIGKILL)  # node 1's second process dies
        t = torch.ones(256)
        dist.all_reduce(t)
        assert t[0].item() == 4.0
        time.sleep(0.01)
    dist.destroy_process_group()
    """
)


def test_a_rank_killed_on_the_second_node_restarts_both_nodes_launchers(make_redis) -> None:
    """Two machines (network namespaces, addresses 10.77.0.1 and .2) and the job's store a real
    Redis with TLS and a password on the bridge: each node runs ``failslow run --nnodes 2
    --node-rank K --node-addr 10.77.0.K+1 --nproc-per-node 2 --standbys 1``, node 0 with the
    controller. Node 1's second rank (the job's rank 3) is SIGKILLed in the first launch: node 1
    claims the launch's stop through Redis and moves the rank to its standby slot, node 0 stops
    its ranks, and both start the next launch at node 0's new rendezvous on 10.77.0.1 - the
    ranks' ``env://`` over the nodes' own addresses. Both launchers exit 0."""
    with _two_nodes(make_redis, RESTARTED) as (net, redis, work, procs, env):
        for node in (1, 0):  # the second node first: it waits for node 0's rendezvous
            argv = [
                sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--store", redis.url,
                "--job-token", TOKEN, "--ring-dir", str(work / f"node{node}-rings"),
                "--state-dir", str(work / f"node{node}-state"),
                *(["--controller", "4", "--threshold", "2.0"] if node == 0 else []),
                "--nnodes", "2", "--node-rank", str(node), "--node-addr", f"10.77.0.{node + 1}",
                "--nproc-per-node", "2", "--standbys", "1", "--max-restarts", "1",
                "--", str(work / "train.py"), str(work),
            ]  # fmt: skip
            node_env = {**env, "GLOO_SOCKET_IFNAME": net.ranks[node].veth,
                        "FAILSLOW_HOST": f"node{node}"}  # fmt: skip
            log = open(work / f"node{node}.log", "w")
            procs.append(net.popen(node, argv, env=node_env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 300
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        logs = {n: (work / f"node{n}.log").read_text() for n in (0, 1)}
        tail = "\n".join(f"--- node {n}\n{text[-3000:]}" for n, text in logs.items())
        assert [p.poll() for p in procs] == [0, 0], tail
        (stop,) = [json.loads(x) for x in (work / "node1-state" / "failstops.jsonl").open()]
        assert (stop["rank"], stop["slot"], stop["replaced_by"]) == (3, 1, 2), stop
        assert stop["status"] == 128 + 9, stop
        assert not (work / "node0-state" / "failstops.jsonl").exists(), tail
        assert "node 1's rank 3 failed (signal 9)" in logs[0], tail
        for launch in (0, 1):
            ranks = {r: json.loads((work / f"launch{launch}-rank{r}.json").read_text())
                     for r in range(4)}  # fmt: skip
            assert {r["MASTER_ADDR"] for r in ranks.values()} == {"10.77.0.1"}, ranks
            assert [(r["GROUP_RANK"], r["LOCAL_RANK"]) for r in ranks.values()] == [
                ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
        assert ranks[3]["FAILSLOW_SLOT"] == "2"  # launch 1: rank 3 on node 1's standby slot
