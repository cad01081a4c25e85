"""``failslow demo --framework deepspeed``: a fail-slow found and mitigated with no human step.

A 4-rank DeepSpeed ZeRO-1 job on CPU/gloo (:mod:`failslow.demo.ds_worker`) trains with failslow
enabled by its config block. Beside it this launcher runs what ``failslow run --controller``
runs - the node publisher, the controller and the mitigator (:mod:`failslow.node.control`) -
and, from outside, SIGSTOP/SIGCONT-cycles one rank (:class:`~failslow.faults.DutyCycleThrottle`)
from step ``slow_start`` to ``slow_end``. Then, automatically: onset (greyhound 4.2), profiling
and validation (4.3) naming the slow rank, the ski-rental planner buying S2 (5.2), every rank
switching to the uneven micro-batch counts at one step boundary, and after the release a
re-validation that reverts to the even split. The live view follows the job step by step; the
result is a throughput table (healthy, slowed, mitigated, after), ``steps.csv`` and a plot.

``--framework megatron`` runs a Megatron-core GPT instead (:mod:`failslow.demo.megatron_worker`),
``--framework accelerate`` an Accelerate job under ``accelerate launch`` (FSDP2 over every rank,
:mod:`failslow.demo.accelerate_worker`): one launcher process starts the ranks, and each rank
tells its PID for the throttle. ``--framework transformers`` is a Hugging Face Trainer job under
``accelerate launch`` (a GPT-2, DDP; :mod:`failslow.demo.transformers_worker`): S2 takes effect
inside ``trainer.train()`` by size - every replica runs its accumulation's micro-batches, the
slow one's hold fewer samples. ``--framework lightning`` is a PyTorch Lightning ``Trainer.fit()``
(the MLP, strategy ``ddp``; :mod:`failslow.demo.lightning_worker`), S2 by size the same way.
With ``--fault link`` (Megatron, root) every rank runs in its own network namespace and host
(:mod:`failslow.demo.netns`; the launcher's stores are reached over the bridge) and the fault is
the link between ranks 0 and 1 shaped with tc (:class:`ShapedLink`): validation names the link,
the planner buys S3 (greyhound 5.2, Fig. 11) and every rank swaps roles in place.
``--framework fsdp`` runs an FSDP2 HSDP job (2 replicas x 2 shards,
:mod:`failslow.demo.fsdp_worker`); its ``--fault link`` shapes a link inside a shard group
(per-layer traffic), and S3 moves it between replicas. ``--mesh full`` runs it as pure FSDP2
(one shard group over the 4 ranks), where S2 takes the size form.

With ``mitigate=False`` the same job runs without a control plane (the benchmark's baseline).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from failslow import envvars
from failslow.demo import slow_device
from failslow.demo.journal_follow import JournalFollower
from failslow.demo.run_dir import new_run_dir
from failslow.demo.worker_io import launch_env
from failslow.errors import FailslowError
from failslow.faults import DutyCycleThrottle
from failslow.node.fork_server import ForkServer, available
from failslow.node.launcher import preloads

JOBS = {
    "deepspeed": ("failslow.demo.ds_worker", "DeepSpeed ZeRO-1"),
    "megatron": ("failslow.demo.megatron_worker", "Megatron-core GPT, PP2 x DP2"),
    "accelerate": ("failslow.demo.accelerate_worker", "Accelerate FSDP2 (accelerate launch)"),
    "fsdp": ("failslow.demo.fsdp_worker", "FSDP2 HSDP, 2 replicas x 2 shards"),
    "transformers": ("failslow.demo.transformers_worker", "Hugging Face Trainer, GPT-2 (DDP)"),
    "lightning": ("failslow.demo.lightning_worker", "PyTorch Lightning Trainer, MLP (DDP)"),
}
"""Framework -> (the rank's module, the job's name in the live view and the summary)."""


def job_name(framework: str, *, zero: int | None = None, mesh: str | None = None) -> str:
    """The job's name in the live view, the summary and the benchmarks' tables: its
    framework's (:data:`JOBS`), with the ZeRO stage or mesh the options chose."""
    if framework == "deepspeed" and zero is not None:
        return f"DeepSpeed ZeRO-{zero}"
    if framework == "fsdp" and mesh == "full":
        return "FSDP2 full shard (one group over every rank)"
    if framework == "transformers" and zero is not None:
        return f"Hugging Face Trainer, GPT-2 (DeepSpeed ZeRO-{zero})"
    return JOBS[framework][1]


