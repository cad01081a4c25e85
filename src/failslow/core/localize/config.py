"""Settings of the localization stage: detection thresholds and the validation tests.

greyhound 4.3: a group or rank is slow at more than 1.1x its peers' median; validation pauses
the job and runs GEMM and O(1) ring/tree link tests. Composed into the ``detection`` and
``validation`` sections of :class:`failslow.config.FailslowConfig`; the controller
(:mod:`failslow.core.control.controller`) takes them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class DetectionConfig:
    threshold: float = 1.1
    """A rank or group is slow at > threshold x its peers' median (greyhound 4.3); an onset
    from threshold x the level the diagnosed fail-slow started from is a new step up."""
    cooldown_s: float = 30.0
    """Onsets this soon after a diagnosis (and no relief since) belong to the same fail-slow -
    other ranks report the job-wide slowdown a few iterations later - unless they step up from
    its slow level (a ladder's next rung, a second fault): those are localized at once."""


@dataclass(kw_only=True, slots=True)
class ValidationConfig:
    gemm_size: int | None = None
    """Side of the square GEMM each rank times (greyhound 4.3); None: the device's default
    (1024 on CPU, 8192 on GPU)."""
    gemm_dtypes: tuple[str, ...] = ()
    """Data types the GEMM is timed in; empty: the device's defaults."""
    gemm_repetitions: int = 3
    gemm_serial: bool = False
    """Ranks take turns (for CPU ranks that share cores; GPUs measure at once)."""
    gemm_confirm: bool = True
    """Repeat before blame: when the GEMM names a rank slow (the detection threshold), every
    rank times it again and keeps the fastest of both (issue 49: preemption on a busy machine
    named healthy ranks; a sustained slowdown slows both timings)."""
    link_mb: int = 16
    """Bytes per O(1) ring/tree link test, in MiB."""
    link_repetitions: int = 3
    pause_margin_s: float | None = None
    """How far ahead of the ranks' extrapolated positions the pause lands (calls/s x margin);
    must cover the agents' poll period (they see the request within one poll). None: 1.5 x the
    slowest agent's poll period, as the agents publish it (0.3 s at the default 0.2 s poll;
    a fixed margin of a few tenths of a second is many iterations of a short-step job)."""
    pause_attempts: int = 3
    """A round whose target some rank had passed is released at once and retried, each time
    with twice the margin."""
    pause_timeout_s: float = 60.0
    """Every rank must park and finish the round's tasks within this long (else released)."""
    recheck_every_s: float = 60.0
    """While a mitigation is in effect, re-validate this often to see the fail-slow end (and at
    once on a relief: a plan that hides the slowdown also hides its end from detection)."""

    def gemm_task(self, threshold: float | None = None) -> dict[str, object]:
        """The GEMM validation task every rank runs (:func:`failslow.runtime.agent.run_task`);
        ``threshold``: the slowdown that names a rank (confirmed by a second timing when
        :attr:`gemm_confirm`)."""
        task: dict[str, object] = {
            "kind": "gemm",
            "repetitions": self.gemm_repetitions,
            "serial": self.gemm_serial,
        }
        if self.gemm_confirm and threshold is not None:
            task["confirm"] = threshold
        if self.gemm_size:
            task["size"] = self.gemm_size
        if self.gemm_dtypes:
            task["dtypes"] = list(self.gemm_dtypes)
        return task
