"""The adapter kit: what every framework adapter needs and none should write again.

DESIGN.md, "Packages": :mod:`.topology` (the job's layout gathered from every rank),
:mod:`.state` (RNG and counter state for bitwise snapshots), :mod:`.microbatch` (per-replica
micro-batch counts and their weights w_r = m_r * D / M, greyhound 5.2) and :mod:`.data` (each
replica's exact share of every global batch). An adapter built on the kit only translates its
framework's events into these calls and the session's hooks.
"""
