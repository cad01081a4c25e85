"""The job's control beside its launcher: node publisher, controller and mitigator (greyhound 4.1).

:class:`JobControl` is what ``failslow run`` (and ``failslow demo``) start next to the training
command: on every node the node's
:class:`~failslow.node.publisher.NodePublisher` (onsets, reliefs, group summaries from this
node's rings) on a thread, and on the node that hosts the controller (``--controller N``) the job's
:class:`~failslow.core.control.control_plane.ControlPlane` with the plugin hooks. It owns those
threads and stops them in :meth:`JobControl.stop`. :func:`host_store` is the embedded control
store (a TCPStore on 127.0.0.1, port 0) for a one-node job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from failslow.config import FailslowConfig
from failslow.core.control.control_plane import ControlPlane
from failslow.core.control.store import Store, open_store
from failslow.core.diagnosis.record import Diagnosis
from failslow.core.tracking.analyzer import LocalAnalyzer
from failslow.node.publisher import NodePublisher
from failslow.plugins import plugin_manager


def host_store(host: str = "127.0.0.1") -> Store:
    """An embedded control store in this process: a TCPStore on ``host`` and a free port
    (its client URL is ``store.url``, its port :func:`port_of`)."""
    return open_store(f"tcp://{host}:0?master=1")


def port_of(store: Store) -> int:
    """The port of a TCPStore's URL (``tcp://HOST:PORT[?...]``)."""
    return int(store.url.rsplit(":", 1)[1].split("?")[0])


class JobControl:
    def __init__(
        self,
        store: Store,
        config: FailslowConfig,
        *,
        world_size: int | None,
        ring_dir: Path | None = None,
        log_dir: Path | None = None,
        plugins: Iterable[Any] = (),
        on_diagnosis: Callable[[Diagnosis], None] | None = None,
        observers: Iterable[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        self.store = store
        self.plane: ControlPlane | None = None
        """The job's controller and mitigator, on the node that hosts them (``world_size``)."""
        if world_size:
            self.plane = ControlPlane(
                store,
                config,
                world_size=world_size,
                log_dir=log_dir,
                hooks=plugin_manager(plugins).hook,
                on_diagnosis=on_diagnosis,
                observers=observers,
            )
        self.publisher = NodePublisher(LocalAnalyzer(ring_dir), store) if ring_dir else None
        if self.publisher is not None and self.plane is not None:
            self.publisher.on_event = self.plane.controller.wake.set  # react at once
            self.plane.controller.wake_publisher = self.publisher.ask  # answer at once
            self.publisher.asked_here = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False

    @property
    def controller(self) -> Any:
        return self.plane.controller if self.plane is not None else None

    @property
    def mitigator(self) -> Any:
        return self.plane.mitigator if self.plane is not None else None

    def start(self) -> JobControl:
        """Start the threads (a second call does nothing)."""
        if self._started:
            return self
        self._started = True
        if self.plane is not None:
            self.plane.start()
        if self.publisher is not None:
            self._thread = threading.Thread(
                target=self.publisher.run, args=(self._stop.is_set,), name="failslow-node"
            )
            self._thread.daemon = True
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the threads (safe when never started)."""
        if not self._started:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        if self.plane is not None:
            self.plane.stop()
