"""Built-in notifier: Weights & Biases (``observe.wandb_project``, ``observe.wandb_mode``).

Rank 0 logs ``failslow/step_time_s`` into the W&B run the training script already has
(``wandb.run``, with ``commit=False`` so the user's own step counter is untouched) or, if it has
none, into a run of its own in ``wandb_project``; the control plane logs diagnoses (slowdowns as
metrics, the record as a summary string) and plans into a run of its own (job type
``failslow-controller``). Needs the ``wandb`` package; without it, or if W&B fails, one warning
and the notifier is off (:mod:`failslow.builtin.notifier`) - training goes on.
"""

from __future__ import annotations

from typing import Any

from failslow.builtin.notifier import Notifier


class WandbNotifier(Notifier):
    name = "W&B"

    def enabled(self, observe: Any) -> bool:
        return bool(observe.wandb_project) and observe.wandb_mode != "disabled"

    def _open(self, observe: Any, role: str) -> Any:
        import wandb

        self.owned = not (role == "rank0" and wandb.run is not None)
        if not self.owned:
            return wandb.run
        return wandb.init(
            project=observe.wandb_project,
            mode=observe.wandb_mode,
            job_type=f"failslow-{role}",
            name=f"failslow-{role}",
        )

    def _scalars(self, values: dict[str, float], step: int | None) -> None:
        if self.owned:
            self.sink.log(values, step=step)
        else:
            self.sink.log(values, commit=False)

    def _text(self, tag: str, text: str, step: int) -> None:
        self.sink.summary[f"{tag}/{step}"] = text

    def _close(self) -> None:
        if self.owned:
            self.sink.finish()


NOTIFIER = WandbNotifier()
"""The plugin (``failslow.plugins.DEFAULT_PLUGINS`` names it)."""
