"""The threaded CRC-32 of snapshots (failslow.core.checkpoint.crc32): the same value as zlib's,
whatever the chunking, the thread count and the starting CRC."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from failslow.core.checkpoint import blob, crc32


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 5, 100_003])
def test_equals_zlib_at_every_chunk_boundary(monkeypatch, threads, size):
    monkeypatch.setenv("FAILSLOW_CHECKSUM_THREADS", threads)
    data = os.urandom(size)
    for start in (0, 0x1234ABCD):
        assert crc32.crc32(data, start, chunk=4096) == zlib.crc32(data, start)


def test_combine_is_zlibs_crc32_combine():
    data = os.urandom(10_000)
    for cut in (0, 1, 63, 5_000, 9_999, 10_000):
        left, right = zlib.crc32(data[:cut]), zlib.crc32(data[cut:])
        assert crc32.combine(left, right, len(data) - cut) == zlib.crc32(data)


def test_a_sealed_snapshot_verifies_with_any_thread_count(monkeypatch):
    state = {"w": np.arange(300_000, dtype=np.float64), "step": 3}
    layout = blob.plan(state)
    buf = memoryview(bytearray(layout.total_bytes))
    blob.write_payload(buf, layout, 3)
    monkeypatch.setattr(crc32, "CHUNK", 4096)
    monkeypatch.setenv("FAILSLOW_CHECKSUM_THREADS", "4")
    blob.seal(buf)
    monkeypatch.setenv("FAILSLOW_CHECKSUM_THREADS", "1")
    assert blob.verify(buf) == 3


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_thread_count_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("FAILSLOW_CHECKSUM_THREADS", value)
    with pytest.raises(ValueError, match="FAILSLOW_CHECKSUM_THREADS") as info:
        crc32.crc32(b"x" * 10, chunk=1)
    assert "\n" not in str(info.value)
