"""What is known about how long a fail-slow lasts (greyhound 3, Fig. 1 and Table 1).

greyhound's characterization of a production cluster: computation fail-slows (GPU or CPU
contention) last about 10 minutes on average; communication fail-slows (congestion) about 24
minutes in small jobs and about 72 minutes in jobs of 512 GPUs or more; both are heavy-tailed.
:class:`DurationPrior` is that knowledge as a lognormal distribution with the characterization's
mean, and answers the one question the planner asks of it: having lasted ``t`` seconds, how
much longer is a fail-slow expected to last (its mean residual life)? For a heavy tail that
grows with ``t``: a fail-slow that has lasted long is likely to last longer.

All closed forms; no scipy. ``E[D - t | D > t]`` for ``ln D ~ N(mu, sigma^2)``::

    exp(mu + sigma^2 / 2) * Phi((mu + sigma^2 - ln t) / sigma) / Phi((mu - ln t) / sigma) - t

with the asymptote ``t * sigma^2 / (ln t - mu - sigma^2)`` (Mills' ratio) where both tails
underflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from failslow.core.diagnosis.record import Kind
from failslow.errors import ConfigError

COMPUTE_MEAN_S = 10 * 60.0
"""greyhound 3: computation fail-slows last ~10 minutes on average."""
COMMUNICATION_MEAN_S = 24 * 60.0
"""greyhound 3: communication fail-slows in small jobs last ~24 minutes on average."""
COMMUNICATION_AT_SCALE_MEAN_S = 72 * 60.0
"""greyhound 3: communication fail-slows in jobs of >= 512 GPUs last ~72 minutes."""
AT_SCALE_GPUS = 512
SIGMA = 1.0
"""Log-space spread: heavy-tailed (the 95th percentile is ~3x the mean)."""


def _upper_normal(x: float) -> float:
    """P(Z > x) for a standard normal Z, accurate in the far tail (erfc, not 1 - cdf)."""
    return 0.5 * math.erfc(x / math.sqrt(2.0))


@dataclass(frozen=True)
class DurationPrior:
    """A lognormal fail-slow duration with mean ``mean_s`` and log-space spread ``sigma``."""

    mean_s: float
    sigma: float = SIGMA

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean_s) and self.mean_s > 0):
            raise ConfigError(f"duration prior: mean must be > 0 seconds, got {self.mean_s}")
        if not (math.isfinite(self.sigma) and self.sigma > 0):
            raise ConfigError(f"duration prior: sigma must be > 0, got {self.sigma}")

    @property
    def mu(self) -> float:
        return math.log(self.mean_s) - self.sigma**2 / 2.0

    def survival(self, t: float) -> float:
        """P(D > t)."""
        if t <= 0.0:
            return 1.0
        return _upper_normal((math.log(t) - self.mu) / self.sigma)

    def mean_residual(self, t: float) -> float:
        """E[D - t | D > t]: seconds still to come for a fail-slow that has lasted ``t``."""
        if t <= 0.0:
            return self.mean_s
        z = (math.log(t) - self.mu) / self.sigma
        tail = _upper_normal(z)
        if tail > 1e-250:
            partial = self.mean_s * _upper_normal(z - self.sigma)  # E[D; D > t]
            return max(partial / tail - t, 0.0)
        return t * self.sigma**2 / max(math.log(t) - self.mu - self.sigma**2, 1e-9)


@dataclass(frozen=True)
class DurationPriors:
    """The prior of each diagnosis kind for one job (its size picks the communication one)."""

    compute: DurationPrior
    communication: DurationPrior

    @classmethod
    def characterization(cls, world_size: int, *, sigma: float = SIGMA) -> DurationPriors:
        """greyhound 3's means, for a job of ``world_size`` GPUs."""
        comm = (
            COMMUNICATION_AT_SCALE_MEAN_S if world_size >= AT_SCALE_GPUS else COMMUNICATION_MEAN_S
        )
        return cls(DurationPrior(COMPUTE_MEAN_S, sigma), DurationPrior(comm, sigma))

    def of(self, kind: Kind) -> DurationPrior:
        """A mixed fail-slow lasts as long as its longer part is expected to."""
        return self.compute if kind is Kind.COMPUTE else self.communication
