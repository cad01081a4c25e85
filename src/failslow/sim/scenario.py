"""Simulator scenarios: a job layout, its healthy step model, costs, and injected faults.

Shipped scenarios (``failslow simulate NAME``):

- ``greyhound-table6``: greyhound 7.5 - 256 GPUs as 8TP x 16DP x 2PP on 32 hosts, 2 medium
  communication fail-slows and 3 weak / 5 medium / 2 severe compute fail-slows, some compound,
  on the paper's timeline (Fig. 20: congestion around t=850-1150 s and 2100-2350 s). The
  paper does not give its severities; ours (weak 2.5x, medium 4x, severe 8x for a GPU, 16x for
  a congested link: :data:`SEVERITY`, :data:`LINK_SEVERITY`) are calibrated to the one impact
  figure it gives: unmitigated, its job kept 51% of its throughput (18.9 of 37.4 it/min), ours
  keeps 53%. ``scale-16k`` draws from the same severities.
- ``odyssey-vb``: odyssey V-B - 32 devices (PP4 x DP8), device failures at 10% per device
  per hour for 9 hours, each repaired after a drawn repair time.
- ``odyssey-vb-paper``: the same as the paper ran it - no repairs during the 9 hours, so the
  degraded layouts accumulate (its Fig. 9).
- ``mixed-1k``: failslow's own, 1,024 GPUs with heavy-tailed GPU and link fail-slows and host
  fail-stops, where the policies differ for reasons the benchmarks README explains.
- ``scale-16k``: 16,384 GPUs (8TP x 256DP x 8PP, 2,048 hosts), fail-slows drawn from
  greyhound's characterization (3: compute lasts ~10 min, communication ~72 min at scale)
  plus two host fail-stops, for two hours.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from failslow.core.diagnosis.record import Kind
from failslow.core.diagnosis.standby import standby_count
from failslow.core.planner.odyssey import ModelProfile
from failslow.core.topology import Topology
from failslow.errors import ConfigError
from failslow.sim.stepmodel import StepModel, step_time

SEVERITY = {"weak": 2.5, "medium": 4.0, "severe": 8.0}
LINK_SEVERITY = {"weak": 4.0, "medium": 16.0, "severe": 32.0}


@dataclass(frozen=True)
class FailSlow:
    """A degraded GPU (``gpu`` = (host, local index)) or link (``link`` = two hosts)."""

    start_s: float
    duration_s: float
    kind: Kind
    slowdown: float
    gpu: tuple[str, int] | None = None
    link: tuple[str, str] | None = None
    label: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class FailStop:
    time_s: float
    host: str
    repair_s: float


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What mitigation and recovery cost in the simulated cluster (seconds, bytes).

    The defaults are the papers' measurements on GPU clusters (each field says which); a
    scenario overrides a field with the project's own measurement where one applies at its
    scale (``mixed-1k``: detection). The S2 switch is not here: the planner measures its own
    solve time in every run. One CPU machine cannot measure NCCL re-initialization, a
    10 GB-per-GPU state move or a scheduler's requeue, so the S3 pause and the restarts stay
    the papers' until the fail-stop work (issue 16) measures a standby restart.
    """

    detect_s: float = 10.56
    """Onset to diagnosis (greyhound Table 6: BOCD 3.7 s + profiling and validation 6.86 s)."""
    relief_detect_s: float = 5.0
    state_bytes_per_rank: int = 10 * 2**30
    """Weights + optimizer state per GPU that a topology swap moves (greyhound Fig. 19: 10 GB)."""
    transfer_bytes_per_s: float = 12.5e9
    """Host-to-host bandwidth for state moves (one 100 Gb/s NIC's worth)."""
    pause_s: float = 20.0
    """Pause, regroup communicators and resume around a topology swap (Fig. 19)."""
    restart_disk_s: float = 1500.0
    """Checkpoint to remote storage, reschedule and load (greyhound 5.1: tens of minutes)."""
    restart_memory_s: float = 120.0
    """Restart from in-memory checkpoints onto a warm standby (byterobust 6)."""
    checkpoint_interval_s: float = 1800.0
    """Remote checkpoint period; a fail-stop loses half of it on average without in-memory ones."""
    replan_s: float = 60.0
    """Odyssey: restart the job in a new parallel layout (plus the state moves)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    topology: Topology
    model: StepModel
    duration_s: float
    events: tuple[FailSlow | FailStop, ...]
    costs: Costs = field(default_factory=Costs)
    policies: tuple[str, ...] = ()
    profile: ModelProfile | None = None
    """Layer profile for odyssey's fail-stop planning (None: no re-planning possible)."""
    host_failures_per_hour: float = 0.0
    """Expected fail-stops per host per hour (odyssey's horizon: time to the next fault)."""
    spares: int = 0
    """Warm standby hosts (byterobust 6.2); a restart onto a standby needs one."""


