"""Settings of the mitigation planner (greyhound 5: ski-rental over S1-S4).

Composed into the ``planner`` section of :class:`failslow.config.FailslowConfig`; the mitigator
(:mod:`failslow.core.control.mitigator`) turns them into the planner's
:class:`~failslow.core.planner.planner.MitigationCosts` and plan-channel timing.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("S2", "S3", "S4")
"""The levels above S1 (ignore): micro-batch redistribution, topology swap, restart."""
RULES = ("expected", "break-even")
"""When to buy a level: expected cost under the duration prior, or greyhound's Algorithm 1."""


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    strategies: tuple[str, ...] = STRATEGIES
    """Mitigation levels the planner may buy (greyhound 5; the adapter's capabilities also
    filter them)."""
    min_gain: float = 0.05
    """Skip a level whose estimated step time is not this much better than the observed one."""
    rule: str = "expected"
    """``expected``: buy the level that saves the most expected rent over the fail-slow's
    expected remaining duration (greyhound 3's characterization as the prior), within the
    bounds below; ``break-even``: greyhound's Algorithm 1 (buy when the impact reaches the
    overhead, cheapest first)."""
    earliest: float = 0.5
    """``expected`` never buys a level before the impact reaches this share of its overhead
    (worst case 1 + 1/earliest times the hindsight optimum)."""
    compute_mean_s: float = 600.0
    """Mean duration of a computation fail-slow (greyhound 3: ~10 minutes)."""
    communication_mean_s: float = 0.0
    """Mean duration of a communication fail-slow; 0: greyhound 3's 24 minutes, or 72 minutes
    in jobs of 512 GPUs or more."""
    duration_sigma: float = 1.0
    """Log-space spread of the lognormal duration prior (heavy-tailed)."""
    microbatch_apply_s: float = 0.5
    """Estimated cost of switching micro-batch plans (prepare, commit, one step boundary)."""
    pause_s: float = 30.0
    """Estimated pause of a topology swap."""
    restart_s: float = 300.0
    """Estimated restart from in-memory checkpoints without the evicted hosts."""
    transfer_gbps: float = 100.0
    """State transfer bandwidth between hosts, Gbit/s."""
    plan_timeout_s: float = 60.0
    """Every rank must accept a plan within this long, or it is aborted everywhere."""
    keep_steps: int = 10
    """After a plan's verdict it is judged again over windows of this many steps; two short
    windows in a row and it *stopped paying* (re-planned, kept or reverted:
    :mod:`failslow.core.control.closed_loop`). 0: a plan is not watched after its verdict."""
    horizon_s: float = 1.0
    """A plan takes effect about this long after every rank accepted it (in steps at the
    job's step rate, at least 2 steps): ranks never block while the decision travels."""
