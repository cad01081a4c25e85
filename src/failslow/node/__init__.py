"""The node layer: what runs beside the rank processes, outside them.

DESIGN.md, "Packages": :mod:`.launcher` (``failslow run``: capture on, restarts in place),
:mod:`.control` (this node's part of the job's control: the publisher, and on one node the
controller and mitigator), :mod:`.publisher` (the node's onsets, reliefs and group summaries to
the control store, greyhound 4.1) and :mod:`.hot_update` (byterobust 6.1).
"""
