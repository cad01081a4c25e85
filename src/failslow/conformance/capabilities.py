"""Declared capabilities (DESIGN.md: "A capability an adapter cannot offer ... is declared, and
the suite checks that asking for it fails loudly - never silently").

SQLAlchemy's requirements object is the model: the adapter declares, per layout, what it
supports (:class:`failslow.capabilities.Capabilities`, read from the session); every request in
:data:`failslow.conformance.requests.REQUESTS` was made on every rank after the reference run.
An unsupported capability must raise :class:`~failslow.capabilities.Unsupported` naming it and
carrying the declared reason; a supported one must not raise. Tests of a capability's invariant
skip with the declared reason (:func:`failslow.conformance.fixtures.require`).
"""

from __future__ import annotations

import pytest

from failslow.capabilities import Capabilities
from failslow.conformance.fixtures import ConformanceFixtures
from failslow.conformance.world import LayoutRun


class AbstractCapabilityTests(ConformanceFixtures):
    @pytest.mark.parametrize("capability", Capabilities.names())
    def test_asking_for_a_capability(self, layout_run: LayoutRun, capability: str) -> None:
        for rank_run in layout_run.ranks:
            record = rank_run.result["requests"][capability]
            declared = record["declared"]
            where = f"layout {layout_run.layout!r}, rank {rank_run.rank}, {capability}"
            if declared:
                assert record["raised"] == "Unsupported", (
                    f"{where}: declared unsupported ({declared!r}), but asking for it "
                    f"{'raised ' + record['raised'] if record['raised'] else 'did not raise'}: "
                    f"{record.get('message', '')}\n{record.get('traceback', '')}"
                )
                assert record["capability"] == capability, where
                assert declared in record["message"], (
                    f"{where}: the error does not carry the declared reason: {record['message']!r}"
                )
            else:
                assert record["raised"] is None, (
                    f"{where}: declared supported, but asking for it raised "
                    f"{record['raised']}: {record['message']}\n{record.get('traceback', '')}"
                )

    def test_every_rank_declares_the_same(self, layout_run: LayoutRun) -> None:
        first = layout_run.ranks[0].result
        for rank_run in layout_run.ranks[1:]:
            assert rank_run.result["capabilities"] == first["capabilities"], rank_run.rank
            assert rank_run.result["topology"] == first["topology"], rank_run.rank
        assert set(first["capabilities"]) == set(Capabilities.names())

    def test_topology_covers_the_world(self, layout_run: LayoutRun) -> None:
        topology = layout_run.ranks[0].result["topology"]
        world = len(layout_run.ranks)
        assert topology["tp"] * topology["dp"] * topology["pp"] == world, topology
        assert len(topology["coords"]) == world
        assert topology["micro_batches"] % topology["dp"] == 0, topology
        for rank_run in layout_run.ranks:
            assert rank_run.result["replica"] == topology["coords"][rank_run.rank][1]
