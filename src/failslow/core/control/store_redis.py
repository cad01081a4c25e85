"""The scale-out control-store backend: a Redis server (greyhound section 6; DESIGN.md channel 2).

Greyhound moves all inter-node traffic through Redis; failslow uses it when a job outgrows one
controller process. The ``redis`` client is imported when a store is opened, never at module
import.

Mapping: user key ``k`` lives at ``failslow/k/<k>`` (the same layout as the TCPStore backend);
``add`` is INCRBY, ``compare_set`` is SET NX (expected None) or a server-side Lua script,
``delete`` is DEL, ``keys(prefix)`` is an incremental SCAN with MATCH on the escaped prefix
(O(keys in the database), never blocking the server), and ``wait`` polls EXISTS with a backoff
from 1 ms up to 50 ms (``poll_until``; Redis has no "wait until a key exists" without keyspace
notifications, which managed Redis services often disable). The client never retries on its
own: a refused or broken connection raises :class:`StoreUnavailable` at once; the next call
reconnects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from failslow.core.control.store import Store, StoreUnavailable, poll_until, redacted

T = TypeVar("T")

_DATA = "failslow/k/"
_COMPARE_SET_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisStore(Store):
    """A :class:`Store` on a Redis server."""

    def __init__(
        self, url: str, *, timeout_s: float, connect_timeout_s: float | None = None
    ) -> None:
        """``url`` as :func:`failslow.core.control.store.parse_store_url` accepted it: redis-py
        reads the host, port, database, user, password and (``rediss://``) TLS options."""
        self.url = redacted(url)
        self.timeout_s = timeout_s
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise StoreUnavailable(
                self.url, "import redis", f"{exc} (install failslow[redis])"
            ) from None
        self._errors: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
        )
        self._client: Any = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s if connect_timeout_s is None else connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_error=[],
        )
        self._compare_set = self._client.register_script(_COMPARE_SET_LUA)
        self._call("connect", self._client.ping)

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except self._errors as exc:
            raise StoreUnavailable(self.url, action, exc) from None

    def set(self, key: str, value: bytes) -> None:
        self._call("set", lambda: self._client.set(_DATA + key, bytes(value)))

    def get(self, key: str) -> bytes | None:
        raw = self._call("get", lambda: self._client.get(_DATA + key))
        return None if raw is None else bytes(raw)

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._call("add", lambda: self._client.incrby(_DATA + key, int(amount))))

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        physical = sorted({_DATA + k for k in keys})
        if not physical:
            return True
        return poll_until(
            lambda: (
                int(self._call("wait", lambda: self._client.exists(*physical))) == len(physical)
            ),
            timeout_s,
        )

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        physical = _DATA + key
        if expected is None:
            done = self._call(
                "compare_set", lambda: self._client.set(physical, bytes(desired), nx=True)
            )
        else:
            done = self._call(
                "compare_set",
                lambda: self._compare_set(keys=[physical], args=[bytes(expected), bytes(desired)]),
            )
        return bool(done)

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", lambda: self._client.delete(_DATA + key)))

    def keys(self, prefix: str) -> list[str]:
        pattern = _glob_escape(_DATA + prefix) + "*"

        def op() -> list[str]:
            found = self._client.scan_iter(match=pattern, count=1000)
            return sorted(bytes(k).decode()[len(_DATA) :] for k in found)

        return self._call("keys", op)

    def close(self) -> None:
        self._client.close()
