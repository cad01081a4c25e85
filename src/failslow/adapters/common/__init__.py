"""The adapter kit: what every framework adapter needs and none should write again.

DESIGN.md, "Packages": :mod:`.session` (start an adapter's session), :mod:`.topology` (the job's
layout gathered from every rank), :mod:`.state` (model, optimizer, RNG and counter state for
bitwise snapshots), :mod:`.microbatch` (per-replica micro-batch counts and their weights
w_r = m_r * D / M, greyhound 5.2), :mod:`.loop` (the step and accumulation boundaries in the
loop users write; an adapter's own ``train_batch``) and :mod:`.data` (each replica's exact share
of every global batch). An adapter built on the kit only translates its framework's events into
these calls and the session's hooks.
"""
