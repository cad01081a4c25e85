"""CRC-32 of a large buffer on several threads, the same value as ``zlib.crc32`` (byterobust 6.3).

An every-step snapshot is sealed with the CRC-32 of its bytes. On one core zlib computes it at
2-3 GB/s, so the 4.46 GB state of a 355 M-parameter model with AdamW took 1.4 s to seal on an
H200 machine - eleven 126 ms steps, each of whose snapshots was skipped (``benchmarks/gpu``).
The D2H copy itself took 93 ms. Here the buffer is cut into chunks that threads checksum at once
(``zlib.crc32`` lets go of the GIL), and the chunks' CRCs are combined as zlib's
``crc32_combine`` does (multiplication by x^(8n) modulo the CRC polynomial), so every reader and
every stored snapshot sees the same checksum as before.

``FAILSLOW_CHECKSUM_THREADS`` sets the thread count (default: 4, or the number of CPUs if fewer);
buffers under two chunks are checksummed on the calling thread.
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from failslow import envvars

CHUNK = 64 << 20
"""Bytes per task: large enough that the combine and the hand-off are noise (~0.1%)."""
_POLY = 0xEDB88320  # the reflected CRC-32 polynomial (zlib's)

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def threads() -> int:
    """Threads a checksum may use (``$FAILSLOW_CHECKSUM_THREADS``, default min(4, CPUs))."""
    text = os.environ.get(envvars.CHECKSUM_THREADS, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"${envvars.CHECKSUM_THREADS}={text!r}: expected a positive whole number"
            ) from None
        if value < 1:
            raise ValueError(f"${envvars.CHECKSUM_THREADS}={value}: expected at least 1")
        return value
    return max(1, min(4, os.cpu_count() or 1))


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (bit-reflected, as zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what appending nbytes does to a CRC."""
    p, square, n = 1 << 31, 1 << 30, nbytes * 8  # x^0; x^1
    while n:
        if n & 1:
            p = _multmodp(square, p)
        square = _multmodp(square, square)
        n >>= 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = CRC(A), crc2 = CRC(B) and len(B) (zlib's crc32_combine)."""
    return _multmodp(_shift(len2), crc1) ^ crc2


def _executor(workers: int) -> ThreadPoolExecutor:
    """One pool per thread count (the count is set once per job; never shut under a caller)."""
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="failslow-crc")
        return _pools[workers]


def crc32(data: memoryview | bytes | bytearray, crc: int = 0, *, chunk: int | None = None) -> int:
    """``zlib.crc32(data, crc)``, on :func:`threads` threads when ``data`` spans two chunks
    (of :data:`CHUNK` bytes unless ``chunk`` says otherwise)."""
    view = memoryview(data).cast("B")
    workers = threads()
    chunk = chunk or CHUNK
    n = len(view)
    if workers == 1 or n < 2 * chunk:
        return zlib.crc32(view, crc)
    bounds = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    parts = list(_executor(workers).map(lambda b: zlib.crc32(view[b[0] : b[1]]), bounds))
    for (lo, hi), part in zip(bounds, parts, strict=True):
        crc = combine(crc, part, hi - lo)
    return crc
