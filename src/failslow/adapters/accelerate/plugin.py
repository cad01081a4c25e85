"""Hugging Face Accelerate as a failslow plugin: its own ``accumulate`` loop under plans (S2).

What Accelerate prepared is a DDP model or an FSDP2 module (``fsdp_version: 2``), so the
plugin is the FSDP/DDP adapter (:class:`~failslow.adapters.fsdp.plugin.FSDPAdapter`: topology,
capabilities, local-shard snapshots) driven by Accelerate's own loop instead of ``train_step``::

    for x, y in loader:                      # fs.loader(dataset): this rank's share
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Accelerate decides per micro-batch, in ``Accelerator._do_sync`` (called on entering
``accumulate``), whether this micro-batch synchronises gradients: ``step % G == 0`` or the end of
the dataloader. The plugin puts its own decision there (an instance attribute shadowing the
method): the step boundary passes before a step's first micro-batch (plans apply), and the
micro-batch syncs exactly when it is this replica's last under the plan in effect. Everything
else follows from Accelerate's ``sync_gradients``: ``accumulate`` enters ``no_sync`` (DDP) or
``set_requires_gradient_sync(False)`` (FSDP2) before the others, and the prepared optimizer and
scheduler step only after the last. ``gradient_accumulation_steps`` stays the even split's
``G = M / D``, so ``accelerator.backward`` keeps dividing every micro-loss by ``G``: a replica
that runs ``m_r`` of them contributes ``m_r / G`` times its mean, the kit's weight
``w_r = m_r * D / M`` (no rescaling per plan). Pure FSDP (a 1-D mesh) all-gathers every
layer in every micro-batch, so every replica runs the ``G`` micro-batches and a plan sizes them
(the size form, issue 46): the re-cut loader hands replica ``r`` its ``counts[r] * B`` samples
of the step in ``G`` micro-batches and ``accelerator.backward`` multiplies each micro-loss by
its samples over ``B``; ``unshard_once`` (the FSDP adapter's reshard schedule, set in the same
place) gives it the count form instead.

A loop that sets ``sync_gradients`` itself (the Hugging Face Trainer accumulates its own
micro-batches and calls ``gradient_state._set_sync_gradients`` for each) never enters
``_do_sync``: from its first such call micro-batch plans are refused with that reason, said
once, and the job record is published again so the controller names it (issue 45).

A loop without ``accumulate`` (one micro-batch per step) passes the step boundary from a forward
pre-hook.

**The data.** The loop's own loader - the first DataLoader ``accelerator.prepare`` returned, the
training loader in Accelerate's examples (``model, optimizer, train_dataloader,
eval_dataloader = accelerator.prepare(...)``) - is re-cut per plan when the session starts
(:mod:`.prepared`, the count form; pure FSDP's by size): its ``BatchSamplerShard`` keeps its
sampler, order and batches, and under a plan replica ``r`` is handed ``counts[r]`` of each
step's micro-batches (the even split's, moved whole), so ``accumulate`` runs them and the
last one syncs. Loaders
prepared later (an evaluation loader) are not touched. Where the loader cannot be re-cut (an
iterable dataset, ``split_batches``, a replica sharded over several processes), plans are
refused with that reason; :meth:`AccelerateAdapter.loader` builds a share-aware loader instead
(prepared for this process alone, its sampler registering every plan before reading the plan's
step). At the end of the loader a step that it did not fill syncs on its last micro-batch, as
Accelerate's own ``_do_sync`` does (``end_of_dataloader``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from failslow import hookimpl
from failslow.adapters.accelerate.prepared import recut
from failslow.adapters.common.loop import LoopOwner, is_training_forward
from failslow.adapters.common.state import counters, restore_counters
from failslow.adapters.fsdp.plugin import FSDPAdapter
from failslow.capabilities import Capabilities
from failslow.errors import ConfigError

log = logging.getLogger(__name__)

NO_REBUILD = (
    "Accelerate keeps the prepared model, optimizer and device mesh in its own process-wide "
    "state, which a swap cannot rebuild in place"
)


def prepared(accelerator: Any, model: Any = None) -> tuple[Any, Any, Any]:
    """The model as ``accelerator.prepare`` returned it (``model``, else the one Accelerate
    keeps - FSDP2 keeps the wrapped module, DDP only the unwrapped one), the inner optimizer
    and the inner scheduler."""
    if len(accelerator._models) != 1 or len(accelerator._optimizers) != 1:
        raise ConfigError(
            "failslow.accelerate: expected one model and one optimizer passed to "
            f"accelerator.prepare, got {len(accelerator._models)} and "
            f"{len(accelerator._optimizers)}"
        )
    scheduler = accelerator._schedulers[0].scheduler if accelerator._schedulers else None
    return model or accelerator._models[0], accelerator._optimizers[0].optimizer, scheduler


def mesh_of(model: Any) -> Any:
    """The DeviceMesh of an FSDP2 module (its first DTensor parameter's), else None."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


class AccelerateAdapter(FSDPAdapter):
    """The FSDP/DDP adapter driven by one :class:`accelerate.Accelerator`'s loop."""

    _recut: Any = None
    """The loop's own prepared loader's :class:`~failslow.adapters.common.recut.RecutSampler`
    (once :meth:`recut_prepared` wrapped it)."""
    _sync: LoopOwner | None = None
    """The training loop's own calls of ``gradient_state._set_sync_gradients`` (once
    :meth:`follow_loop` ran)."""

    def __init__(
        self,
        accelerator: Any,
        *,
        model: Any = None,
        micro_batch_size: int | None = None,
        unshard_once: bool = False,
        model_factory: Callable[..., Any] | None = None,
        accumulation_steps: int | None = None,
    ) -> None:
        model, optimizer, scheduler = prepared(accelerator, model)
        if accumulation_steps is None:  # a loop that accumulates with accelerator.accumulate
            accumulation_steps = int(accelerator.gradient_accumulation_steps)
        if micro_batch_size is None:
            loaders = accelerator._dataloaders
            size = getattr(loaders[0], "batch_size", None) if loaders else None
            micro_batch_size = int(size) if size else 1
        self.accelerator = accelerator
        super().__init__(
            model,
            optimizer,
            mesh=mesh_of(model),
            scheduler=scheduler,
            model_factory=model_factory,
            accumulation_steps=accumulation_steps,
            micro_batch_size=micro_batch_size,
            unshard_once=unshard_once,
            framework="Accelerate",
        )
        self.split.micro_loss_scale = lambda: 1.0 / int(accelerator.gradient_accumulation_steps)
        if self.split.by_size is not None:  # pure FSDP2: every replica runs G, sized
            self._weigh_by_samples()
        self._done = 0
        """Micro-batches of the current step already entered (``accumulate``)."""
        self._hook: Any = None

    def _weigh_by_samples(self) -> None:
        """The size form: ``accelerator.backward`` multiplies the micro-loss of the
        micro-batch in progress by its samples over ``B`` (on top of Accelerate's ``1 / G``;
        nothing under the even split), and notes the weight for the plan's check."""
        accelerator = self.accelerator
        unscaled = accelerator.backward

        def backward(loss: Any, **kwargs: Any) -> Any:
            share = self.split.sample_share(max(self._micro - 1, 0))
            self.split.note_weight(self.iteration, share * self.split.micro_loss_scale())
            return unscaled(loss * share if share != 1.0 else loss, **kwargs)

        accelerator.backward = backward

    def follow_loop(self) -> None:
        """Take over Accelerate's sync decision and see every training forward."""
        self.accelerator._do_sync = self._do_sync
        self._hook = self.model.register_forward_pre_hook(self._before_forward)
        self._sync = LoopOwner(
            self.accelerator.gradient_state, "_set_sync_gradients",
            what="Accelerate's sync_gradients", session=self.session,
            who="the Hugging Face Trainer accumulates its own micro-batches and decides each "
            "one's sync, without accelerator.accumulate",
        )  # fmt: skip
        self.recut_prepared()

    def recut_prepared(self) -> None:
        """Re-cut the loop's own training loader (the first one ``accelerator.prepare``
        returned) per plan, in the count form; where it cannot be, refusals name the reason. A
        rank resumed from a snapshot walks it over the steps already trained first, so it
        reads on where the run stopped (:mod:`failslow.adapters.common.recut`)."""
        loaders = self.accelerator._dataloaders
        if not loaders:
            return
        whose = "the first DataLoader accelerator.prepare returned (the training loader)"
        by_count = self.split.by_size is None
        # a rank resumed from a snapshot (a restart, a hot update) built the loader afresh
        skip = self.iteration if self.session.resumed_step is not None else 0
        why = recut(
            self.split, loaders[0], whose, start_step=self.iteration, by_count=by_count,
            skip_steps=skip,
        )  # fmt: skip
        if why:
            self.split.loader_hint = f"{why}; build the training loader with fs.loader(dataset)"
            if skip:  # said, not hidden: this restart does not train what the job would have
                log.warning(
                    "failslow: rank %d resumed at step %d, but %s cannot be re-cut (%s): it "
                    "starts again at its first batch, so the job trains other samples than "
                    "without the restart; build the training loader with fs.loader(dataset)",
                    self.rank, skip, whose, why,
                )  # fmt: skip
        else:
            self._recut = self.split.samplers[-1]

    @hookimpl
    def failslow_capabilities(self) -> Capabilities:
        caps = super().failslow_capabilities()
        if self._sync is not None and self._sync.reason and caps.microbatch_plans == "":
            caps = replace(caps, microbatch_plans=self._sync.reason)
        return caps

    def _swap_reason(self) -> str:
        return NO_REBUILD if self.flavor == "hsdp" else super()._swap_reason()

    def _do_sync(self) -> None:
        """Entering ``accumulate``: is this micro-batch this replica's last of the step?"""
        if self._done == 0:
            self.begin_step()  # plans due now change the count before it is read
        self._done += 1
        state = self.accelerator.gradient_state
        last = self._done >= self._micro_batches() or bool(
            state.sync_with_dataloader and state.end_of_dataloader
        )  # a step the loader did not fill ends with it, as Accelerate's own _do_sync has it
        self.accelerator.step = 0 if last else self._done
        set_sync = self._sync.original if self._sync is not None else None
        (set_sync or self.accelerator.gradient_state._set_sync_gradients)(last)
        self.set_boundary(last)
        if last:
            self._done = 0

    def _micro_batches(self) -> int:
        """This replica's micro-batches in the current step: what the re-cut loader handed out
        for it (the epoch's last step, which the loader's sampler did not fill, runs what it
        has on every replica whatever the plan), else the plan's count."""
        handed = self._recut.handed_out(self.iteration) if self._recut is not None else None
        return handed or self.split.count

    def _before_forward(self, module: Any, args: Any) -> None:
        if is_training_forward(module):
            self.begin_step()

    # ---- hooks beyond the FSDP adapter's -------------------------------------------------------
    @hookimpl
    def failslow_snapshot_state(self, step: int) -> dict[str, Any]:
        state = super().failslow_snapshot_state(step)
        state["accelerate"] = counters(self.accelerator, ("step",))
        return state

    @hookimpl
    def failslow_restore_state(self, state: dict[str, Any], step: int) -> bool:
        super().failslow_restore_state(state, step)
        restore_counters(self.accelerator, state["accelerate"])
        self._done = 0
        return True

    # ---- data --------------------------------------------------------------------------------
    def loader(self, dataset: Any, **kwargs: Any) -> Any:
        """The FSDP adapter's share-aware loader, prepared by Accelerate for this process alone
        (device placement and its end-of-data tracking; no second sharding)."""
        from accelerate.data_loader import prepare_data_loader

        loader = super().loader(dataset, **kwargs)
        shard = prepare_data_loader(
            loader,
            self.accelerator.device,
            num_processes=1,
            process_index=0,
            put_on_device=True,
        )
        shard._is_accelerate_prepared = True  # accelerator.prepare(shard) keeps it as it is
        return shard

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.accelerator.__dict__.pop("_do_sync", None)
        if self._sync is not None:
            self._sync.restore()
            self._sync = None
        super().close()
