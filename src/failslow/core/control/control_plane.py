"""One job's control plane: the controller and the mitigator, each on its own thread.

greyhound 4.1 (the GlobalAnalyzer: profiling, validation, diagnosis) and 5 (multi-level
mitigation): :class:`ControlPlane` runs the
:class:`~failslow.core.control.controller.Controller` and the
:class:`~failslow.core.control.mitigator.Mitigator` over the job's control store, configured
from the ``detection``, ``validation`` and ``planner`` sections of failslow's settings, and
reports to the plugin hooks (``failslow_on_diagnosis``, ``failslow_on_plan``,
``failslow_choose_plan``, ...) through the hook relay it is given. One per job: embedded in the
launcher that hosts the controller (``failslow run --controller``), or its own process
(``failslow controller``). Each node's publisher runs beside it in the node layer
(:mod:`failslow.node.publisher`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from failslow.core.control.controller import Controller
from failslow.core.control.mitigator import Mitigator
from failslow.core.control.store import Store
from failslow.core.diagnosis.record import Diagnosis
from failslow.core.localize.config import DetectionConfig, ValidationConfig
from failslow.core.planner.config import PlannerConfig


class Settings(Protocol):
    """The sections the control plane reads (:class:`failslow.config.FailslowConfig` has them)."""

    log_dir: str | None
    job_token: str | None
    detection: DetectionConfig
    validation: ValidationConfig
    planner: PlannerConfig


class ControlPlane:
    """Controller + mitigator threads; :meth:`start` once, :meth:`stop` joins both.

    ``hooks``: a pluggy hook relay (``plugin_manager().hook``) or None for no plugins;
    ``on_diagnosis``: called with every diagnosis after the hooks (a CLI prints it).
    """

    def __init__(
        self,
        store: Store,
        settings: Settings,
        *,
        world_size: int,
        log_dir: Path | None = None,
        hooks: Any = None,
        on_diagnosis: Callable[[Diagnosis], None] | None = None,
    ) -> None:
        self.store = store
        self.hooks = hooks
        token = settings.job_token
        self.mitigator = Mitigator(
            store, settings.planner, world_size=world_size, hooks=hooks, token=token
        )
        self._extra = on_diagnosis
        if log_dir is None and settings.log_dir:
            log_dir = Path(settings.log_dir)
        self.controller = Controller(
            store,
            world_size=world_size,
            detection=settings.detection,
            validation=settings.validation,
            log_dir=log_dir,
            token=token,
            on_diagnosis=self._diagnosed,
            mitigation_active=lambda: self.mitigator.active,
            on_healthy=self.mitigator.on_healthy,
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _diagnosed(self, diagnosis: Diagnosis) -> None:
        if self.hooks is not None:
            self.hooks.failslow_on_diagnosis(diagnosis=diagnosis)
        if self._extra is not None:
            self._extra(diagnosis)
        self.mitigator.on_diagnosis(diagnosis)

    def start(self) -> ControlPlane:
        stop = self._stop.is_set
        self._threads = [
            threading.Thread(target=self.controller.run, args=(stop,), name="failslow-ctl"),
            threading.Thread(target=self.mitigator.run, args=(stop,), name="failslow-mitigate"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10.0)
        self._threads = []