def _non_interleaved(topology: Topology) -> Topology:
    """A Megatron job on the non-interleaved 1F1B schedule (the one the step model times): the
    failslow Megatron adapter declares that any micro-batch count per replica runs
    (``microbatch_multiple=1``); the greyhound policy keeps the paper's multiple of PP."""
    return replace(topology, microbatch_multiple=1)


def _host(i: int) -> str:
    return f"node{i:05d}"


def greyhound_table6() -> Scenario:
    """greyhound 7.5, with greyhound's own measured costs (:class:`Costs` defaults: Table 6
    detection, Fig. 19 pause), so that its policy runs in the paper's setting."""
    topo = _non_interleaved(
        Topology.megatron(tp=8, dp=16, pp=2, gpus_per_host=8, micro_batches=128)
    )
    # 8 micro-batches per replica: (2 + 8 - 1) x 0.15 s pipeline + 0.25 s DP sync = 1.6 s/step,
    # greyhound's 37.4 iterations/minute.
    model = StepModel(forward_s=0.05, backward_s=0.10, p2p_s=0.004, dp_sync_s=0.25)

    # replica d, stage p lives on host d + 16 p; hosts 5 and 6 are DP ring neighbours.
    def gpu(label: str, start: float, end: float, host: int, index: int = 0) -> FailSlow:
        return FailSlow(
            start,
            end - start,
            Kind.COMPUTE,
            SEVERITY[label],
            gpu=(_host(host), index),
            label=f"{label} GPU",
        )

    def link(start: float, end: float, a: int, b: int) -> FailSlow:
        return FailSlow(
            start,
            end - start,
            Kind.COMMUNICATION,
            LINK_SEVERITY["medium"],
            link=(_host(a), _host(b)),
            label="medium link",
        )

    events = (
        gpu("weak", 150, 420, 3),
        gpu("medium", 500, 780, 10, 2),
        link(850, 1150, 5, 6),
        gpu("medium", 950, 1100, 20),
        gpu("weak", 1250, 1450, 27, 5),
        gpu("severe", 1550, 1700, 12, 1),
        gpu("medium", 1800, 2000, 2, 7),
        link(2100, 2350, 21, 22),
        gpu("medium", 2150, 2300, 8),
        gpu("severe", 2450, 2600, 30, 3),
        gpu("weak", 2650, 2850, 14),
        gpu("medium", 2700, 2900, 17, 4),
    )
    return Scenario(
        "greyhound-table6",
        "greyhound 7.5: 256 GPUs (8TP x 16DP x 2PP, 32 hosts), 2 medium link + 3 weak / 5 "
        "medium / 2 severe GPU fail-slows, some compound",
        topo,
        model,
        3000.0,
        events,
        policies=("none", "restart", "greyhound", "failslow", "oracle"),
        spares=standby_count(32, 0.01),
    )


def _poisson_times(rng: np.random.Generator, rate_per_s: float, horizon_s: float) -> list[float]:
    times, t = list[float](), 0.0
    while True:
        t += rng.exponential(1.0 / rate_per_s)
        if t >= horizon_s:
            return times
        times.append(t)