LAUNCHED = ("accelerate", "transformers")
"""Frameworks whose ranks ``accelerate launch`` starts (one process; ranks write their PIDs)."""
PRELOADS = {
    "deepspeed": ("deepspeed",), "megatron": ("megatron.core",), "fsdp": (),
    "lightning": ("lightning.pytorch",),
}  # fmt: skip
"""What the fork server of a job the demo starts itself imports, beside torch (as
``failslow run --preload``): its ranks are forked from it, the imports paid once."""


@dataclass
class MitigationDemoOptions:
    framework: str = "deepspeed"
    """``deepspeed`` (:mod:`failslow.demo.ds_worker`), ``megatron``
    (:mod:`failslow.demo.megatron_worker`: GPT, TP1 x PP2 x DP2, micro-batch size 8) or
    ``accelerate`` (:mod:`failslow.demo.accelerate_worker`: the DeepSpeed demo's MLP as FSDP2
    under ``accelerate launch``)."""
    world_size: int = 4
    steps: int = 260
    fault: str = "compute"
    """``compute``: ``slow_rank`` is SIGSTOP/SIGCONT-cycled from outside (S2 mitigates it);
    ``link`` (Megatron, root): every rank in its own network namespace and host, and the link
    between ranks 0 and 1 - stage 0 of two replicas, their gradient all-reduce - shaped to
    ``link_rate`` (S3 swaps roles so that link carries no DP traffic); ``device``:
    ``slow_rank``'s device computes ``device_factor`` times slower while its host and its part
    in the collectives run at full speed (:mod:`failslow.demo.slow_device`: a throttled GPU,
    where S2's size form can take effect in full)."""
    device_factor: float = 4.0
    """``fault="device"``: how many times slower the slow rank's compute runs."""
    device_factor_then: tuple[int, float] | None = None
    """``fault="device"``: ``(step, factor)`` - from that step on the device runs ``factor``
    times slower instead (a fault that grows or fades while a plan is in effect;
    ``benchmarks/plan_watch.py``)."""
    link_rate: str | None = None
    """Default: Megatron 25mbit; FSDP 200mbit (its shard groups move every layer's shards per
    micro-batch, so a slower link makes a step take seconds)."""
    slow_rank: int = 2
    slow_start: int = 60
    slow_end: int | None = 180
    stopped_fraction: float = 0.75
    throttle_period_s: float = 0.02
    """SIGSTOP/SIGCONT period: short, so the slow rank's collectives wait at most a few ms for
    it (a slower processor, not an absent one: a GPU whose kernels run slower still moves its
    NCCL traffic)."""
    micro_batch_size: int | None = None
    """Samples per micro-batch (default: DeepSpeed 128, Megatron 8 sequences of 64 tokens,
    Lightning 256: its step has a fixed part of ~0.09 s on 2 shared cores - four batches' loop
    overhead and broadcast, the all-reduce, the optimizer - which a throttled rank runs 4x
    slower whatever its share; at 128 that part is half a healthy step and S2 removed 39-54% of
    the slowdown, at 256 64-70%; benchmarks/README.md)."""
    width: int | None = None
    """DeepSpeed: the MLP's width (256); Megatron: the GPT's hidden size (128). Compute per
    micro-batch grows with micro_batch_size, the gradient all-reduce with width^2 (defaults:
    most of a healthy step is compute, as on GPUs)."""
    micro_batches_per_replica: int = 4
    mitigate: bool = True
    inject: bool = True
    """False: no slowdown at all (the reference run for parameter equality)."""
    out_dir: Path | None = None
    live: bool = True
    failslow: dict[str, Any] = field(default_factory=dict)
    """Extra settings for the job's failslow block (and the control plane)."""
    timeout_s: float = 900.0
    loop: str = "user"
    """``user``: the loop DeepSpeed's tutorials teach (forward, backward, step over the
    loader); ``train_batch``: ``engine.train_batch()`` per step."""
    loader: str | None = None
    """Where the ranks read their data: Megatron ``failslow`` (``fs.data_iterator``, the
    default) or ``own`` (the loop's own Megatron-LM iterator, re-cut per plan); Accelerate
    ``prepared`` (the default) or ``failslow`` (``fs.loader``)."""
    mesh: str | None = None
    """The FSDP job's device mesh: ``hsdp`` (2 replicas x N/2 shards, the default) or ``full``
    (one shard group over every rank: pure FSDP2, where S2 takes the size form)."""
    zero: int | None = None
    """The DeepSpeed job: its ZeRO stage (1 or 2, default 1; ZeRO 2 gets S2 by size). The
    Trainer job: run the Trainer's DeepSpeed path at this ZeRO stage (1 or 2), failslow
    enabled by the DeepSpeed config's ``"failslow"`` block and ``FailslowCallback()``;
    default: DDP, ``failslow.transformers.attach``."""
    until_mitigated: int | None = None
    """Robust to a loaded machine (tests, benchmarks): the slowdown lasts at least until this
    many steps after the first plan took effect (``slow_end`` is then the earliest release),
    and the job runs until this many steps after the last revert took effect (``steps`` is
    then the earliest end); ``max_steps`` bounds both."""
    max_steps: int = 1500
    launcher: str = "demo"
    """``demo``: the ranks started by this process (forked from one import, or under ``accelerate
    launch``) and the control plane in it; ``failslow-run``: the job started as users start it,
    ``failslow run --controller N -- torchrun --standalone --nproc-per-node N -m <worker>``, the
    controller and mitigator in that launcher, followed through its journal
    (:mod:`failslow.demo.journal_follow`); with ``mitigate=False`` plain ``torchrun``."""

    def validate(self) -> None:
        if self.framework not in JOBS:
            raise FailslowError(
                f"demo: --framework must be one of {sorted(JOBS)}, got {self.framework!r}"
            )
        megatron, fsdp = self.framework == "megatron", self.framework == "fsdp"
        trainer = self.framework == "transformers"
        if self.micro_batch_size is None:  # Lightning: see MitigationDemoOptions
            lightning = self.framework == "lightning"
            self.micro_batch_size = (
                8 if megatron or trainer else 64 if fsdp else 256 if lightning else 128
            )
        if self.width is None:
            self.width = 128 if megatron or fsdp or trainer else 256
        if self.link_rate is None:
            self.link_rate = "200mbit" if fsdp else "25mbit"
        if (megatron or fsdp) and self.world_size % 2:
            raise FailslowError(
                f"demo: the {self.framework} job has 2 pipeline stages / replicas; --world-size "
                f"must be even, got {self.world_size}"
            )
        if self.fault not in ("compute", "link", "device"):
            raise FailslowError(
                f"demo: --fault must be compute, device or link, got {self.fault!r}"
            )
        if self.fault == "device" and not self.device_factor >= 1.0:
            raise FailslowError(f"demo: --device-factor must be >= 1, got {self.device_factor}")
        if self.device_factor_then is not None:
            step, factor = self.device_factor_then
            if self.fault != "device" or not factor >= 1.0 or step <= self.slow_start:
                raise FailslowError(
                    "demo: a device factor that changes needs --fault device, a factor >= 1 and "
                    f"a step after the slow start ({self.slow_start}); got {step}:{factor}"
                )
        if self.fault == "link" and not (megatron or fsdp):
            raise FailslowError(
                "demo: --fault link needs --framework megatron or fsdp (the topology swap, S3, "
                "is theirs)"
            )
        if self.mesh is not None and (not fsdp or self.mesh not in ("hsdp", "full")):
            raise FailslowError(
                f"demo: --mesh {self.mesh}: the FSDP job (--framework fsdp) runs on an hsdp or a "
                "full mesh"
            )
        if self.mesh == "full" and self.fault == "link":
            raise FailslowError(
                "demo: --fault link needs the hsdp mesh (the topology swap, S3, moves a link "
                "between replicas; a full mesh has one group over every rank)"
            )
        if self.fault == "link" and hasattr(os, "geteuid") and os.geteuid() != 0:
            raise FailslowError(
                f"demo: --fault link shapes a link between network namespaces, which needs "
                f"root (euid is {os.geteuid()})"
            )
        if self.zero is not None and (
            self.framework not in ("deepspeed", "transformers") or self.zero not in (1, 2)
        ):
            raise FailslowError(
                f"demo: --zero {self.zero}: the DeepSpeed job and the Trainer job (--framework "
                "deepspeed or transformers) run DeepSpeed's ZeRO stage 1 or 2"
            )
        if self.loop not in ("user", "train_batch"):
            raise FailslowError(f"demo: --loop must be user or train_batch, got {self.loop!r}")
        loaders = {"megatron": ("failslow", "own"), "accelerate": ("prepared", "failslow")}
        if self.loader is not None and self.loader not in loaders.get(self.framework, ()):
            raise FailslowError(
                f"demo: --loader {self.loader} is not one of --framework {self.framework}'s: "
                f"{list(loaders.get(self.framework, ())) or 'none'}"
            )
        if self.launcher not in ("demo", "failslow-run"):
            raise FailslowError(
                f"demo: --launcher must be demo or failslow-run, got {self.launcher!r}"
            )
        if self.launcher == "failslow-run" and self.fault == "link":
            raise FailslowError(
                "demo: --fault link starts every rank in a network namespace of its own: "
                "--launcher demo only"
            )
        if self.world_size < 2 or not 0 <= self.slow_rank < self.world_size:
            raise FailslowError(
                f"demo: need --world-size >= 2 and 0 <= --slow-rank < world size, got "
                f"{self.world_size} and {self.slow_rank}"
            )
        end = self.slow_end if self.slow_end is not None else self.steps
        if not 0 < self.slow_start < end <= self.steps:
            raise FailslowError(
                f"demo: need 0 < --slow-start < --slow-end <= --iterations, got "
                f"{self.slow_start}, {self.slow_end}, {self.steps}"
            )


