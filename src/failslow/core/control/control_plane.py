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

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from failslow.core.control.controller import Controller
from failslow.core.control.journal import JOURNAL, Journal, Observer, StatusBoard
from failslow.core.control.mitigator import Mitigator
from failslow.core.control.store import Store
from failslow.core.diagnosis.record import Diagnosis
from failslow.core.localize.config import DetectionConfig, ValidationConfig
from failslow.core.planner.config import PlannerConfig

log = logging.getLogger(__name__)


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
    ``on_diagnosis``: called with every diagnosis after the hooks (a CLI prints it);
    ``observers``: get every event (:mod:`.journal`) after the status record in the store
    (``failslow/status``) and the journal (``<log_dir>/events.jsonl``) - the metrics exporter.
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
        observers: Iterable[Observer] = (),
    ) -> None:
        self.store = store
        self.hooks = hooks
        self.settings = settings
        self.world_size = world_size
        token = settings.job_token
        if log_dir is None and settings.log_dir:
            log_dir = Path(settings.log_dir)
        self.journal = Journal(log_dir / JOURNAL) if log_dir is not None else None
        self.observers: list[Observer] = [StatusBoard(store, world_size=world_size)]
        """Every event of the controller and the mitigator goes to each (:mod:`.journal`)."""
        if self.journal is not None:
            self.observers.append(self.journal)
        self.observers += list(observers)
        self.mitigator = Mitigator(
            store,
            settings.planner,
            world_size=world_size,
            hooks=hooks,
            token=token,
            on_event=self._observe,
        )
        self._extra = on_diagnosis
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
            on_event=self._observe,
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._threads_started = False

    def _observe(self, ev: dict[str, Any]) -> None:
        for observer in self.observers:
            try:
                observer(ev)
            except Exception as exc:  # an observer never stops the control plane
                log.warning("failslow: observer %r failed on a %s event: %s", observer,
                            ev.get("kind"), exc)  # fmt: skip

    def _diagnosed(self, diagnosis: Diagnosis) -> None:
        if self.hooks is not None:
            self.hooks.failslow_on_diagnosis(diagnosis=diagnosis)
        if self._extra is not None:
            self._extra(diagnosis)
        self.mitigator.on_diagnosis(diagnosis)

    def start(self) -> ControlPlane:
        if self.hooks is not None:
            self.hooks.failslow_control_start(config=self.settings, world_size=self.world_size)
        stop = self._stop.is_set
        self._threads = [
            threading.Thread(target=self.controller.run, args=(stop,), name="failslow-ctl"),
            threading.Thread(target=self.mitigator.run, args=(stop,), name="failslow-mitigate"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        self._threads_started = True
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10.0)
        self._threads = []
        if self.journal is not None:
            self.journal.close()
        if self.hooks is not None and self._threads_started:
            self._threads_started = False
            self.hooks.failslow_control_end()