def odyssey_vb(seed: int = 0, *, repairs: bool = True) -> Scenario:
    """odyssey V-B. ``repairs=False`` is the paper's own run: failed devices stay down for the
    9 hours (its Fig. 9: the active nodes only decrease), so degraded layouts accumulate; each
    alive device fails at 10% per hour. With repairs, each failure is repaired after 30-90
    minutes and the failure rate is over all 32 devices."""
    topo = Topology.megatron(tp=1, dp=8, pp=4, gpus_per_host=1, micro_batches=64)
    model = StepModel(forward_s=0.1, backward_s=0.2, p2p_s=0.01, dp_sync_s=0.4)
    # Llama-2-7B-like: 32 layers, 8 per stage; the per-layer times add up to StepModel's.
    profile = ModelProfile(
        num_layers=32,
        forward_s=0.1 / 8,
        backward_s=0.2 / 8,
        param_bytes=0.4e9,
        optimizer_bytes=2.4e9,
        activation_bytes=0.1e9,
        p2p_bytes=16e6,
        p2p_bandwidth_Bps=1.6e9,
        dp_bandwidth_Bps=25e9,
        memory_capacity_bytes=64e9,
    )
    rng = np.random.default_rng(seed)
    duration = 9 * 3600.0
    events: list[FailSlow | FailStop] = []
    if repairs:
        # 10% per device per hour over 32 devices: one failure every ~19 minutes on average
        for t in _poisson_times(rng, 0.10 * topo.world_size / 3600.0, duration):
            host = _host(int(rng.integers(topo.world_size)))
            events.append(FailStop(t, host, float(rng.uniform(1800.0, 5400.0))))
    else:
        alive = list(range(topo.world_size))
        t = 0.0
        while alive:
            t += rng.exponential(3600.0 / (0.10 * len(alive)))
            if t >= duration:
                break
            device = alive.pop(int(rng.integers(len(alive))))
            events.append(FailStop(t, _host(device), 2 * duration))  # never back in the run
    name = "odyssey-vb" if repairs else "odyssey-vb-paper"
    what = "repaired after 30-90 min" if repairs else "never repaired (the paper's run)"
    return Scenario(
        name,
        f"odyssey V-B: 32 devices (4PP x 8DP), 10%/device/hour failures, {what}, 9 hours",
        topo,
        model,
        duration,
        tuple(events),
        policies=("none", "oobleck", "recycle", "odyssey", "failslow", "oracle"),
        profile=profile,
        host_failures_per_hour=0.10,
    )


def _gpu_failslows(
    rng: np.random.Generator,
    per_hour: float,
    duration_s: float,
    hosts: int,
    *,
    mu: float,
    sigma: float,
) -> list[FailSlow]:
    """GPU fail-slows as a Poisson process: 30% weak / 50% medium / 20% severe, lognormal
    durations (``mu``, ``sigma`` in log-seconds), on a random GPU of 8 on a random host."""
    out = []
    for t in _poisson_times(rng, per_hour / 3600.0, duration_s):
        label = str(rng.choice(["weak", "medium", "severe"], p=[0.3, 0.5, 0.2]))
        out.append(
            FailSlow(
                t,
                float(rng.lognormal(mu, sigma)),
                Kind.COMPUTE,
                SEVERITY[label],
                gpu=(_host(int(rng.integers(hosts))), int(rng.integers(8))),
                label=f"{label} GPU",
            )
        )
    return out


def scale_16k(seed: int = 0) -> Scenario:
    """16k GPUs with the papers' costs (:class:`Costs` defaults); links congest between DP ring
    neighbours, which the job's gradient all-reduce crosses."""
    topo = _non_interleaved(
        Topology.megatron(tp=8, dp=256, pp=8, gpus_per_host=8, micro_batches=4096)
    )
    model = StepModel(forward_s=0.02, backward_s=0.04, p2p_s=0.002, dp_sync_s=0.6)
    rng = np.random.default_rng(seed)
    duration = 2 * 3600.0
    hosts = len(topo.host_names)
    events: list[FailSlow | FailStop] = []
    events += _gpu_failslows(rng, 12, duration, hosts, mu=math.log(600), sigma=0.6)
    for t in _poisson_times(rng, 2 / 3600.0, duration):  # congestion, ~72 min at scale
        a = int(rng.integers(hosts - 1))
        events.append(
            FailSlow(
                t,
                float(rng.lognormal(math.log(2400), 0.5)),
                Kind.COMMUNICATION,
                LINK_SEVERITY["medium"],
                link=(_host(a), _host(a + 1)),  # DP ring neighbours (one host per TP group)
                label="medium link",
            )
        )
    events += [
        FailStop(2400.0, _host(int(rng.integers(hosts))), 3600.0),
        FailStop(5000.0, _host(int(rng.integers(hosts))), 3600.0),
    ]
    return Scenario(
        "scale-16k",
        "16,384 GPUs (8TP x 256DP x 8PP, 2,048 hosts), characterization-drawn fail-slows and "
        "two host fail-stops, 2 hours",
        topo,
        model,
        duration,
        tuple(sorted(events, key=_event_time)),
        policies=("none", "restart", "greyhound", "failslow", "oracle"),
        spares=standby_count(hosts, 0.01),
    )