DEMO_SETTINGS: dict[str, Any] = {
    # CPU ranks share 2 cores: GEMMs take turns, in fp32 (bf16 matmuls on a CPU without bf16
    # units take seconds and scatter with the load), and healthy ranks scatter up to ~1.5x, so
    # a rank is slow at > 2x its peers; small link tests; plans decided within ~1 s
    "detection": {"threshold": 2.0, "cooldown_s": 20.0},
    "validation": {
        "gemm_serial": True,
        "gemm_dtypes": ["float32"],
        "link_mb": 2,
        "recheck_every_s": 20.0,
        "pause_timeout_s": 20.0,
    },
    "planner": {"strategies": ["S2"], "horizon_s": 1.0},
}
LINK_SETTINGS: dict[str, Any] = {"planner": {"strategies": ["S3"], "pause_s": 2.0}}
"""On top of DEMO_SETTINGS for ``--fault link``: a congested link is S3's case (S2 moves
compute, greyhound 5.2); the swap's pause as measured for this job (0.3-0.6 s,
``benchmarks/topology_swap_*.py``) with margin, where the planner's default is a GPU job's."""
SHAPED_LINK = (0, 1)
"""Ranks whose link ``--fault link`` shapes (both directions)."""


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


@dataclass
class Run:
    """What the live view and the summary read."""

    options: MitigationDemoOptions
    step: int = -1
    step_times: dict[int, float] = field(default_factory=dict)
    injected: tuple[int | None, int | None] = (None, None)
    throttle: dict[str, Any] | None = None
    """The compute fault as its helper did it: how it was scheduled, the fraction of the time
    the rank was stopped and the longest it ran between two stops (None: no compute fault)."""
    fault_changed: tuple[int, float] | None = None
    """The step the device fault's factor changed at, and the new factor."""
    controller_state: str = "-"
    actions: list[dict[str, Any]] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    diagnoses: list[str] = field(default_factory=list)


