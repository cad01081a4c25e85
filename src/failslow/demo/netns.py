"""A throwaway network of Linux network namespaces for link faults (iproute2 + tc): the
end-to-end tests' and the S3 link benchmark's.

:func:`netns_network` builds, for ``n`` ranks::

    namespace <prefix>-br        bridge "fsbr" (no address), ports "fsb0" .. "fsb<n-1>"
    namespace <prefix>-r<i>      veth "fsv<i>" = 10.77.X.<i+1>/24, loopback up
    veth pair fsv<i> <-> fsb<i>  (one pair per rank, the fsb end enslaved to the bridge)

The subnet ``10.77.X.0/24`` is drawn at random among those that no address or route of the root
namespace overlaps (:func:`free_subnet`): a network attached to the root namespace
(:meth:`Network.attach_host`) adds a route there, and a second network on the same subnet - a
parallel run's, or one leaked by a run killed before its teardown - would take this one's replies
(its ranks then time out connecting to the host). Networks leaked by a dead process (no process
left in them, the pid in their prefix gone) are deleted first (:func:`_reclaim_leaked`).

``<prefix>`` is ``fs<pid>x<random hex>`` (the test process's pid and a random token), so parallel
runs, and namespaces leaked by a killed run whose pid is later reused, never collide. Every
interface is created directly inside its namespace (``ip -n BR link add fsb<i> type veth peer
name fsv<i> netns R<i>``) and nothing touches the root namespace, so interface names only need to
be unique inside a namespace (:meth:`Network.attach_host`, for a launcher whose servers the
ranks must reach, is the one exception: a veth into the root namespace, destroyed with the
bridge namespace). On exit, also on failure, every process still inside one of the
namespaces (``ip netns pids``: only processes this test started can be there) is killed by pid and
every namespace is deleted; deleting a namespace destroys its veth ends and the bridge.

:meth:`Network.shape` congests exactly one *directed* link ``src -> dst``: on rank ``src``'s veth,
in ``src``'s namespace::

    tc qdisc add dev fsv<src> root handle 1: htb
    tc class add dev fsv<src> parent 1: classid 1:2 htb rate RATE ceil RATE \
        burst 64kb cburst 64kb quantum 60000
    tc filter add dev fsv<src> parent 1: protocol ip prio 1 u32 \
        match ip dst 10.77.X.<dst+1>/32 match u16 0 0xfc00 at 2 flowid 1:0
    tc filter add dev fsv<src> parent 1: protocol ip prio 2 u32 \
        match ip dst 10.77.X.<dst+1>/32 flowid 1:2

An ``htb`` root without a ``default`` class sends every packet that no filter classifies straight
out (htb's "direct" queue, unshaped), and so does the classid ``1:0`` (the qdisc itself). Only
IPv4 packets to ``dst``'s address land in the rate-limited class ``1:2``, and among those only
packets of at least 1024 bytes (IPv4 total length, the 16-bit word at byte 2 of the IP header,
``& 0xfc00 != 0``): the prio-1 filter keeps small packets (pure TCP ACKs of ``dst -> src``
transfers, gloo's one-byte tokens) out of the shaped class, so the reverse link ``dst -> src`` is
not slowed by its acknowledgements queuing behind the congested data. ``burst`` must hold one GSO
packet of the veth (64 KiB). The usual recipe, ``prio`` + ``tbf``/``netem`` on a band + a ``u32``
filter, is not available on this sandbox's kernel (``CONFIG_NET_SCH_PRIO`` and
``CONFIG_NET_SCH_NETEM`` are not set; ``htb``, ``tbf``, ``ingress``, ``u32`` and ``bpf`` are), and
``htb`` does the same job: one classful root, one shaped class, unclassified traffic untouched.

If namespaces cannot be built (not root, no ``ip``, the sandbox refuses), :class:`NetnsUnavailable`
says which command failed and its error; tests turn that into a skip, never a fake network.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

SUBNETS = "10.77"
"""The networks' subnets are ``10.77.X.0/24`` (:func:`free_subnet` picks X)."""
BRIDGE = "fsbr"
HOST = 253
"""Where :meth:`Network.attach_host` puts this process's namespace on the bridge: ``.253``."""


class NetnsUnavailable(RuntimeError):
    """This host cannot build the namespaces (the message names the command and its error)."""


