"""The rank side of the control store: never crash or stall training because the store is gone.

Issue 4 and DESIGN.md ("an unreachable or dying store ... never crashes or stalls training"):
ranks talk to the controller through the control store (greyhound section 6 uses Redis), and a
store outage must leave them training, unmonitored, until the store is back.

:class:`ResilientStore` wraps a :class:`~failslow.core.control.store.Store`. On the first
:class:`StoreUnavailable` of an outage it logs one warning and drops the connection; from then on
every call returns at once with a neutral answer (``get`` None, ``add`` 0, ``wait``,
``compare_set`` and ``delete`` False, ``keys`` [], ``set`` nothing) while one background thread
reconnects with capped exponential backoff. Connecting never happens on the caller's thread, so a
disconnected call costs microseconds. While connected, a call is bounded by the store's operation
timeout (``timeout_s``, 1 s by default here): a server that hangs rather than dies costs the
caller that long once, then the store counts as down. Connecting gets
:data:`CONNECT_TIMEOUT_S` at least: it runs on the background thread, and a new TCPStore
connection resolves its addresses through the system resolver, where one dropped query costs
5 s (glibc's timeout; two attempts) - with the operation timeout as its budget, a rank whose
resolver drops queries would never connect. The operator-facing side (controller CLI) uses the
plain store and shows its error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from failslow.core.control.store import Store, StoreUnavailable, open_store, redacted

T = TypeVar("T")

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 12.0
"""The least a (re)connection attempt may take: two resolver timeouts of 5 s, and the connect."""


class ResilientStore(Store):
    """A store that degrades to no-ops while the server is away and reconnects by itself."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 1.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        opener: Callable[[str, float], Store] | None = None,
    ) -> None:
        self.url = redacted(url)
        """The URL as messages show it (password replaced)."""
        self._url = url
        self.timeout_s = timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.connect_timeout_s = max(timeout_s, CONNECT_TIMEOUT_S)
        connect = self.connect_timeout_s
        self._open = opener or (lambda u, t: open_store(u, timeout_s=t, connect_timeout_s=connect))
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._warned = False
        self._thread: threading.Thread | None = None
        self._start_reconnecting()

    @property
    def connected(self) -> bool:
        """True while a connection to the server is believed to work."""
        return self._store is not None

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a connection (for start-up; never call it in a step)."""
        thread = self._thread
        if self._store is None and thread is not None:
            thread.join(timeout_s)
        return self.connected

    # -- connection management ---------------------------------------------------------

    def _start_reconnecting(self) -> None:
        with self._lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(
                target=self._reconnect_loop, name="failslow-store-reconnect", daemon=True
            )
            self._thread.start()

    def _reconnect_loop(self) -> None:
        delay = self.backoff_initial_s
        while not self._closed:
            try:
                store = self._open(self._url, self.timeout_s)
            except StoreUnavailable as exc:
                self._warn(exc)
                self._wake.wait(delay)
                delay = min(delay * 2, self.backoff_max_s)
                continue
            with self._lock:
                if self._closed:
                    store.close()
                    return
                self._store = store
                if self._warned:
                    log.warning("control store %s is back; monitoring resumes", self.url)
                self._warned = False
            return

    def _warn(self, exc: StoreUnavailable) -> None:
        with self._lock:
            if self._warned or self._closed:
                return
            self._warned = True
        log.warning("%s; training continues unmonitored, reconnecting in the background", exc)

    def _guard(self, action: Callable[[Store], T], default: T) -> T:
        store = self._store
        if store is None:
            return default
        try:
            return action(store)
        except StoreUnavailable as exc:
            with self._lock:
                lost = self._store is store
                if lost:
                    self._store = None
            if lost:
                self._warn(exc)
                try:
                    store.close()
                except Exception:  # closing a broken connection must not raise here
                    log.debug("closing the broken store connection failed", exc_info=True)
                self._start_reconnecting()
            return default

    # -- protocol -------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._guard(lambda s: s.set(key, value), None)

    def get(self, key: str) -> bytes | None:
        return self._guard(lambda s: s.get(key), None)

    def add(self, key: str, amount: int = 1) -> int:
        return self._guard(lambda s: s.add(key, amount), 0)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        return self._guard(lambda s: s.wait(keys, timeout_s), False)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        return self._guard(lambda s: s.compare_set(key, expected, desired), False)

    def delete(self, key: str) -> bool:
        return self._guard(lambda s: s.delete(key), False)

    def keys(self, prefix: str) -> list[str]:
        return self._guard(lambda s: s.keys(prefix), [])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        self._wake.set()
        if store is not None:
            store.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # a connect in progress is bounded by its timeout; nothing of ours stays inside a
            # store call (at interpreter exit that aborts the process)
            thread.join(timeout=self.connect_timeout_s + 1.0)
