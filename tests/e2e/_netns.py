"""The end-to-end tests that shape a real link need network namespaces (shared by them)."""

from __future__ import annotations

import pytest


def require_network_namespaces() -> None:
    """Skip the calling test, saying why, where this host cannot build network namespaces: a
    real congested link between ranks needs root (CAP_NET_ADMIN), iproute2 and tc. Never fake
    one."""
    from failslow.demo.netns import NetnsUnavailable, netns_network

    try:
        with netns_network(1):
            pass
    except NetnsUnavailable as exc:
        pytest.skip(
            "a real slow link between ranks needs network namespaces (root with CAP_NET_ADMIN, "
            f"iproute2, tc), which this host refuses: {exc}"
        )