def run_mitigation_demo(opts: MitigationDemoOptions) -> dict[str, Any]:
    """Run the job; returns the summary (also written to ``summary.json`` in the run dir)."""
    opts.validate()
    with contextlib.ExitStack() as stack:
        net = None
        if opts.fault == "link":
            from failslow.demo.netns import NetnsUnavailable, netns_network

            try:
                net = stack.enter_context(netns_network(opts.world_size))
                net.attach_host()
            except NetnsUnavailable as exc:
                raise FailslowError(f"demo: --fault link: {exc}") from None
        return _run(opts, net)


def _run(opts: MitigationDemoOptions, net: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from failslow.config import load_config
    from failslow.core.control.journal import JOURNAL
    from failslow.demo.mitigation_report import live_view, summarize
    from failslow.node.control import JobControl, host_store

    out = new_run_dir(opts.out_dir, opts.framework)
    base = _merge(DEMO_SETTINGS, LINK_SETTINGS) if net is not None else DEMO_SETTINGS
    settings = _merge(base, opts.failslow)
    config = load_config(settings, source="demo settings", environ={})
    shm = Path("/dev/shm")
    ring_dir = Path(tempfile.mkdtemp(prefix="failslow-ds-", dir=shm if shm.is_dir() else None))
    rendezvous = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    control = host_store()
    plane: Any = None
    if opts.mitigate and opts.launcher == "failslow-run":
        plane = JournalFollower(ring_dir / "diagnoses" / JOURNAL)  # the launcher's journal
    elif opts.mitigate:
        plane = JobControl(
            control, config, world_size=opts.world_size, ring_dir=ring_dir, log_dir=out
        )
    procs, server = _spawn(opts, settings, ring_dir, out, int(rendezvous.port), control.url, net)
    run = Run(opts)
    fault: Any = None
    started = time.monotonic()
    try:
        if isinstance(plane, JobControl):
            plane.start()
        with live_view(run, enabled=opts.live) as refresh:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    raise FailslowError(f"demo: rank(s) {failed} failed; see {out}/{_logs(opts)}")
                if time.monotonic() - started > opts.timeout_s:
                    raise FailslowError(f"demo: not done after {opts.timeout_s:.0f} s; see {out}")
                _observe(run, out, plane)
                if opts.inject and fault is None and run.step >= opts.slow_start:
                    if net is not None:
                        fault = ShapedLink(net, SHAPED_LINK, opts.link_rate)
                    elif opts.fault == "device":
                        fault = SlowedDevice(out / DEVICE_SWITCH, opts.slow_rank,
                                             opts.device_factor)  # fmt: skip
                    else:
                        fault = DutyCycleThrottle(
                            _rank_pid(opts, procs, out), opts.stopped_fraction,
                            opts.throttle_period_s,
                        )  # fmt: skip
                    fault.start()
                    run.injected = (run.step, None)
                then = opts.device_factor_then
                if (
                    isinstance(fault, SlowedDevice) and fault.active and then is not None
                    and run.step >= then[0] and run.fault_changed is None
                ):  # fmt: skip
                    fault.factor = then[1]
                    fault.start()  # the rank switches at its next step boundary
                    run.fault_changed = (run.step, then[1])
                if fault is not None and fault.active and _release_due(run):
                    fault.stop()
                    run.injected = (run.injected[0], run.step)
                if opts.until_mitigated is not None and _end_due(run, fault):
                    (out / "stop").touch()  # every rank ends at one step (ds_worker)
                refresh()
                time.sleep(0.2)
            _observe(run, out, plane)
            refresh()
    finally:
        if fault is not None:
            fault.stop()
            if isinstance(fault, DutyCycleThrottle):
                run.throttle = {
                    "scheduling": fault.scheduling,
                    "stopped": fault.achieved,
                    "longest_run_s": fault.longest_run_s,
                }
        if isinstance(plane, JobControl):
            plane.stop()
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if server is not None:
            server.close()
        control.close()
        del rendezvous
        if (ring_dir / "diagnoses").is_dir():  # failslow run's journal and diagnoses
            shutil.copytree(ring_dir / "diagnoses", out, dirs_exist_ok=True)
        shutil.rmtree(ring_dir, ignore_errors=True)
    if any(p.returncode != 0 for p in procs):
        raise FailslowError(f"demo: a rank failed; see {out}/{_logs(opts)}")
    return summarize(run, out)


def _logs(opts: MitigationDemoOptions) -> str:
    launched = opts.framework in LAUNCHED or opts.launcher == "failslow-run"
    return "launch.log" if launched else "rank-<r>.log"


def _rank_pid(opts: MitigationDemoOptions, procs: list[Any], out: Path) -> int:
    """The slow rank's PID: its process, or under a launcher the PID it wrote."""
    if opts.framework not in LAUNCHED and opts.launcher == "demo":
        return int(procs[opts.slow_rank].pid)
    return int((out / f"pid-rank{opts.slow_rank}").read_text())


DEVICE_SWITCH = "slow-device.json"
"""``--fault device``: the switch file in the run directory (:func:`slow_device.switch`)."""


class SlowedDevice:
    """The ``device`` fault from the launcher's side: ``rank``'s device ``factor`` times slower
    while active (the rank switches at its next step boundary); the same start/stop/active as
    the compute throttle."""

    def __init__(self, path: Path, rank: int, factor: float) -> None:
        self.path, self.rank, self.factor = path, rank, factor
        self.active = False

    def start(self) -> None:
        slow_device.switch(self.path, self.rank, self.factor)
        self.active = True

    def stop(self) -> None:
        slow_device.switch(self.path, None)
        self.active = False


class ShapedLink:
    """The ``link`` fault: ``ranks``' link shaped to ``rate`` both ways (tc htb, in their
    namespaces) while active; the same start/stop/active as the compute throttle."""

    def __init__(self, net: Any, ranks: tuple[int, int], rate: str) -> None:
        self.net, self.ranks, self.rate = net, ranks, rate
        self.active = False

    def start(self) -> None:
        a, b = self.ranks
        self.net.shape(a, b, rate=self.rate)
        self.net.shape(b, a, rate=self.rate)
        self.active = True

    def stop(self) -> None:
        if self.active:
            for rank in self.ranks:
                self.net.unshape(rank)
            self.active = False


def _applied(run: Run, action: str) -> list[int]:
    return [a["apply_step"] for a in run.actions if a["action"] == action and a["apply_step"]]


def _release_due(run: Run) -> bool:
    """End the slowdown: at ``slow_end``; with ``until_mitigated``, not before the first plan
    has been in effect that many steps, nor while the even split is back for any reason but
    the closed loop's "did not pay" - the controller must find the slowdown again and plan
    anew first (at the latest at ``max_steps / 2``). Seen under a 1-core CPU hog: a
    re-validation found the throttled rank healthy (its short GEMM fit in its running quarter)
    and reverted "relieved" one step before the release, and the run ended with that revert as
    its walk back."""
    opts = run.options
    if opts.slow_end is None or run.step < opts.slow_end:
        return False
    if opts.until_mitigated is None or run.step >= opts.max_steps // 2:
        return True
    applied = _applied(run, "apply")
    if not applied or run.step < applied[0] + opts.until_mitigated:
        return False
    splits = _splits(run)
    if not splits:
        return False
    last = splits[-1]
    return last["action"] in ("apply", "replan") or str(last.get("reason") or "").startswith(
        "did not pay"
    )


def _end_due(run: Run, fault: Any) -> bool:
    """With ``until_mitigated``: end the job once the slowdown is over and the even split has
    been back that many steps after it - the last revert, after the release or (a plan that did
    not pay) before it - (or without mitigation: ``steps``), at most ``max_steps``.
    A topology swap is kept after the fault (greyhound 5.2): the link run ends that many steps
    after the release."""
    opts = run.options
    if run.step >= opts.max_steps - 5:
        return True
    if run.step < opts.steps or (fault is not None and fault.active):
        return False
    if not opts.mitigate or not opts.inject:
        return True
    released = run.injected[1]
    if opts.fault == "link":
        return released is not None and run.step >= released + opts.until_mitigated
    if released is None:
        return False
    splits = _splits(run)
    if not splits or splits[-1]["action"] in ("apply", "replan"):
        return False  # a split in effect (or none bought yet): its walk back is awaited
    # the even split again: reverted after the release (the walk back), or before it when the
    # closed loop measured the plan short of its promise (a loaded machine) - either way the
    # job ends that many steps after both the release and the revert
    return run.step >= max(released, splits[-1]["apply_step"]) + opts.until_mitigated


def _splits(run: Run) -> list[dict[str, Any]]:
    """The committed actions that changed the split, by the step they took effect."""
    return sorted(
        (a for a in run.actions
         if a["committed"] and a["apply_step"]
         and a["action"] in ("apply", "replan", "revert", "rollback")),
        key=lambda a: a["apply_step"],
    )  # fmt: skip


def _spawn(
    opts: MitigationDemoOptions,
    settings: dict[str, Any],
    ring_dir: Path,
    out: Path,
    port: int,
    store_url: str,
    net: Any = None,
) -> tuple[list[Any], ForkServer | None]:
    """The job's ranks: under ``accelerate launch``; in network namespaces (the link fault);
    else forked from a fork server that imported the framework once (Linux), as ``failslow run
    --nproc-per-node`` starts ranks - the same processes, environment and output, the imports
    paid once instead of once per rank."""
    if opts.launcher == "failslow-run":
        return [_failslow_run(opts, settings, ring_dir, out)], None
    if opts.framework in LAUNCHED:
        return [_accelerate_launch(opts, settings, ring_dir, out, store_url)], None
    procs: list[Any] = []
    if net is not None:  # the ranks reach this process's stores over the bridge
        store_url = store_url.replace("127.0.0.1", net.host_address)

    def rank_env(rank: int) -> dict[str, str]:
        return _job_env(
            opts, settings, ring_dir, out, store_url,
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(opts.world_size),
            FAILSLOW_DEMO_STORE_PORT=str(port), FAILSLOW_DEMO_LOOP=opts.loop,
        )  # fmt: skip

    if net is None and available():
        server = ForkServer(
            sys.executable, _job_env(opts, settings, ring_dir, out, store_url),
            preloads(PRELOADS[opts.framework]), log=out / "fork-server.log",
        )  # fmt: skip
        try:
            for rank in range(opts.world_size):
                argv = ["-m", JOBS[opts.framework][0]]
                procs.append(server.start(rank_env(rank), argv, log=out / f"rank-{rank}.log"))
        except BaseException:
            for p in procs:
                p.kill()
            server.close()
            raise
        return procs, server
    for rank in range(opts.world_size):
        env = rank_env(rank)
        argv = [sys.executable, "-m", JOBS[opts.framework][0]]
        if net is not None:  # its own namespace (gloo on its veth) and its own host
            env.update(
                GLOO_SOCKET_IFNAME=net.ranks[rank].veth,
                FAILSLOW_DEMO_STORE_HOST=net.host_address,
            )
            env[envvars.HOST] = f"host{rank}"
            argv = net.exec_argv(rank, argv)
        with open(out / f"rank-{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs, None


def _job_env(
    opts: MitigationDemoOptions,
    settings: dict[str, Any],
    ring_dir: Path,
    out: Path,
    store_url: str,
    **extra: str,
) -> dict[str, str]:
    """The environment every demo rank gets (:func:`~failslow.demo.worker_io.launch_env`): the
    job's shape, its failslow settings, the rings, the control store (with mitigation) and the
    stop file (``until_mitigated``), plus ``extra``."""
    env = launch_env(
        out,
        opts.steps if opts.until_mitigated is None else opts.max_steps,
        FAILSLOW_DEMO_MICRO_BATCHES=str(opts.micro_batches_per_replica),
        FAILSLOW_DEMO_MICRO_BATCH_SIZE=str(opts.micro_batch_size),
        FAILSLOW_DEMO_WIDTH=str(opts.width),
        FAILSLOW_DEMO_CONFIG=json.dumps(settings),
        FAILSLOW_RING_DIR=str(ring_dir),
        **extra,
    )
    if opts.loader is not None:
        env["FAILSLOW_DEMO_LOADER"] = opts.loader
    if opts.zero is not None:
        env["FAILSLOW_DEMO_ZERO"] = str(opts.zero)
    if opts.mesh is not None:
        env["FAILSLOW_DEMO_MESH"] = opts.mesh
    if opts.mitigate:
        env["FAILSLOW_STORE"] = store_url
    if opts.fault == "device":  # every rank looks at the switch at its step boundaries
        env[slow_device.ENV] = str(out / DEVICE_SWITCH)
        env[envvars.PLUGINS] = slow_device.__name__
    if opts.until_mitigated is not None:
        env["FAILSLOW_DEMO_STOP_FILE"] = str(out / "stop")
    return env


def _accelerate_launch(
    opts: MitigationDemoOptions,
    settings: dict[str, Any],
    ring_dir: Path,
    out: Path,
    store_url: str,
) -> subprocess.Popen[bytes]:
    """``accelerate launch`` of the Accelerate or Trainer job: one process that starts every rank
    (torchrun's c10d rendezvous on a free port), all output in ``launch.log``."""
    env = _job_env(opts, settings, ring_dir, out, store_url)
    argv = [
        sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
        "--multi_gpu", "--num_processes", str(opts.world_size), "--num_machines", "1",
        "--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1", "--main_process_port", "0",
        "-m", JOBS[opts.framework][0],
    ]  # fmt: skip
    with open(out / "launch.log", "wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _failslow_run(
    opts: MitigationDemoOptions, settings: dict[str, Any], ring_dir: Path, out: Path
) -> subprocess.Popen[bytes]:
    """The job as users start it: ``failslow run --controller N -- torchrun --standalone
    --nproc-per-node N -m <worker>`` (the Accelerate and Trainer jobs too: both run under
    torchrun as under ``accelerate launch``); without mitigation the same ``torchrun`` alone (the
    baseline a user compares with). The launcher's controller takes the demo's settings from the
    environment (``FAILSLOW__SECTION__KEY``, what a user would set), the ranks from their
    framework's config as well; its journal and diagnoses go to ``<ring_dir>/diagnoses``. All
    output in ``launch.log``."""
    env = _job_env(opts, settings, ring_dir, out, "")  # the settings as FAILSLOW__ too
    env.pop(envvars.STORE, None)  # failslow run hosts the store and tells the ranks
    job = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(opts.world_size), "-m", JOBS[opts.framework][0],
    ]  # fmt: skip
    argv = [
        sys.executable, "-m", "failslow.cli", "run", "--controller", str(opts.world_size),
        "--ring-dir", str(ring_dir), "--", *job,
    ] if opts.mitigate else job  # fmt: skip
    with open(out / "launch.log", "wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _observe(run: Run, out: Path, plane: Any) -> None:
    """The job's progress (rank 0's progress file) and what the control plane did."""
    try:
        record = json.loads((out / "progress-rank0.json").read_text())
    except (OSError, ValueError):
        record = {}
    for step, seconds in record.get("steps", []):
        run.step_times[int(step)] = float(seconds)
        run.step = max(run.step, int(step) + 1)
    if isinstance(plane, JournalFollower):
        plane.poll()
        run.controller_state, run.diagnoses = plane.state, list(plane.diagnoses)
        run.actions, run.unavailable = [dict(a) for a in plane.actions], dict(plane.unavailable)
    elif plane is not None:
        run.controller_state = plane.controller.state.value
        run.diagnoses = [d.to_json() for d in plane.controller.diagnoses]
        run.actions = [
            {
                "action": a.action,
                "strategy": a.strategy,
                "counts": list(getattr(a.plan, "counts", ())),
                "hosts": list(getattr(a.plan, "hosts", ())),
                "apply_step": a.outcome.apply_step if a.outcome else None,
                "reason": a.reason
                if a.outcome is None or a.outcome.committed
                else a.outcome.reason,
                "committed": bool(a.outcome and a.outcome.committed),
                "effect": a.effect,
                "effect_detail": a.effect_detail,
                "outcome": a.result.to_dict()
                if a.result is not None
                else {"verdict": "not measured", "measured_s": None, "reason": a.unmeasured}
                if a.unmeasured
                else None,
                "drift": a.drift,
            }
            for a in plane.mitigator.actions
        ]
        run.unavailable = dict(plane.mitigator.unavailable)


def step_times_of(out: Path, world_size: int) -> np.ndarray:
    """Per-step wall times of the job (the slowest rank's step ends; rank files at the end: a
    worker under ``failslow run`` names its record after its launch, ``steps-rank<r>-<n>.json``,
    read where it is the rank's only one)."""
    ends = [np.asarray(rank_record(out, rank)["step_end"]) for rank in range(world_size)]
    return np.diff(np.max(np.stack(ends), axis=0))


def rank_record(out: Path, rank: int) -> dict[str, Any]:
    """A rank's record, ``steps-rank<r>.json`` (under ``failslow run`` named after its launch,
    ``steps-rank<r>-<n>.json``: the rank's only one)."""
    path = out / f"steps-rank{rank}.json"
    if not path.exists():
        (path,) = out.glob(f"steps-rank{rank}-*.json")
    record: dict[str, Any] = json.loads(path.read_text())
    return record
