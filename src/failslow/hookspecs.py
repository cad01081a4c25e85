"""Every ``failslow_*`` hook, typed and documented (DESIGN.md, Contracts: Hooks).

The plugin API in pluggy's terms, modelled on pytest's ``hookspec.py``. An adapter (DeepSpeed,
Megatron, FSDP) is a plugin: it implements the *adapter* hooks for the one training job it
wraps and nothing else. Notifiers and third-party strategies are plugins too. Two kinds:

- **decision hooks** (``firstresult=True``): the first plugin that returns a value other than
  ``None`` answers; ``None`` from every plugin means "nobody here can" (the session turns that
  into :class:`failslow.capabilities.Unsupported` for requests that need an answer);
- **observation hooks**: called on every plugin, results ignored, return ``None``.

Mitigations are applied in two phases so that every rank switches at the same step or none does
(greyhound 5: plans take effect at an iteration boundary): ``failslow_prepare_*`` checks a plan
on every rank without changing anything; only when every rank accepted it does each rank call
``failslow_apply_*`` at the agreed step boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from failslow.capabilities import Capabilities
    from failslow.config import FailslowConfig
    from failslow.core.diagnosis.record import Diagnosis
    from failslow.core.planner.plans import MicroBatchPlan, Plan, TopologyPlan
    from failslow.core.topology import Topology

hookspec = pluggy.HookspecMarker("failslow")

# -------------------------------------------------------------------------------------------
# Session lifecycle - called in every rank process, by its session (failslow.runtime.session)
# -------------------------------------------------------------------------------------------


@hookspec
def failslow_session_start(config: FailslowConfig, rank: int, world_size: int) -> None:
    """The rank's failslow session started (capture on, store connected if configured).

    Observation hook: called on every plugin.
    """


@hookspec
def failslow_session_end(rank: int) -> None:
    """The session is closing (the training job ends or detaches failslow).

    Observation hook: called on every plugin.
    """


@hookspec
def failslow_control_start(config: FailslowConfig, world_size: int) -> None:
    """The job's control plane (controller and mitigator) started in this process (``failslow
    run --controller``, ``failslow controller``, the demo's launcher); notifiers open here what
    the controller's notifications go to. Observation hook: called on every plugin.
    """


@hookspec
def failslow_control_end() -> None:
    """The control plane stopped (its threads joined). Observation hook."""


# -------------------------------------------------------------------------------------------
# Adapter: what the job looks like and what it can do - called in every rank process, by its
# session (rank 0 also publishes both to the controller in the job record)
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def failslow_report_topology() -> Topology | None:
    """The job's layout as the framework sees it: TP/DP/PP sizes, every role's coordinates
    and host, micro-batches per global step and micro-batch size.

    Decision hook (``firstresult``): the adapter of the running framework answers.
    """


@hookspec(firstresult=True)
def failslow_capabilities() -> Capabilities | None:
    """Which mitigations this job supports (micro-batch plans, topology plans, snapshots,
    hot update), each unsupported one with the reason a user reads when asking for it.

    Decision hook (``firstresult``).
    """


# -------------------------------------------------------------------------------------------
# Adapter: applying plans (two phases: prepare on every rank, then apply at one step) - called
# in every rank process: prepare from the plan receiver's thread (or ``session.schedule``),
# apply in the training thread at the step boundary (failslow.runtime.plan_application)
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def failslow_prepare_microbatch_plan(plan: MicroBatchPlan, rank: int) -> bool | None:
    """Check that ``plan`` (micro-batches per DP replica) can be applied at a step boundary.

    Must not change training state. Return ``True`` if it can; raise
    :class:`failslow.capabilities.Unsupported` (or any exception, whose message is reported)
    if it cannot. Decision hook (``firstresult``).
    """


@hookspec(firstresult=True)
def failslow_apply_microbatch_plan(plan: MicroBatchPlan, step: int) -> bool | None:
    """Switch to ``plan`` from global step ``step`` on: this rank's replica runs
    ``plan.counts[replica]`` micro-batches per step, on exactly its share of the global batch,
    weighted so the gradient equals the even split's. Called at a step boundary, after every
    rank's ``failslow_prepare_microbatch_plan`` accepted it. Return ``True`` when applied.

    Decision hook (``firstresult``).
    """


@hookspec(firstresult=True)
def failslow_prepare_topology_plan(plan: TopologyPlan, rank: int) -> bool | None:
    """Check that ``plan`` (a new host for every role) can be applied in place.

    Decision hook (``firstresult``); same contract as ``failslow_prepare_microbatch_plan``.
    """


@hookspec(firstresult=True)
def failslow_apply_topology_plan(plan: TopologyPlan, step: int) -> bool | None:
    """Re-create the parallel groups for ``plan`` and move the roles' state, at a step boundary,
    without restarting the process; the trajectory must equal the one without the swap.

    Decision hook (``firstresult``).
    """


@hookspec(firstresult=True)
def failslow_revert_topology_plan(plan: TopologyPlan, step: int) -> bool | None:
    """Go back to the placement and state in effect before ``plan`` at ``step`` (another rank,
    or this one, failed to apply it). Every rank is called, also one that failed halfway or
    before changing anything (it returns ``False``: nothing to undo); ranks that tore their
    groups down rebuild them together, so either all of them do or none.

    Decision hook (``firstresult``).
    """


# -------------------------------------------------------------------------------------------
# Adapter: what the rank ran (the closed loop, DESIGN.md invariant 7) - called in every rank
# process, in the training thread, at the step boundary after a plan's apply step
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def failslow_verify_microbatch_plan(plan: MicroBatchPlan, step: int, forwards: int) -> str | None:
    """Check what this rank ran in ``step``, the first step of ``plan``, against the plan,
    from counters the plan does not set: ``forwards`` (the training forwards the session's step
    profile counted in the step), the micro-batches the share-aware loader handed out for it,
    the gradient weight the framework applied. Return ``""`` when the rank ran its replica's
    count, weight and share, else one line saying what it ran instead (the plan is then
    reported "not in effect" and rolled back). ``None``: no plugin can tell, which counts as
    not in effect. Decision hook (``firstresult``).
    """


@hookspec(firstresult=True)
def failslow_microbatch_unit() -> int | None:
    """The size form of S2 (the loop runs its own micro-batches per step on every replica and a
    plan changes how many samples they hold): the samples in one count unit of a plan. None:
    the count form (a plan moves whole micro-batches). The planner reads it with the step
    profile: in the size form a micro-batch's time is not proportional to its samples (a
    fixed part per micro-batch), which it measures before sizing a plan. Decision hook
    (``firstresult``).
    """


@hookspec(firstresult=True)
def failslow_observed_coord() -> tuple[int, int, int] | None:
    """This process's role as the framework's own state has it now - ``(tp, dp, pp)``
    coordinates read from its process groups or device mesh, not from failslow's bookkeeping
    - to check a topology plan after its apply step. Decision hook (``firstresult``); ``None``:
    no plugin can tell (the plan is then not in effect).
    """


# -------------------------------------------------------------------------------------------
# Adapter: state (in-memory checkpoints) and hot update - called in every rank process, in the
# training thread, by its snapshot service (failslow.runtime.snapshot_service) and session
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def failslow_snapshot_state(step: int) -> dict[str, Any] | None:
    """This rank's full training state at a step boundary (model, optimizer, scheduler, data
    position, RNG), as tensors and plain values, for an in-memory checkpoint (byterobust 4.2).

    Decision hook (``firstresult``).
    """


@hookspec(firstresult=True)
def failslow_restore_state(state: dict[str, Any], step: int) -> bool | None:
    """Load a snapshot taken by ``failslow_snapshot_state``; training resumes at ``step`` with
    bitwise the same state. Decision hook (``firstresult``).
    """


@hookspec(firstresult=True)
def failslow_restore_resharded(
    states: list[dict[str, Any]], step: int, old_rank: int | None
) -> bool | None:
    """Load step ``step`` of a larger old world into this smaller one (odyssey III: the job goes
    on without lost ranks, no standby left). ``states[j]`` is old rank ``j``'s
    ``failslow_snapshot_state``, every old rank's, lost ones included; ``old_rank`` is the one
    this rank's node memory belonged to (its random generators, say). The plugin re-cuts what
    was sharded by the old world (a ZeRO partition), keeps the global batch of the old world
    and a gradient equal to its even split's (odyssey Eq. 12-13: the survivors take the lost
    replicas' micro-batches), or raises a one-line error when it cannot. Decision hook.
    """


@hookspec(firstresult=True)
def failslow_hot_update(code: dict[str, Any], step: int) -> bool | None:
    """This rank is about to stop at step boundary ``step`` for a code or config update
    (byterobust 6.1; ``code`` names the update). Its snapshot of ``step`` is committed; flush
    what must survive outside the training state (loggers, profilers) and return ``True``.
    The node agent restarts the process in place with the update and the session resumes it
    from the snapshot through ``failslow_restore_state``. Decision hook (``firstresult``).
    """


# -------------------------------------------------------------------------------------------
# Decisions third parties may take over - called in the controller's process (the mitigator,
# failslow.core.control.mitigator): ``failslow run --controller`` or ``failslow controller``
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def failslow_choose_plan(diagnosis: Diagnosis, proposed: Plan) -> Plan | None:
    """Replace the planner's proposal (``proposed``, from the ski-rental policy) with another
    plan, for example a site policy that never restarts during business hours. Return ``None``
    to keep the proposal. Decision hook (``firstresult``).
    """


# -------------------------------------------------------------------------------------------
# Notifications - each says which process calls it: the controller's (diagnoses, decisions and
# their dispatch) or every rank's (what the rank did)
# -------------------------------------------------------------------------------------------


@hookspec
def failslow_on_diagnosis(diagnosis: Diagnosis) -> None:
    """A validation round named a slow rank or link. Called in the controller's process.
    Observation hook."""


@hookspec
def failslow_on_plan(plan: Plan, action: str, reason: str) -> None:
    """The planner decided to ``"apply"`` or ``"revert"`` ``plan``; ``reason`` says why
    (ski-rental break-even, relief, ...). Called in the controller's process. Observation
    hook."""


@hookspec
def failslow_on_plan_result(plan: Plan, step: int | None, outcome: str, detail: str) -> None:
    """What became of a dispatched plan; ``outcome`` is one of
    :class:`failslow.core.control.plan_channel.PlanResult`:

    - in the controller's process: ``"committed"`` (every rank accepted; it takes effect at
      ``step``) or ``"aborted"`` (``step`` None; ``detail`` names the rank and the reason; no
      rank changed anything);
    - in every rank's process: ``"applied"`` (this rank switched to it at ``step``), ``"rolled
      back"`` (some rank failed to switch at ``step``; every rank went back; ``detail`` says
      which) or ``"aborted"`` (the channel aborted it before ``step``); after the step, ``"in
      effect"`` or ``"not in effect"`` (``detail``: what the rank ran instead) from what the
      rank checked it ran;
    - in the controller's process, after the apply step: ``"in effect"`` (every rank ran it)
      or ``"not in effect"`` (``detail``: the first rank's reason; the plan is rolled back).

    Observation hook."""


@hookspec
def failslow_stop_check_start(rank: int, incident: dict[str, Any]) -> None:
    """The stop-time checks (byterobust 4.2, "Diagnose") start in this machine's process, before
    its device, link and bitwise-alignment tests (:mod:`failslow.runtime.stop_check`);
    ``incident`` is what stopped training (``step``, ``why``, ...). Called in a process of its
    own on every machine; a plugin may prepare the device here. Observation hook."""


@hookspec
def failslow_on_step(step: int, step_time_s: float) -> None:
    """A training step ended on this rank after ``step_time_s`` seconds. Called in every rank
    process, in the training thread, once per step, so implementations must be cheap.
    Observation hook."""
