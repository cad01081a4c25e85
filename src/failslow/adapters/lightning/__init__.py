"""failslow for PyTorch Lightning: one line, ``Trainer(..., callbacks=[
failslow.lightning.FailslowCallback()])``, with the ``ddp`` strategy (issue 45).

The session starts when training starts (``on_train_start``: the model wrapped in DDP, the
optimizer and the training loader built by Lightning); the loop, the loader, the LR schedule,
logging, validation and checkpoints stay Lightning's. A slow rank is detected and diagnosed as
in any job; S2 takes effect inside ``trainer.fit()`` in the size form (:mod:`.plugin`). Settings
come from ``config=``, the environment (``FAILSLOW__SECTION__KEY``) or ``failslow run``; a bad
key is one line naming it, raised when the callback is built. ``loss_reduction``: how the
``training_step``'s loss reduces its batch - ``"mean"`` (Lightning's usual) or ``"sum"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback  # type: ignore[assignment,no-redef]

from failslow.adapters.common.session import start_session
from failslow.adapters.lightning.plugin import LOSS_REDUCTIONS, LightningAdapter
from failslow.config import FailslowConfig, as_config
from failslow.errors import ConfigError

__all__ = ["FailslowCallback", "LightningAdapter"]

SOURCE = "failslow.lightning.FailslowCallback(config=...)"


class FailslowCallback(Callback):  # type: ignore[misc]
    """failslow on the Lightning ``Trainer`` it is passed to (every rank builds it)."""

    def __init__(
        self,
        config: FailslowConfig | Mapping[str, Any] | None = None,
        *,
        loss_reduction: str = "mean",
    ) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError(
                f"failslow.lightning: loss_reduction must be one of {LOSS_REDUCTIONS}, got "
                f"{loss_reduction!r}"
            )
        self.config = as_config(config, SOURCE)  # a bad key fails here, before training
        self.loss_reduction = loss_reduction
        self.adapter: LightningAdapter | None = None
        """The adapter from ``on_train_start`` on (closed at the end of ``fit``)."""
        self._open = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        adapter = LightningAdapter(trainer, pl_module, loss_reduction=self.loss_reduction)
        self.adapter, self._open = adapter, True
        start_session(adapter, self.config, source=SOURCE, name="lightning")

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._open:
            self.adapter.before_batch()  # type: ignore[union-attr]

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self._open:
            self.adapter.after_backward()  # type: ignore[union-attr]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """End the session and restore the module's ``training_step`` (at the end of ``fit``)."""
        if self._open:
            self._open = False
            self.adapter.close()  # type: ignore[union-attr]
