"""The rank runtime: what runs inside every training process besides the framework.

DESIGN.md, "Packages": :mod:`.session` (lifecycle and the step boundary an adapter drives),
:mod:`.plan_application` (plans in two phases, all ranks switch or all roll back),
:mod:`.snapshot_service` (in-memory snapshots, backups on peers, resume; byterobust 6.3),
:mod:`.job_report` (rank 0's job record and step times for the controller),
:mod:`.rank_control` and :mod:`.agent` (the agent that pauses the rank for validation,
greyhound 4.3), :mod:`.auto` (the same from the environment, for unmodified scripts under
``failslow run``) and :mod:`.teardown` (clean exits). The runtime owns every thread it starts and
stops them all at exit.
"""

from __future__ import annotations

from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "_site"
"""The directory ``failslow run`` puts first on ``PYTHONPATH``: its ``sitecustomize`` starts the
runtime (:mod:`.auto`) in every Python process once it imports torch."""
