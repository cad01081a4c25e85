"""What the TensorBoard and W&B notifiers share: activation by config, and never breaking training.

A notifier is a built-in plugin (:data:`failslow.plugins.DEFAULT_PLUGINS`) that stays inert
until a process says who it is: a rank's session (``failslow_session_start``; rank 0 only
writes, the job's step time is one series) or the job's control plane
(``failslow_control_start``: diagnoses, plans and their outcomes). A missing backend package, a
backend that raises, a full disk: one warning line, then the notifier turns itself off for the
rest of the process. Training never sees an exception from it (DESIGN.md: a job that finished
training is never reported failed because of failslow).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from failslow import hookimpl

log = logging.getLogger("failslow")


class Notifier:
    """One backend, opened at most once per process role; subclasses implement ``enabled``,
    ``_open``, ``_scalars(values, step)``, ``_text(tag, text, step)`` and ``_close``. An
    instance is the plugin (its ``failslow_*`` methods are the hook implementations)."""

    name = "notifier"

    def __init__(self) -> None:
        self.sink: Any = None
        self.role: str | None = None
        self.events = 0
        self._lock = threading.Lock()

    def enabled(self, config: Any) -> bool:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def start(self, config: Any, role: str) -> None:
        observe = getattr(config, "observe", None)
        if observe is None or self.sink is not None or not self.enabled(observe):
            return
        self._guard(lambda: self._start(observe, role), "cannot start")

    def _start(self, observe: Any, role: str) -> None:
        self.sink = self._open(observe, role)
        self.role = role

    def scalars(self, values: dict[str, float], step: int | None = None) -> None:
        if self.sink is not None:
            self._guard(lambda: self._scalars(values, step), "failed to write")

    def text(self, tag: str, text: str) -> None:
        if self.sink is not None:
            self.events += 1
            self._guard(lambda: self._text(tag, text, self.events), "failed to write")

    def end(self) -> None:
        if self.sink is not None:
            self._guard(self._close, "failed to close")
            self.sink = None
            self.role = None

    # ---- the hooks ----------------------------------------------------------------------------
    @hookimpl
    def failslow_session_start(self, config: Any, rank: int, world_size: int) -> None:
        if rank == 0:
            self.start(config, "rank0")

    @hookimpl
    def failslow_session_end(self, rank: int) -> None:
        if self.role == "rank0":
            self.end()

    @hookimpl
    def failslow_control_start(self, config: Any, world_size: int) -> None:
        self.start(config, "controller")

    @hookimpl
    def failslow_control_end(self) -> None:
        if self.role == "controller":
            self.end()

    @hookimpl
    def failslow_on_step(self, step: int, step_time_s: float) -> None:
        if self.sink is not None:
            self.scalars({"failslow/step_time_s": step_time_s}, step)

    @hookimpl
    def failslow_on_diagnosis(self, diagnosis: Any) -> None:
        if self.sink is not None:
            self.text("failslow/diagnoses", diagnosis.to_json())
            self.scalars(diagnosis_values(diagnosis))

    @hookimpl
    def failslow_on_plan(self, plan: Any, action: str, reason: str) -> None:
        if self.sink is not None:
            self.text("failslow/plans", describe_plan(plan, action, reason))

    @hookimpl
    def failslow_on_plan_result(
        self, plan: Any, step: int | None, outcome: str, detail: str
    ) -> None:
        if self.sink is not None:
            where = f" from step {step}" if step is not None else ""
            self.text("failslow/plans", f"{type(plan).__name__} {outcome}{where} {detail}")

    # ---- plumbing -------------------------------------------------------------------------------
    def _guard(self, action: Any, what: str) -> None:
        with self._lock:
            try:
                action()
            except Exception as exc:  # a notifier never breaks training: off for good
                log.warning(
                    "failslow: %s notifier %s (%s: %s); it is off for this process",
                    self.name, what, type(exc).__name__, exc,
                )  # fmt: skip
                self.sink = None

    def _open(self, observe: Any, role: str) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def _scalars(self, values: dict[str, float], step: int | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def _text(self, tag: str, text: str, step: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _close(self) -> None:  # pragma: no cover
        raise NotImplementedError


def describe_plan(plan: Any, action: str, reason: str) -> str:
    what = ""
    if getattr(plan, "counts", None):
        what = f" counts {list(plan.counts)}"
    elif getattr(plan, "hosts", None):
        what = f" hosts {list(plan.hosts)}"
    estimate = getattr(plan, "step_time_s", None)
    est = f", estimated step {estimate:.3f} s" if estimate else ""
    return f"{action} {type(plan).__name__}{what}{est}: {reason}"


def diagnosis_values(diagnosis: Any) -> dict[str, float]:
    values = {f"failslow/slowdown/rank{s.rank}": float(s.slowdown) for s in diagnosis.slow_ranks}
    for link in diagnosis.slow_links:
        values[f"failslow/slowdown/link{link.a}-{link.b}"] = float(link.slowdown)
    return values