REACTION_ITERATIONS = 13
"""Onset -> diagnosis, median iterations (benchmarks/reaction_time.py, benchmarks/README.md)."""


def mixed_1k(seed: int = 0) -> Scenario:
    """failslow's own: where the policies differ, and why (benchmarks/README.md, Simulator).

    1,024 GPUs (8TP x 32DP x 4PP, 128 hosts, 8 micro-batches per replica) for 4 hours. GPU
    fail-slows (~8 per hour) and congested links (~1.5 per hour; half on a DP ring, half between
    pipeline stages) with greyhound 3's heavy-tailed durations (lognormal, sigma 1, means 10 and
    72 minutes at this scale) and severities, plus host fail-stops (~1 per hour, back after 1-2
    hours). Costs: detection is the project's measured 13 iterations onset -> diagnosis
    (benchmarks/reaction_time.py) at this job's healthy step; the S2 switch is the planner's
    measured solve time; the S3 pause (20 s + 10 GB per GPU at 12.5 GB/s) and the restarts
    (120 s from memory onto a warm standby, 1500 s through remote storage) are the papers'
    (greyhound Fig. 19 and 5.1, byterobust 6), since one CPU machine cannot measure NCCL
    re-initialization or a scheduler's requeue at 1,024 GPUs.
    """
    topo = _non_interleaved(
        Topology.megatron(tp=8, dp=32, pp=4, gpus_per_host=8, micro_batches=256)
    )
    model = StepModel(forward_s=0.04, backward_s=0.08, p2p_s=0.003, dp_sync_s=0.35)
    rng = np.random.default_rng(seed)
    duration = 4 * 3600.0
    hosts = len(topo.host_names)
    events: list[FailSlow | FailStop] = []
    events += _gpu_failslows(rng, 8, duration, hosts, mu=math.log(600) - 0.5, sigma=1.0)
    for t in _poisson_times(rng, 1.5 / 3600.0, duration):
        label = str(rng.choice(["weak", "medium"], p=[0.5, 0.5]))
        a = int(rng.integers(hosts - 32))
        b = a + 1 if rng.random() < 0.5 else a + 32  # DP ring neighbour or next stage
        events.append(
            FailSlow(
                t,
                float(rng.lognormal(math.log(72 * 60) - 0.5, 1.0)),
                Kind.COMMUNICATION,
                LINK_SEVERITY[label],
                link=(_host(a), _host(b)),
                label=f"{label} link",
            )
        )
    for t in _poisson_times(rng, 1 / 3600.0, duration):
        events.append(
            FailStop(t, _host(int(rng.integers(hosts))), float(rng.uniform(3600.0, 7200.0)))
        )
    healthy_step = step_time(topo, model, [topo.micro_batches // topo.dp] * topo.dp, {}, {})
    return Scenario(
        "mixed-1k",
        "failslow's own: 1,024 GPUs (8TP x 32DP x 4PP, 128 hosts), heavy-tailed GPU and link "
        "fail-slows and host fail-stops, 4 hours, measured detection latency",
        topo,
        model,
        duration,
        tuple(sorted(events, key=_event_time)),
        costs=Costs(detect_s=REACTION_ITERATIONS * healthy_step),
        policies=("none", "restart", "greyhound", "failslow", "oracle"),
        spares=standby_count(hosts, 0.01),
    )


def _event_time(event: FailSlow | FailStop) -> float:
    return event.start_s if isinstance(event, FailSlow) else event.time_s


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "greyhound-table6": greyhound_table6,
    "odyssey-vb": odyssey_vb,
    "odyssey-vb-paper": lambda: odyssey_vb(repairs=False),
    "scale-16k": scale_16k,
    "mixed-1k": mixed_1k,
}


def load_scenario(name: str) -> Scenario:
    """A shipped scenario by name."""
    try:
        return SCENARIOS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown scenario {name!r}; shipped scenarios: {', '.join(SCENARIOS)}"
        ) from None


__all__ = ["SCENARIOS", "Costs", "FailSlow", "FailStop", "Scenario", "load_scenario"]
