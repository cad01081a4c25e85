"""Built-in notifier: TensorBoard scalars and text (``observe.tensorboard_dir``).

Enabled by one setting - ``"observe": {"tensorboard_dir": "runs/tb"}`` in the failslow block,
or ``FAILSLOW__OBSERVE__TENSORBOARD_DIR`` for the launcher's controller - and written with
torch's own ``SummaryWriter`` (needs the ``tensorboard`` package):

- ``<dir>/failslow-rank0``: ``failslow/step_time_s`` per training step (rank 0's session);
  plans applied on the rank as text (``failslow/plans``);
- ``<dir>/failslow-controller``: every diagnosis as text (``failslow/diagnoses``) and each slow
  rank's or link's slowdown as scalars (``failslow/slowdown/rank<r>``), every decision and its
  outcome as text (``failslow/plans``).

A user's own TensorBoard run shows both beside its loss curves when pointed at the same parent
directory. Failures follow :mod:`failslow.builtin.notifier`: a warning, never an exception.
"""

from __future__ import annotations

import os
from typing import Any

from failslow.builtin.notifier import Notifier


class TensorBoardNotifier(Notifier):
    name = "TensorBoard"

    def enabled(self, observe: Any) -> bool:
        return bool(observe.tensorboard_dir)

    def _open(self, observe: Any, role: str) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(os.path.join(observe.tensorboard_dir, f"failslow-{role}"))

    def _scalars(self, values: dict[str, float], step: int | None) -> None:
        for tag, value in values.items():
            self.sink.add_scalar(tag, value, global_step=step if step is not None else self.events)

    def _text(self, tag: str, text: str, step: int) -> None:
        self.sink.add_text(tag, text, global_step=step)
        self.sink.flush()

    def _close(self) -> None:
        self.sink.close()


NOTIFIER = TensorBoardNotifier()
"""The plugin (``failslow.plugins.DEFAULT_PLUGINS`` names it)."""
