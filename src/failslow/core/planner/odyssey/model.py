"""Inputs of the Odyssey performance model: the profiled model and the cluster after a failure.

Odyssey III (Definition 1: a state is the cluster status plus an execution plan) and IV-C (the
estimator works from layer-wise profiling: ``Tf``, ``Tb``, ``m_p``, ``m_o``, ``m_g``, ``m_a``).
Both records are plain numbers so the simulator, the controller and the tests build them alike.

A *node* is what Odyssey places in one pipeline slot: the device group that runs one
``(dp, pp)`` position (``devices_per_node`` = the job's TP degree). Times are seconds, sizes
are bytes, bandwidths bytes per second. Per-layer sizes are per device as profiled at the job's
TP degree, and ``memory_capacity_bytes`` is one device's memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from failslow.core.topology import Topology
from failslow.errors import ConfigError


def _check(name: str, value: float, *, positive: bool = False) -> None:
    if not isinstance(value, int | float) or math.isnan(value) or value < 0:
        raise ConfigError(f"odyssey: {name} must be a non-negative number, got {value!r}")
    if positive and value == 0:
        raise ConfigError(f"odyssey: {name} must be positive, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """Layer-wise profile of the model (odyssey IV-C), at the reference micro-batch size.

    ``forward_s``/``backward_s`` are ``Tf``/``Tb`` of *one layer* for one micro-batch; a stage
    with ``l`` layers takes ``l * Tf`` (plus the first/last stage extras below). The paper
    models neither the embedding nor the head; their extras default to zero, which reproduces
    its equations exactly.
    """

    num_layers: int
    forward_s: float
    backward_s: float
    param_bytes: float = 0.0
    """m_p: parameters of one layer."""
    optimizer_bytes: float = 0.0
    """m_o: optimizer state of one layer."""
    grad_bytes: float | None = None
    """m_g: gradients of one layer; None means m_g = m_p, as the paper states."""
    activation_bytes: float = 0.0
    """m_a: activations one micro-batch leaves stored in one layer until its backward."""
    first_stage_forward_s: float = 0.0
    """Extra forward time of the first stage per micro-batch (embedding)."""
    first_stage_backward_s: float = 0.0
    last_stage_forward_s: float = 0.0
    """Extra forward time of the last stage per micro-batch (output head and loss)."""
    last_stage_backward_s: float = 0.0
    first_stage_bytes: float = 0.0
    """Extra static memory of the first stage (embedding weights, grads, optimizer state)."""
    last_stage_bytes: float = 0.0
    p2p_bytes: float = 0.0
    """Activation (and activation-gradient) bytes sent between adjacent stages per micro-batch."""
    p2p_bandwidth_Bps: float = math.inf
    dp_bandwidth_Bps: float = math.inf
    """Bus bandwidth of a DP gradient all-reduce (ring: 2(n-1)/n * bytes / bandwidth)."""
    allreduce_latency_s: float = 0.0
    """Fixed cost of one all-reduce call; the paper gives none."""
    memory_capacity_bytes: float = math.inf

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ConfigError(
                f"odyssey: num_layers must be a positive integer, got {self.num_layers!r}"
            )
        for name in (
            "forward_s",
            "backward_s",
            "param_bytes",
            "optimizer_bytes",
            "activation_bytes",
            "first_stage_forward_s",
            "first_stage_backward_s",
            "last_stage_forward_s",
            "last_stage_backward_s",
            "first_stage_bytes",
            "last_stage_bytes",
            "p2p_bytes",
            "allreduce_latency_s",
        ):
            _check(name, getattr(self, name))
        if self.grad_bytes is not None:
            _check("grad_bytes", self.grad_bytes)
        for name in ("p2p_bandwidth_Bps", "dp_bandwidth_Bps", "memory_capacity_bytes"):
            _check(name, getattr(self, name), positive=True)

    @property
    def layer_grad_bytes(self) -> float:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def p2p_s(self) -> float:
        """Time of one stage-to-stage activation transfer."""
        return self.p2p_bytes / self.p2p_bandwidth_Bps

    def stage_forward_s(self, layers: int, stage: int, num_stages: int) -> float:
        """Forward time of one micro-batch on stage ``stage`` holding ``layers`` layers."""
        extra = self.first_stage_forward_s if stage == 0 else 0.0
        if stage == num_stages - 1:
            extra += self.last_stage_forward_s
        return layers * self.forward_s + extra

    def stage_backward_s(self, layers: int, stage: int, num_stages: int) -> float:
        extra = self.first_stage_backward_s if stage == 0 else 0.0
        if stage == num_stages - 1:
            extra += self.last_stage_backward_s
        return layers * self.backward_s + extra

    def allreduce_s(self, nbytes: float, participants: int) -> float:
        """Ring all-reduce of ``nbytes`` among ``participants`` ranks (0 for a single rank)."""
        if participants <= 1 or nbytes <= 0:
            return 0.0
        wire = 2.0 * (participants - 1) / participants * nbytes / self.dp_bandwidth_Bps
        return self.allreduce_latency_s + wire


def balanced_split(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage as even as possible, the remainder on the first stages."""
    base, rest = divmod(num_layers, num_stages)
    return tuple(base + (1 if s < rest else 0) for s in range(num_stages))


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterState:
    """The current symmetric DP x PP layout and the nodes it has lost (odyssey III, Def. 1).

    ``failed_per_stage[i]`` is ``F_i`` of Eq. 13: failed nodes in stage ``i`` (empty: none).
    ``spare_nodes`` are healthy nodes outside the layout that a reconfiguration may use.
    ``layers_per_stage`` is the current split (empty: balanced).
    """

    dp: int
    pp: int
    failed_per_stage: tuple[int, ...] = ()
    layers_per_stage: tuple[int, ...] = ()
    spare_nodes: int = 0
    devices_per_node: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"odyssey: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.spare_nodes, int) or self.spare_nodes < 0:
            raise ConfigError(
                f"odyssey: spare_nodes must be a non-negative integer, got {self.spare_nodes!r}"
            )
        if self.failed_per_stage:
            if len(self.failed_per_stage) != self.pp:
                raise ConfigError(
                    f"odyssey: failed_per_stage has {len(self.failed_per_stage)} entries, "
                    f"expected pp = {self.pp}"
                )
            for i, f in enumerate(self.failed_per_stage):
                if not isinstance(f, int) or not 0 <= f <= self.dp:
                    raise ConfigError(
                        f"odyssey: failed_per_stage[{i}] must be an integer in [0, dp={self.dp}]"
                        f", got {f!r}"
                    )
        if self.layers_per_stage:
            if len(self.layers_per_stage) != self.pp:
                raise ConfigError(
                    f"odyssey: layers_per_stage has {len(self.layers_per_stage)} entries, "
                    f"expected pp = {self.pp}"
                )
            if any(not isinstance(n, int) or n < 1 for n in self.layers_per_stage):
                raise ConfigError(
                    f"odyssey: layers_per_stage must be positive integers, "
                    f"got {self.layers_per_stage!r}"
                )

    @property
    def failures(self) -> tuple[int, ...]:
        """``F_i`` for every stage (zeros when none were given)."""
        return self.failed_per_stage or (0,) * self.pp

    @property
    def failed_nodes(self) -> int:
        """N_f, the number of failed nodes."""
        return sum(self.failures)

    @property
    def nodes_available(self) -> int:
        """Healthy nodes a new plan may use: the layout's survivors plus the spares."""
        return self.dp * self.pp - self.failed_nodes + self.spare_nodes

    def split(self, num_layers: int) -> tuple[int, ...]:
        """The current layers per stage (balanced when none were given)."""
        if self.layers_per_stage:
            if sum(self.layers_per_stage) != num_layers:
                raise ConfigError(
                    f"odyssey: layers_per_stage sums to {sum(self.layers_per_stage)}, "
                    f"but the model has {num_layers} layers"
                )
            return self.layers_per_stage
        if self.pp > num_layers:
            raise ConfigError(f"odyssey: pp = {self.pp} stages but only {num_layers} layers")
        return balanced_split(num_layers, self.pp)

    @classmethod
    def from_topology(
        cls, topology: Topology, failed_hosts: Iterable[str] = (), *, spare_nodes: int = 0
    ) -> ClusterState:
        """The layout of ``topology`` with every ``(dp, pp)`` slot that had a rank on a failed
        host counted as a failed node of its stage."""
        failed = set(failed_hosts)
        unknown = failed - set(topology.hosts)
        if unknown:
            raise ConfigError(f"odyssey: failed hosts {sorted(unknown)} are not in the topology")
        lost = {
            (d, p)
            for rank, (_, d, p) in enumerate(topology.coords)
            if topology.hosts[rank] in failed
        }
        per_stage = tuple(sum(1 for _, p in lost if p == s) for s in range(topology.pp))
        return cls(
            dp=topology.dp,
            pp=topology.pp,
            failed_per_stage=per_stage,
            layers_per_stage=topology.layers_per_stage,
            spare_nodes=spare_nodes,
            devices_per_node=topology.tp,
        )
