"""The link tests' network harness (:mod:`failslow.demo.netns`) next to what a killed run leaves.

A test run killed before its teardown (a CI timeout, a session ending mid-suite) leaves its
namespaces and the root namespace's veth into them, with the route to their subnet. When every
network used one subnet, the next run's ranks timed out connecting to the host: the host's
replies followed the leaked route (both link e2e tests failed that way in CI).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from _netns import require_network_namespaces

from failslow.demo.netns import NetnsUnavailable, _our_namespaces, free_subnet, netns_network

_LEAK = """
import sys, time
from failslow.demo.netns import netns_network
with netns_network(2) as net:
    net.attach_host()
    sleeper = net.popen(0, ["sleep", "600"])
    print(net.prefix, net.subnet, net.host_veth, sleeper.pid, flush=True)
    time.sleep(600)
"""


def test_a_free_subnet_overlaps_no_address_or_route_of_the_host() -> None:
    used = [f"10.77.{x}.0/24" for x in range(256) if x != 42] + ["default", "192.0.2.2/24"]
    assert free_subnet(used) == "10.77.42"
    assert free_subnet(["10.77.0.253/24", "10.77.1.0/24"]) not in ("10.77.0", "10.77.1")
    with pytest.raises(NetnsUnavailable, match="no free subnet"):
        free_subnet(["10.77.0.0/16"])


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def _answers(net: object, host: str) -> subprocess.CompletedProcess[str]:
    """Rank 0 of ``net`` connects to a server this process runs on every address."""
    server = socket.create_server(("", 0))
    port = server.getsockname()[1]
    client = f"import socket; socket.create_connection(({host!r}, {port}), timeout=5); print('ok')"
    try:
        return net.run(0, [sys.executable, "-c", client], timeout=30)  # type: ignore[attr-defined]
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_a_network_leaked_by_a_killed_run_neither_takes_the_host_s_traffic_nor_stays() -> None:
    """A run is SIGKILLed while its network is attached to this host, with a process still in
    it: the next network draws another subnet, and its rank reaches this process's server. Once
    nothing runs in the leaked namespaces, the next network deletes them and the leaked veth."""
    require_network_namespaces()
    leaker = subprocess.Popen([sys.executable, "-c", _LEAK], stdout=subprocess.PIPE, text=True)
    sleeper = 0
    try:
        assert leaker.stdout is not None
        prefix, subnet, veth, pid = leaker.stdout.readline().split()
        sleeper = int(pid)
        os.kill(leaker.pid, signal.SIGKILL)
        leaker.wait(timeout=10)
        assert _link_exists(veth) and _our_namespaces(prefix), "the killed run left its network"

        with netns_network(2) as net:
            net.attach_host()
            assert net.subnet != subnet
            done = _answers(net, net.host_address)
            assert done.stdout.strip() == "ok", done.stderr[-2000:]
            assert _our_namespaces(prefix), "a namespace with a process inside is kept"
    finally:
        if leaker.poll() is None:
            leaker.kill()
            leaker.wait(timeout=10)
        if sleeper:
            try:
                os.kill(sleeper, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _our_namespaces(prefix):
        with netns_network(1):
            pass
        time.sleep(0.2)
    assert _our_namespaces(prefix) == [] and not _link_exists(veth)