def _run(argv: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def _must(argv: Sequence[str], *, unavailable: bool = False) -> str:
    """Run ``argv``; on failure raise (NetnsUnavailable when ``unavailable``) with its error."""
    try:
        done = _run(argv)
    except (OSError, subprocess.TimeoutExpired) as exc:
        error: type[Exception] = NetnsUnavailable if unavailable else RuntimeError
        raise error(f"`{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        message = (
            f"`{' '.join(argv)}` exited {done.returncode}: "
            f"{(done.stderr or done.stdout).strip() or '(no output)'}"
        )
        raise (NetnsUnavailable if unavailable else RuntimeError)(message)
    return done.stdout


@dataclass(frozen=True)
class RankNet:
    index: int
    netns: str
    veth: str
    """The rank's end of its veth pair (inside ``netns``); use it as ``GLOO_SOCKET_IFNAME``."""
    address: str
    """The veth's IPv4 address, without the prefix length."""


@dataclass
class Network:
    prefix: str
    bridge_netns: str
    ranks: list[RankNet]
    subnet: str = f"{SUBNETS}.0"
    """The first three octets of every address on the bridge (``10.77.X``)."""
    namespaces: list[str] = field(default_factory=list)
    """Every namespace created so far, in creation order (what teardown deletes)."""
    host_veth: str | None = None
    """The root namespace's end of :meth:`attach_host`'s veth (teardown deletes it)."""

    def exec_argv(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace (``ip netns exec NS ...``).

        ``ip netns exec`` execs ``argv`` in place, so the pid of a Popen of this is the pid of
        the command itself.
        """
        return ["ip", "netns", "exec", self.ranks[rank].netns, *argv]

    def run(self, rank: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.exec_argv(rank, argv), check=False, **kwargs)

    def popen(self, rank: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(rank, argv), **kwargs)

    def shape(
        self,
        src: int,
        dst: int,
        *,
        rate: str = "100mbit",
        burst: str = "64kb",
        spare_small_packets: bool = True,
    ) -> list[list[str]]:
        """Congest only the directed link ``src -> dst`` to ``rate`` (see the module docstring).

        Returns the tc commands it ran (argv lists, for printing). Raises NetnsUnavailable if tc
        refuses (a qdisc or classifier missing from the kernel, say).
        """
        me, peer = self.ranks[src], self.ranks[dst]
        tc = ["ip", "netns", "exec", me.netns, "tc"]
        dev, dst_ip = me.veth, f"{peer.address}/32"
        filt = f"filter add dev {dev} parent 1: protocol ip prio"
        commands = [
            [*tc, *f"qdisc add dev {dev} root handle 1: htb".split()],
            [
                *tc,
                *f"class add dev {dev} parent 1: classid 1:2 htb rate {rate} ceil {rate}".split(),
                *f"burst {burst} cburst {burst} quantum 60000".split(),
            ],
        ]
        if spare_small_packets:
            # IPv4 total length < 1024 bytes: pure ACKs and tokens go out unshaped (direct).
            small = f"{filt} 1 u32 match ip dst {dst_ip} match u16 0 0xfc00 at 2 flowid 1:0"
            commands.append([*tc, *small.split()])
        commands.append([*tc, *f"{filt} 2 u32 match ip dst {dst_ip} flowid 1:2".split()])
        for argv in commands:
            _must(argv, unavailable=True)
        return commands

    def unshape(self, src: int) -> None:
        """Remove the shaping of rank ``src``'s veth (back to the veth's default qdisc)."""
        me = self.ranks[src]
        _must(["ip", "netns", "exec", me.netns, "tc", "qdisc", "del", "dev", me.veth, "root"])

    @property
    def host_address(self) -> str:
        """The root namespace's address on the bridge once :meth:`attach_host` ran."""
        return f"{self.subnet}.{HOST}"

    def attach_host(self) -> str:
        """Give this process's (root) namespace a port on the bridge at :attr:`host_address`,
        so ranks reach servers it runs (stores listening on every address) and it reaches
        theirs: one veth pair ``fsh<pid>`` (root) - ``fsbh`` (bridge namespace). Deleting the
        bridge namespace at teardown destroys both ends. Returns the address."""
        address = self.host_address
        root = f"fsh{os.getpid() % 10**6}"
        br = self.bridge_netns
        _must(["ip", "-n", br, "link", "add", "fsbh", "type", "veth", "peer", "name", root,
               "netns", "1"], unavailable=True)  # fmt: skip
        self.host_veth = root
        _must(["ip", "-n", br, "link", "set", "fsbh", "master", BRIDGE, "up"], unavailable=True)
        _must(["ip", "addr", "add", f"{address}/24", "dev", root], unavailable=True)
        _must(["ip", "link", "set", root, "up"], unavailable=True)
        return address

    def tc_show(self, src: int) -> str:
        """``tc -s`` qdisc, class and filter listings of rank ``src``'s veth (with counters)."""
        me = self.ranks[src]
        tc = ["ip", "netns", "exec", me.netns, "tc"]
        return "".join(
            _must([*tc, *args, "show", "dev", me.veth])
            for args in (["-s", "qdisc"], ["-s", "class"], ["filter"])
        )

    def shaped_bytes(self, src: int) -> int:
        """Bytes the shaped class ``1:2`` of rank ``src``'s veth has sent (0 if unshaped)."""
        me = self.ranks[src]
        out = _must(["ip", "netns", "exec", me.netns, "tc", "-s", "class", "show", "dev", me.veth])
        lines = out.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("class htb 1:2 ") and i + 1 < len(lines):
                return int(lines[i + 1].split()[1])  # " Sent N bytes M pkt ..."
        return 0


def _namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _our_namespaces(prefix: str) -> list[str]:
    return [name for name in _namespaces() if name.startswith(prefix + "-")]


_LEAKED = re.compile(r"fs(\d+)x[0-9a-f]{4}-(br|r\d+)")


def _reclaim_leaked() -> list[str]:
    """Delete the namespaces of networks whose creating process is gone and in which no
    process is left (a run killed before its teardown); deleting a bridge namespace also
    destroys the root end of its :meth:`Network.attach_host` veth. A namespace with a process
    inside, or whose pid is alive, is never touched. Returns what was deleted."""
    from failslow.node.stacks import alive

    deleted = []
    for name in _namespaces():
        match = _LEAKED.fullmatch(name)
        if match is None or alive(int(match.group(1))):
            continue
        if _run(["ip", "netns", "pids", name]).stdout.split():
            continue
        if _run(["ip", "netns", "del", name]).returncode == 0:
            deleted.append(name)
    return deleted


def free_subnet(used: Sequence[str] | None = None) -> str:
    """``10.77.X`` with ``10.77.X.0/24`` overlapping no address or route of the root namespace
    (``used``: their CIDRs, else read with ``ip``), X drawn at random among the free ones so
    parallel runs rarely draw the same. Raises NetnsUnavailable if none is free."""
    if used is None:
        addrs = _run(["ip", "-o", "-4", "addr", "show"]).stdout.split()
        routes = _run(["ip", "-4", "route", "show"]).stdout.splitlines()
        used = [w for w in addrs if "/" in w] + [r.split()[0] for r in routes if r.strip()]
    taken = []
    for cidr in used:
        try:
            taken.append(ipaddress.ip_network(cidr, strict=False))
        except ValueError:  # "default", "broadcast", ...
            continue
    free = [
        f"{SUBNETS}.{x}"
        for x in range(256)
        if not any(ipaddress.ip_network(f"{SUBNETS}.{x}.0/24").overlaps(t) for t in taken)
    ]
    if not free:
        raise NetnsUnavailable(f"no free subnet {SUBNETS}.X.0/24 in this host's routes")
    return secrets.choice(free)


def _teardown(net: Network) -> list[str]:
    """Kill what runs in our namespaces, delete them; returns the problems (never raises)."""
    problems: list[str] = []
    if net.host_veth is not None:  # also destroyed with the bridge namespace, but later
        _run(["ip", "link", "del", net.host_veth])
    for ns in reversed(net.namespaces):
        pids = _run(["ip", "netns", "pids", ns]).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in reversed(net.namespaces):
        for attempt in range(20):
            done = _run(["ip", "netns", "del", ns])
            if done.returncode == 0 or ns not in _our_namespaces(net.prefix):
                break
            time.sleep(0.1 * (attempt + 1))
        else:
            problems.append(f"`ip netns del {ns}`: {done.stderr.strip()}")
    left = _our_namespaces(net.prefix)
    if left:
        problems.append(f"namespaces left behind: {left}")
    return problems


@contextmanager
def netns_network(n: int, *, subnet: str | None = None) -> Iterator[Network]:
    """``n`` rank namespaces on one bridge (see the module docstring), on ``subnet``
    (``10.77.X``; default a free one); all torn down on exit.

    Raises NetnsUnavailable (before yielding) if the host cannot build them.
    """
    if n < 1 or n > 250:
        raise ValueError(f"netns_network: n must be in 1..250, got {n}")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("`ip` (iproute2) is not on PATH")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise NetnsUnavailable(f"network namespaces need root; euid is {os.geteuid()}")
    _reclaim_leaked()
    subnet = subnet or free_subnet()
    prefix = f"fs{os.getpid()}x{secrets.token_hex(2)}"
    net = Network(
        prefix=prefix,
        bridge_netns=f"{prefix}-br",
        ranks=[RankNet(i, f"{prefix}-r{i}", f"fsv{i}", f"{subnet}.{i + 1}") for i in range(n)],
        subnet=subnet,
    )
    try:
        br = net.bridge_netns
        _must(["ip", "netns", "add", br], unavailable=True)
        net.namespaces.append(br)
        _must(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"], unavailable=True)
        _must(["ip", "-n", br, "link", "set", BRIDGE, "up"], unavailable=True)
        for rank in net.ranks:
            port = f"fsb{rank.index}"
            _must(["ip", "netns", "add", rank.netns], unavailable=True)
            net.namespaces.append(rank.netns)
            veth = f"link add {port} type veth peer name {rank.veth} netns {rank.netns}"
            _must(["ip", "-n", br, *veth.split()], unavailable=True)
            _must(["ip", "-n", br, "link", "set", port, "master", BRIDGE, "up"], unavailable=True)
            ns = ["ip", "-n", rank.netns]
            _must([*ns, "addr", "add", f"{rank.address}/24", "dev", rank.veth], unavailable=True)
            _must([*ns, "link", "set", rank.veth, "up"], unavailable=True)
            _must([*ns, "link", "set", "lo", "up"], unavailable=True)
        yield net
    finally:
        problems = _teardown(net)
        if problems:
            raise RuntimeError("netns teardown: " + "; ".join(problems))
