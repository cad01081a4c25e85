"""Localization (greyhound 4.3): from "the job got slower" to "this rank or this link".

:mod:`.summaries` (per-group call summaries a node publishes), :mod:`.profiling` (cross-group
profiling: comparable clusters, degraded groups, late ranks), :mod:`.validation` (GEMM and O(1)
ring/tree link tests run while the job is paused) and :mod:`.diagnose` (the tests' results as a
Diagnosis).
"""
