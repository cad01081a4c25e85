"""failslow: find and outlast fail-slow GPUs, CPUs and links in hybrid-parallel training.

Public API only; see ``failslow.core`` for the framework-agnostic pieces. ``hookimpl`` marks
plugin hook implementations (``@failslow.hookimpl def failslow_on_diagnosis(diagnosis): ...``);
the specs are in :mod:`failslow.hookspecs`.
"""

from __future__ import annotations

import pluggy

from failslow.errors import MetricIncidentError

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("failslow")


def report_metrics(step: int, /, **metrics: object) -> None:
    """Hand this step's training metrics to failslow, beside the line that logs them
    (``failslow.report_metrics(step, loss=loss, grad_norm=norm)``, or ``**metrics`` of a
    ``wandb.log`` dict). A loss or gradient norm that is NaN, infinite, or 5x its recent level
    is an incident (byterobust 4.1): under ``failslow run`` with in-memory snapshots the job
    rolls back to the newest snapshot before ``step``; otherwise
    :class:`MetricIncidentError` stops the script. Other
    metrics are ignored. Cheap: no collective, no I/O."""
    from failslow.runtime.metric_watch import report

    report(step, metrics)


def replaying() -> bool:
    """Whether this process is a replay of the stop-time ladder (byterobust 4.2: a group of
    machines replays the bad step to find a silent corruption). The training script runs as
    usual and ends at the replayed step by itself; skip what must not happen twice - writing a
    checkpoint to disk, logging to an experiment tracker."""
    import os

    from failslow import envvars

    return bool(os.environ.get(envvars.REPLAY))


__all__ = ["MetricIncidentError", "__version__", "hookimpl", "replaying", "report_metrics"]
