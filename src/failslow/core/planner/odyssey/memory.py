"""Peak memory of a pipeline stage (odyssey IV-C, Eq. 14) and the OOM filter of Algorithm 1.

``M_peak,i ~ N_li * (m_p + m_o + m_g) + (N_pp - i) * N_li * m_a``: static memory of the stage's
layers plus the activations of the ``N_pp - i`` micro-batches 1F1B keeps in flight on stage
``i`` (0-based) in its steady state. Bytes are per device.
"""

from __future__ import annotations

from collections.abc import Sequence

from failslow.core.planner.odyssey.model import ModelProfile


def stage_peak_memory(
    profile: ModelProfile,
    layers: int,
    stage: int,
    num_stages: int,
    *,
    micro_batches: int | None = None,
) -> float:
    """Eq. 14 for stage ``stage`` (0-based) of ``num_stages`` holding ``layers`` layers.

    Adds the first/last stage's extra static bytes (zero by default, as in the paper). With
    ``micro_batches`` given, the in-flight count is capped at it (a pipeline with fewer
    micro-batches than stages never holds ``N_pp - i`` of them); the paper's formula is the
    default.
    """
    in_flight = num_stages - stage
    if micro_batches is not None:
        in_flight = min(in_flight, micro_batches)
    static = layers * (profile.param_bytes + profile.optimizer_bytes + profile.layer_grad_bytes)
    if stage == 0:
        static += profile.first_stage_bytes
    if stage == num_stages - 1:
        static += profile.last_stage_bytes
    return static + in_flight * layers * profile.activation_bytes


def peak_memory(
    profile: ModelProfile, layers_per_stage: Sequence[int], *, micro_batches: int | None = None
) -> float:
    """Largest Eq. 14 peak over the stages of one pipeline."""
    n = len(layers_per_stage)
    return max(
        (
            stage_peak_memory(profile, layers, s, n, micro_batches=micro_batches)
            for s, layers in enumerate(layers_per_stage)
        ),
        default=0.0,
    )


def fits_in_memory(
    profile: ModelProfile, layers_per_stage: Sequence[int], *, micro_batches: int | None = None
) -> bool:
    """The OOM filter: every stage's Eq. 14 peak fits ``profile.memory_capacity_bytes``."""
    return peak_memory(profile, layers_per_stage, micro_batches=micro_batches) <= (
        profile.memory_capacity_bytes
    )
