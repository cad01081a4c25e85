"""The job's control store: a small key/value protocol with counters, waits and compare-and-set.

This is the second of failslow's two channels (DESIGN.md, "The path of one fail-slow"): node
analyzers publish onsets and per-group summaries here, the controller publishes pause requests
and diagnoses. Greyhound section 6 moves inter-node traffic through Redis; failslow keeps that as
the scale-out backend and uses torch.distributed's ``TCPStore`` as the embedded default, so a job
needs no extra service. Both backends implement the same :class:`Store` and pass the same suite.

URLs accepted by :func:`open_store`:

- ``tcp://HOST:PORT`` - client of an existing TCPStore (for example the job's MASTER_ADDR store;
  failslow's keys live under their own namespace, so they never collide with torch's);
- ``tcp://HOST:PORT?master=1`` - host an embedded TCPStore in this process (``PORT`` may be 0;
  the bound port is ``store.port`` and a client URL is ``store.url``);
- ``redis://HOST:PORT/DB`` - a Redis server (``PORT`` defaults to 6379, ``DB`` to 0), with a
  password ``redis://:PASSWORD@HOST:PORT/DB`` or an ACL user ``redis://USER:PASSWORD@...``
  (percent-encode ``@ : / # %`` in a password);
- ``rediss://...`` - the same over TLS; options ``ssl_ca_certs=CA.pem`` (the server's CA),
  ``ssl_certfile=`` / ``ssl_keyfile=`` (a client certificate), ``ssl_cert_reqs=required|none``,
  ``ssl_check_hostname=true|false``.

Error messages name the URL with its password replaced by ``***``.

Every operation is bounded by a timeout; a server that cannot be reached or dies raises
:class:`StoreUnavailable` naming the URL. Training processes use
:class:`failslow.core.control.resilient.ResilientStore`, which turns that into "keep training
unmonitored and reconnect later". This module imports neither torch nor redis; the backends import
them when a store is opened.
"""

from __future__ import annotations

import abc
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from failslow.errors import ConfigError, FailslowError

ACCEPTED_URLS = (
    "tcp://HOST:PORT, tcp://HOST:PORT?master=1, redis://HOST:PORT/DB (with a password: "
    "redis://[USER]:PASSWORD@HOST:PORT/DB) or rediss://... (TLS)"
)
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
"""The options a ``rediss://`` URL may carry (redis-py's names)."""


