"""The kit's topology-swap bookkeeping (greyhound 5.2, S3): host plans to process moves, the
topology afterwards, and the state exchange in a real 3-rank gloo world."""

from __future__ import annotations

import socket

import pytest
import torch

from failslow.adapters.common import swap
from failslow.core.topology import Topology, inverse_placement
from failslow.errors import ConfigError, FailslowError
from failslow.runtime.agreement import all_ranks_ok


def _topology(gpus_per_host: int = 1) -> Topology:
    return Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=gpus_per_host, micro_batches=8)


def test_a_host_swap_moves_the_roles_and_keeps_the_hosts():
    t = _topology()  # hosts node00000..node00003, role r on process r
    hosts = list(t.hosts)
    hosts[1], hosts[2] = hosts[2], hosts[1]
    dest = t.placement(hosts)
    assert dest == (0, 2, 1, 3)
    assert inverse_placement(dest) == (0, 2, 1, 3)
    after = t.moved(dest)
    assert after.hosts == t.hosts  # processes stay where they are
    assert after.coords == (t.coords[0], t.coords[2], t.coords[1], t.coords[3])
    # a later plan starts from the new placement: swapping back restores the first one
    back = after.placement(hosts)
    assert after.moved(back).coords == t.coords


def test_roles_of_one_host_move_together_in_order():
    t = Topology.megatron(tp=2, dp=2, pp=2, gpus_per_host=2, micro_batches=8)  # TP inside a host
    names = t.host_names
    order = {names[0]: names[3], names[3]: names[0], names[1]: names[1], names[2]: names[2]}
    dest = t.placement([order[h] for h in t.hosts])
    assert dest[:2] == (6, 7) and dest[6:] == (0, 1)
    after = t.moved(dest)
    for host in names:  # each host still runs one whole TP group
        (a, b) = after.ranks_on(host)
        assert after.coords[a][1:] == after.coords[b][1:] and after.coords[a][0] == 0


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        (("node00000",) * 4, "host node00000 would run 4 roles but has 1 processes"),
        (("node00000", "node00001", "node00002"), "3 roles placed, the job has 4"),
        (("node00000", "node00001", "node00002", "elsewhere"), "unknown hosts ['elsewhere']"),
    ],
)
def test_a_plan_that_does_not_fit_is_one_line(hosts, message):
    with pytest.raises(ConfigError) as info:
        _topology().placement(hosts)
    assert message in str(info.value) and "\n" not in str(info.value)


def _exchange_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    state = {"role": rank, "w": torch.full((3, 5), float(rank)), "nested": [torch.arange(rank + 1)]}
    dest = (1, 2, 0)  # a 3-cycle: 0 -> 1 -> 2 -> 0
    got = swap.exchange_state(state, dest, rank=rank, step=7)
    ok = all_ranks_ok(got["role"] == inverse_placement(dest)[rank], world)
    torch.save({"got": got, "ok": ok}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_state_moves_around_a_cycle_bitwise(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_exchange_rank, args=(3, port, str(tmp_path)), nprocs=3,
                       start_method="spawn")  # fmt: skip
    for rank in range(3):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        source = (rank - 1) % 3
        assert record["ok"] and record["got"]["role"] == source
        assert torch.equal(record["got"]["w"], torch.full((3, 5), float(source)))
        assert torch.equal(record["got"]["nested"][0], torch.arange(source + 1))


def test_a_process_that_keeps_its_role_keeps_its_state_without_a_copy():
    state = {"w": torch.ones(2)}
    assert swap.exchange_state(state, (0, 1), rank=0, step=1) is state
    with pytest.raises(FailslowError, match="not a permutation"):
        swap.exchange_state(state, (0, 0), rank=0, step=1)
