"""The node layer: what runs beside the rank processes, outside them.

DESIGN.md, "Packages": :mod:`.launcher` (``failslow run``: capture on, the job's control plane
beside it, restarts in place), :mod:`.hot_update` (byterobust 6.1) and :mod:`.publisher` (the
node's onsets, reliefs and group summaries to the control store, greyhound 4.1).
"""
