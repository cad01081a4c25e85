"""The embedded control-store backend: torch.distributed's ``TCPStore`` (DESIGN.md, channel 2).

Greyhound section 6 carries inter-node traffic over Redis; this backend gives the same protocol
with no extra service, on the job's own TCPStore or one hosted by the controller. torch is
imported when a store is opened, never at module import.

How the protocol maps onto TCPStore (torch 2.13):

- Namespace: user key ``k`` lives at ``failslow/k/<k>``; internal keys use ``failslow/i/``
  (listing indexes) and ``failslow/rk/``, ``failslow/rd/`` (registration markers), so failslow
  can share the job's rendezvous store without touching torch's keys.
- Values: stored as ``0x00 + 8 random bytes + value``. The nonce makes every write unique, which is
  what lets :meth:`compare_set` tell "I won" from "someone else wrote the same bytes" (TCPStore's
  ``compare_set`` returns the current value, not a flag). Counters are written by TCPStore's
  native ``add`` as ASCII decimals and are returned as such, as Redis does.
- ``get`` never blocks: TCPStore's own ``get`` waits until the key exists, so a read is a
  ``compare_set`` with an expected value no stored value can have - the server answers with the
  current value or, when the key is absent, with that expected value - one round trip, no write.
- ``wait`` polls ``check`` with a backoff from 1 ms to 50 ms (:func:`poll_until`, as the Redis
  backend does). TCPStore's native wait would hold the connection, which every thread of the
  process shares, for the whole wait; a second connection per waiting thread would cost a connect
  on the caller's thread (see :meth:`TCPStoreBackend._connect`).
- ``keys(prefix)``: TCPStore has no (portable) listing, so every key is registered once in an
  append-only index of its directory (the part up to its last ``/``), and each directory in its
  parent's, using TCPStore's atomic ``append``. A marker key per registered name keeps the index
  free of duplicates; the marker is set only after the entry and all its ancestors are in place,
  so a writer that dies half-way leaves at worst a duplicate entry, never a missing one.
  Cost: the first write of a key by a client costs about 3 extra round trips (later writes by
  that client none, thanks to a local cache); ``keys(prefix)`` reads one index per directory
  under the prefix and checks existence of the candidates (one round trip when all exist), so it
  is O(distinct keys ever created under the prefix). Deleted keys stay in the index and are
  filtered out; reuse key names (slots) instead of minting unbounded new ones.
- Errors: torch's ``DistError`` (broken pipe, connect timeout) becomes :class:`StoreUnavailable`.
  A ``set`` is fire-and-forget in TCPStore, so the first ``set`` after the server died may
  appear to succeed; the next operation that reads a reply raises.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from failslow.core.control.store import Store, StoreUnavailable, poll_until

T = TypeVar("T")

_DATA = "failslow/k/"
_INDEX = "failslow/i/"
_KEY_MARK = "failslow/rk/"
_DIR_MARK = "failslow/rd/"
_VALUE_TAG = b"\x00"
_NONCE_BYTES = 8
# An expected value that no stored value equals (values start with 0x00, counters are ASCII
# digits, index entries start with a 4-byte length), used for non-blocking reads.
_ABSENT = b"\x01failslow:absent"
_NOT_WRITTEN = b"\x01failslow:unused"


def _encode(value: bytes) -> bytes:
    return _VALUE_TAG + os.urandom(_NONCE_BYTES) + bytes(value)


def _decode(raw: bytes) -> bytes:
    return raw[1 + _NONCE_BYTES :] if raw[:1] == _VALUE_TAG else raw


def _entry(name: str) -> bytes:
    data = name.encode()
    return struct.pack(">I", len(data)) + data


def _entries(raw: bytes) -> list[str]:
    names: dict[str, None] = {}
    pos = 0
    while pos + 4 <= len(raw):
        (size,) = struct.unpack_from(">I", raw, pos)
        names[raw[pos + 4 : pos + 4 + size].decode()] = None
        pos += 4 + size
    return list(names)


HOST_TIMEOUT_S = 30.0
"""The least time hosting a store may take (its own connection is resolved like any other)."""


class TCPStoreBackend(Store):
    """A :class:`Store` on torch.distributed's TCPStore, as client or as host (``master``)."""

    def __init__(
        self, url: str, host: str, port: int, *, master: bool, timeout_s: float,
        connect_timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        self.url = url
        self.timeout_s = timeout_s
        self.host = host
        self._registered: set[str] = set()
        self._closed = False
        try:
            import torch.distributed as dist
        except ImportError as exc:  # pragma: no cover - torch is a declared extra
            raise StoreUnavailable(url, "import torch", exc) from None
        self._store: Any = None
        self._dist_error: type[BaseException] = dist.DistError
        connect = timeout_s if connect_timeout_s is None else connect_timeout_s
        deadline = time.monotonic() + connect
        if master:
            # hosting includes the store's own client connection, which c10d resolves through
            # the system resolver (see _connect): one timed-out query takes 5 s, so the host
            # gets HOST_TIMEOUT_S at least (seen: a 5 s budget failed under load here)
            host_timeout = timedelta(seconds=max(connect, HOST_TIMEOUT_S))
            try:
                self._store = dist.TCPStore(
                    host, port, None, True, host_timeout, wait_for_workers=False
                )
                self._store.set_timeout(timedelta(seconds=timeout_s))
            except (self._dist_error, RuntimeError, OSError) as exc:
                raise StoreUnavailable(url, "host", exc) from None
        else:
            self._store = self._connect(port, deadline)
        self.port = int(self._store.port)
        if master:
            self.url = f"tcp://{host}:{self.port}"

    # -- plumbing -------------------------------------------------------------------------

    def _connect(self, port: int, deadline: float) -> Any:
        """A client connection within ``deadline``; a refused connection fails at once (TCPStore
        itself would retry it until its timeout).

        torch's c10d resolves the peer and local addresses of every new connection through the
        system resolver; where DNS is slow or drops queries (sandboxes, air-gapped clusters) one
        connection can take the resolver's 5 s timeout whatever ``timeout_s`` is. Operations on
        an open connection do not resolve names.

        torch's handshake itself has no timeout: on a port that accepts connections and never
        answers (not a TCPStore) it waits forever. It runs on a daemon thread, abandoned (it
        holds one socket) when the deadline passes.
        """
        try:
            budget = max(deadline - time.monotonic(), 0.001)
            socket.create_connection((self.host, port), timeout=budget).close()
        except OSError as exc:
            raise StoreUnavailable(self.url, "connect", exc) from None
        import torch.distributed as dist

        left = max(deadline - time.monotonic(), 0.1)
        outcome: list[Any] = []

        def handshake() -> None:
            try:
                store = dist.TCPStore(self.host, port, None, False, timedelta(seconds=left))
                store.set_timeout(timedelta(seconds=self.timeout_s))
                outcome.append(store)
            except BaseException as exc:  # handed to the caller's thread
                outcome.append(exc)

        thread = threading.Thread(target=handshake, name="failslow-store-connect", daemon=True)
        thread.start()
        thread.join(left + 1.0)
        if not outcome:
            why = f"no TCPStore answered within {left:.0f} s (is this the job's control store?)"
            raise StoreUnavailable(self.url, "connect", why)
        if isinstance(outcome[0], self._dist_error | RuntimeError | OSError):
            raise StoreUnavailable(self.url, "connect", outcome[0]) from None
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        if self._closed:
            raise StoreUnavailable(self.url, action, "store is closed")
        try:
            return fn()
        except self._dist_error as exc:
            raise StoreUnavailable(self.url, action, exc) from None

    def _read(self, physical: str) -> bytes | None:
        raw = self._store.compare_set(physical, _ABSENT, _NOT_WRITTEN)
        return None if raw == _ABSENT else bytes(raw)

    def _register(self, key: str) -> None:
        """Make ``key`` listable: an entry in its directory's index, directories up to the root."""
        if _KEY_MARK + key in self._registered:
            return
        # Levels from the key up: (marker, index to append to, entry).
        levels: list[tuple[str, str, str]] = []
        cut = key.rfind("/") + 1
        levels.append((_KEY_MARK + key, _INDEX + key[:cut], key[cut:]))
        directory = key[:cut]
        while directory:
            parent_cut = directory.rfind("/", 0, len(directory) - 1) + 1
            levels.append(
                (_DIR_MARK + directory, _INDEX + directory[:parent_cut], directory[parent_cut:])
            )
            directory = directory[:parent_cut]
        todo: list[tuple[str, str, str]] = []
        for level in levels:
            marker = level[0]
            if marker in self._registered:
                break
            if self._store.check([marker]):
                self._registered.add(marker)
                break
            todo.append(level)
        for marker, index, name in reversed(todo):
            self._store.append(index, _entry(name))
            self._store.set(marker, b"1")
            self._registered.add(marker)

    # -- protocol -------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        def op() -> None:
            self._register(key)
            self._store.set(_DATA + key, _encode(value))

        self._call("set", op)

    def get(self, key: str) -> bytes | None:
        raw = self._call("get", lambda: self._read(_DATA + key))
        return None if raw is None else _decode(raw)

    def add(self, key: str, amount: int = 1) -> int:
        def op() -> int:
            self._register(key)
            return int(self._store.add(_DATA + key, int(amount)))

        return self._call("add", op)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        physical = sorted({_DATA + k for k in keys})
        if not physical:
            return True
        return poll_until(
            lambda: self._call("wait", lambda: bool(self._store.check(physical))), timeout_s
        )

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        physical = _DATA + key
        new = _encode(desired)

        def op() -> bool:
            self._register(key)
            if expected is None:
                return bytes(self._store.compare_set(physical, b"", new)) == new
            current = self._read(physical)
            deadline = time.monotonic() + self.timeout_s
            while current is not None and _decode(current) == bytes(expected):
                answer = bytes(self._store.compare_set(physical, current, new))
                if answer == new:
                    return True
                if answer == current:
                    return False  # the key vanished: TCPStore echoes the expected value
                if time.monotonic() > deadline:
                    return False
                current = answer  # someone else wrote; compare their value
            return False

        return self._call("compare_set", op)

    def delete(self, key: str) -> bool:
        return self._call("delete", lambda: bool(self._store.delete_key(_DATA + key)))

    def keys(self, prefix: str) -> list[str]:
        def op() -> list[str]:
            cut = prefix.rfind("/") + 1
            pending = [(prefix[:cut], prefix[cut:])]
            candidates: list[str] = []
            while pending:
                directory, start = pending.pop()
                raw = self._read(_INDEX + directory) or b""
                for name in _entries(raw):
                    if not name.startswith(start):
                        continue
                    if name.endswith("/"):
                        pending.append((directory + name, ""))
                    else:
                        candidates.append(directory + name)
            if not candidates:
                return []
            if self._store.check([_DATA + k for k in candidates]):
                return sorted(candidates)
            return sorted(k for k in candidates if self._store.check([_DATA + k]))

        return self._call("keys", op)

    def close(self) -> None:
        self._closed = True
        self._store = None  # a hosted server stops once torch drops its last reference
