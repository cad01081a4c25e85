"""One job's control plane: node publisher, controller and mitigator threads (greyhound 4.1, 5).

What ``failslow run --controller``, ``failslow controller`` and ``failslow demo`` start beside a
job: a :class:`~failslow.core.control.publisher.NodePublisher` per node (onsets, reliefs and
group summaries from the rings of this node's ranks), the
:class:`~failslow.core.control.controller.Controller` (profiling, validation, diagnosis) and the
:class:`~failslow.core.control.mitigator.Mitigator` (ski-rental planner, plans to every rank),
all configured from one :class:`~failslow.config.FailslowConfig` and reporting to the plugin
hooks (``failslow_on_diagnosis``, ``failslow_on_plan``, ``failslow_choose_plan``, ...).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from failslow.config import FailslowConfig
from failslow.core.control.controller import Controller, ControllerConfig
from failslow.core.control.mitigator import Mitigator
from failslow.core.control.store import Store
from failslow.core.diagnosis.record import Diagnosis

log = logging.getLogger(__name__)


def controller_config(
    config: FailslowConfig, *, world_size: int, log_dir: Path | None = None
) -> ControllerConfig:
    """The controller's settings from failslow's config tree."""
    validation = config.validation
    if log_dir is None and config.log_dir:
        log_dir = Path(config.log_dir)
    return ControllerConfig(
        world_size=world_size,
        log_dir=log_dir,
        threshold=config.detection.threshold,
        cooldown_s=config.detection.cooldown_s,
        gemm={
            "kind": "gemm",
            "repetitions": validation.gemm_repetitions,
            "serial": validation.gemm_serial,
            **({"size": validation.gemm_size} if validation.gemm_size else {}),
        },
        link_nbytes=validation.link_mb << 20,
        link_repetitions=validation.link_repetitions,
        pause_margin_s=validation.pause_margin_s,
        validation_timeout_s=validation.pause_timeout_s,
        recheck_every_s=validation.recheck_every_s,
    )


class ControlPlane:
    def __init__(
        self,
        store: Store,
        config: FailslowConfig,
        *,
        world_size: int,
        ring_dir: Path | None = None,
        log_dir: Path | None = None,
        plugins: Iterable[Any] = (),
        on_diagnosis: Callable[[Diagnosis], None] | None = None,
    ) -> None:
        from failslow.plugins import plugin_manager

        self.pm = plugin_manager(plugins)
        self.store = store
        self.mitigator = Mitigator(store, config, world_size=world_size, hooks=self.pm.hook)
        self._extra = on_diagnosis
        self.controller = Controller(
            store,
            controller_config(config, world_size=world_size, log_dir=log_dir),
            on_diagnosis=self._diagnosed,
            mitigation_active=lambda: self.mitigator.active,
            on_healthy=self.mitigator.on_healthy,
        )
        self.publisher = None
        if ring_dir is not None:
            from failslow.core.control.publisher import NodePublisher
            from failslow.core.local_analyzer import LocalAnalyzer

            self.publisher = NodePublisher(LocalAnalyzer(ring_dir), store)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _diagnosed(self, diagnosis: Diagnosis) -> None:
        self.pm.hook.failslow_on_diagnosis(diagnosis=diagnosis)
        if self._extra is not None:
            self._extra(diagnosis)
        self.mitigator.on_diagnosis(diagnosis)

    def _publish(self) -> None:
        assert self.publisher is not None
        while not self._stop.wait(0.05):
            try:
                self.publisher.poll()
            except Exception:  # never take the launcher down
                log.warning("failslow: node publisher failed", exc_info=True)

    def start(self) -> ControlPlane:
        stop = self._stop.is_set
        self._threads = [
            threading.Thread(target=self.controller.run, args=(stop,), name="failslow-ctl"),
            threading.Thread(target=self.mitigator.run, args=(stop,), name="failslow-mitigate"),
        ]
        if self.publisher is not None:
            self._threads.append(threading.Thread(target=self._publish, name="failslow-node"))
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10.0)