def redacted(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except (ValueError, TypeError):
        return str(url)
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


class StoreUnavailable(FailslowError):
    """The control store server cannot be reached, timed out or died; names the URL."""

    def __init__(self, url: str, action: str, reason: object) -> None:
        url = redacted(url)
        self.url = url
        self.action = action
        self.reason = first_line(reason)
        super().__init__(f"control store {url}: {action} failed: {self.reason}")


def first_line(reason: object, limit: int = 200) -> str:
    """The first non-empty line of an exception message (torch's carry C++ stack traces)."""
    text = str(reason).strip()
    line = text.splitlines()[0].strip() if text else type(reason).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Store(abc.ABC):
    """Key/value store with atomic counters, waits and compare-and-set; values are bytes.

    Keys are strings; ``/`` separates levels (``keys(prefix)`` is cheapest for prefixes that end
    at a ``/``). A key written with :meth:`add` is a counter: read it with :meth:`get` (ASCII
    decimal, as Redis returns it) or :meth:`add` with amount 0; never write it with :meth:`set`
    or :meth:`compare_set` (TCPStore cannot add to such a value). Implementations are safe to
    share between threads.
    """

    url: str

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist (never waits for it)."""

    @abc.abstractmethod
    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add ``amount`` to the counter ``key`` (absent counts as 0); the new value."""

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key exists; False when ``timeout_s`` passes first (never raises)."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Atomically set ``key`` to ``desired`` if it holds ``expected`` (None: if absent).

        True when this call made the change. Of several concurrent contenders with the same
        ``expected``, exactly one wins.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    @abc.abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Sorted list of the existing keys that start with ``prefix``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def set_json(self, key: str, value: Any) -> None:
        """Store ``value`` as compact JSON."""
        self.set(key, json.dumps(value, separators=(",", ":"), sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        """The JSON value of ``key``, or None when it does not exist."""
        raw = self.get(key)
        return None if raw is None else json.loads(raw)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


POLL_MIN_S = 0.001
POLL_MAX_S = 0.05


def poll_until(all_exist: Callable[[], bool], timeout_s: float) -> bool:
    """Call ``all_exist`` with a backoff from 1 ms to 50 ms until it is true or ``timeout_s``
    passes; the ``wait`` of both backends (one cheap request per poll, no held connection)."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    pause = POLL_MIN_S
    while True:
        if all_exist():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, POLL_MAX_S)


def _bad_url(url: str, why: str) -> ConfigError:
    return ConfigError(f"control store URL {redacted(url)!r}: {why}; expected {ACCEPTED_URLS}")


def parse_store_url(url: str) -> tuple[str, str, int, dict[str, str], int]:
    """Split a store URL into (scheme, host, port, options, db); ConfigError when malformed."""
    if not isinstance(url, str) or "://" not in url:
        raise _bad_url(str(url), "not a URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _bad_url(url, str(exc)) from None
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    if scheme not in ("tcp", "redis", "rediss"):
        raise _bad_url(url, f"unknown scheme {parts.scheme!r}")
    if not host:
        raise _bad_url(url, "no host")
    if parts.fragment:
        raise _bad_url(url, "a fragment is not supported")
    if scheme == "tcp" and (parts.username or parts.password):
        raise _bad_url(url, "a tcp URL has no user or password")
    try:
        options = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True))
    except ValueError:
        if parts.query:
            raise _bad_url(url, f"malformed query {parts.query!r}") from None
        options = {}
    db = 0
    if scheme == "tcp":
        unknown = sorted(set(options) - {"master"})
        if unknown:
            raise _bad_url(url, f"unknown option {unknown[0]!r} (allowed: master)")
        if options.get("master", "0") not in ("0", "1"):
            raise _bad_url(url, "master must be 0 or 1")
        if parts.path not in ("", "/"):
            raise _bad_url(url, "a tcp URL has no path")
        if port is None:
            raise _bad_url(url, "no port")
        if port == 0 and options.get("master") != "1":
            raise _bad_url(url, "port 0 only makes sense with master=1")
    else:
        allowed = TLS_OPTIONS if scheme == "rediss" else ()
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            where = f"allowed: {', '.join(allowed)}" if allowed else "a redis URL takes none"
            raise _bad_url(url, f"unknown option {unknown[0]!r} ({where})")
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if name in options and not os.path.isfile(options[name]):
                raise _bad_url(url, f"{name} {options[name]!r} is not a file")
        if options.get("ssl_cert_reqs", "required") not in ("required", "optional", "none"):
            raise _bad_url(url, "ssl_cert_reqs must be required, optional or none")
        if options.get("ssl_check_hostname", "true").lower() not in ("true", "false"):
            raise _bad_url(url, "ssl_check_hostname must be true or false")
        port = 6379 if port is None else port
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise _bad_url(url, f"database {path!r} is not a number")
            db = int(path)
        if port == 0:
            raise _bad_url(url, "port 0")
    return scheme, host, port, options, db


def open_store(
    url: str, *, timeout_s: float = 5.0, connect_timeout_s: float | None = None
) -> Store:
    """Open the store at ``url`` (forms in the module docstring); every operation is bounded by
    ``timeout_s``, connecting by ``connect_timeout_s`` (default ``timeout_s``). ConfigError for a
    bad URL, StoreUnavailable when the server cannot be reached."""
    scheme, host, port, options, _db = parse_store_url(url)
    connect = timeout_s if connect_timeout_s is None else connect_timeout_s
    for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect)):
        if not value > 0:
            raise ConfigError(f"control store {name} must be > 0, got {value!r}")
    if scheme == "tcp":
        from failslow.core.control.store_tcp import TCPStoreBackend

        return TCPStoreBackend(
            url, host, port, master=options.get("master") == "1", timeout_s=timeout_s,
            connect_timeout_s=connect,
        )  # fmt: skip
    from failslow.core.control.store_redis import RedisStore

    return RedisStore(url, timeout_s=timeout_s, connect_timeout_s=connect)
