"""The pause trap: stop a rank at its next collective call, and let it go again.

greyhound 4.3 validates suspects while "training is paused at the next iteration boundary":
the Validator runs GEMM and link tests on an otherwise idle job, then resumes it. The capture
layer is where a rank can be held without any framework's cooperation, so the trap lives
there, in both capture paths with one meaning (the C shim parks NCCL callers, this module parks
the Python hook's callers):

* The controller sets the ring header's ``control`` word (nonzero = pause) with
  :func:`request_pause`. Each request writes a fresh nonzero token.
* At the entry of its next recorded call, a rank thread that sees a nonzero ``control`` sets
  ``parked`` to ``write_index + 1`` and sleep-polls (``POLL_S``) until ``control`` is 0
  (:func:`release`), then clears ``parked`` and runs the call. The park happens before the
  call's ``t_start``, so paused time never counts as communication time.
* Training must never stay parked because a controller died: after
  ``$FAILSLOW_PAUSE_TIMEOUT_S`` seconds (default 60) the thread releases itself, adds one to
  ``self_releases``, logs one warning and ignores that token until the word changes (to 0,
  or to the new token of another :func:`request_pause`), so a dead controller costs one
  timeout, not one per call. The rank never writes ``control``: that word belongs to the
  controller. The C shim's trap (``native/writer.c``) behaves the same way.

A pause lands at each rank's *next* call. Ranks that already entered a collective when the
request arrived wait inside it for their parked peers, so the job is quiescent either way, but
only the ranks that reached a call boundary report ``parked``; a controller that wants every
rank parked requests the pause while the ranks stand between collectives (at an iteration
boundary, as the Validator does).

The controller side maps only the 256-byte header of a ring and reads or writes whole
aligned 8-byte words, the same access the C shim makes.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.core.ring import (
    HEADER_SIZE,
    HEADER_WORDS,
    RING_MAGIC,
    RingFormatError,
    RingWriter,
    header_words,
)

log = logging.getLogger(__name__)

DEFAULT_PAUSE_TIMEOUT_S = 60.0
POLL_S = 0.0005  # sleep between polls of the control word while parked


# -- controller side ------------------------------------------------------------------------------
class _Header:
    """A read-write map of one ring's header (nothing else of the file)."""

    def __init__(self, ring: str | os.PathLike[str]) -> None:
        self.path = Path(ring)
        fd = os.open(self.path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < HEADER_SIZE:
                raise RingFormatError(f"{self.path}: too small for a ring header")
            self._mm = mmap.mmap(fd, HEADER_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._words: Any = None
        if self.get("magic") != RING_MAGIC:
            self.close()
            raise RingFormatError(f"{self.path}: not a failslow ring (bad magic)")

    def get(self, name: str) -> int:
        return int(header_words(self)[HEADER_WORDS[name]])

    def set(self, name: str, value: int) -> None:
        header_words(self)[HEADER_WORDS[name]] = value

    def close(self) -> None:
        if self._words is not None:
            self._words.release()
            self._words = None
        self._mm.close()


@contextmanager
def _header(ring: str | os.PathLike[str]) -> Iterator[_Header]:
    h = _Header(ring)
    try:
        yield h
    finally:
        h.close()


def request_pause(ring: str | os.PathLike[str], *, group_key: int = 0, call_index: int = 0) -> int:
    """Ask the ring's process to park; returns the token written.

    Without ``group_key`` it parks at its next collective call. With it, only at the call of
    that group whose call_index is ``>= call_index`` - every member of the group parks at the
    same collective when the controller picks an index none of them has reached.
    """
    with _header(ring) as h:
        h.set("pause_group", group_key)
        h.set("pause_call", call_index)
        token = max(time.time_ns(), h.get("control") + 1)
        h.set("control", token)  # last: the target is in place when a rank sees the request
        return token


def release(ring: str | os.PathLike[str]) -> None:
    """Let a paused process run again (a no-op when no pause is requested)."""
    with _header(ring) as h:
        h.set("control", 0)


def control(ring: str | os.PathLike[str]) -> int:
    """The control word: 0 = run, anything else is the token of a pending pause request."""
    with _header(ring) as h:
        return h.get("control")


def parked(ring: str | os.PathLike[str]) -> int:
    """The parked word: ``write_index + 1`` at the park while a thread is parked, else 0."""
    with _header(ring) as h:
        return h.get("parked")


def self_releases(ring: str | os.PathLike[str]) -> int:
    """How many parks of this ring ended by the trap's timeout rather than by a release."""
    with _header(ring) as h:
        return h.get("self_releases")


def wait_parked(ring: str | os.PathLike[str], timeout_s: float, poll_s: float = 0.001) -> bool:
    """Wait until a thread of the ring's process is parked; False when ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    with _header(ring) as h:
        while True:
            if h.get("parked"):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


# -- rank side ------------------------------------------------------------------------------------
def pause_timeout_s() -> float:
    """``$FAILSLOW_PAUSE_TIMEOUT_S`` as seconds (the default when unset or not a number > 0)."""
    text = os.environ.get(envvars.PAUSE_TIMEOUT_S, "").strip()
    if not text:
        return DEFAULT_PAUSE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        log.warning(
            "failslow: $%s=%r is not a number of seconds > 0; using %s",
            envvars.PAUSE_TIMEOUT_S,
            text,
            DEFAULT_PAUSE_TIMEOUT_S,
        )
        return DEFAULT_PAUSE_TIMEOUT_S
    return value


class Trap:
    """The rank-side trap over one ring writer (one per process, shared by its threads).

    :meth:`check` runs at the entry of every recorded call: one header load while no pause
    is requested.
    """

    def __init__(self, writer: RingWriter) -> None:
        self.writer = writer
        self._lock = threading.Lock()
        self._parked_threads = 0
        self._ignored_token = 0  # the token this process timed out on
        self.on_parked: Any = None
        """Called repeatedly in the parked thread (the rank's agent runs validation there and
        releases the pause by clearing ``control``); its exceptions never leave the trap."""

    def requested(self) -> bool:
        """One header load: is any pause requested? (the hot path while none is)."""
        if self.writer.header_word("control"):
            return True
        if self._ignored_token:
            self._ignored_token = 0  # the word changed: a later request parks again
        return False

    def check(self, group_key: int = 0, call_index: int = 0) -> bool:
        """Park the calling thread while a pause is requested for this call; True if held.

        ``group_key``/``call_index``: the group of the call about to start and the call_index
        it will get; a targeted request (``pause_group`` set) parks only at its own call.
        """
        token = self.writer.header_word("control")
        if token == 0:
            if self._ignored_token:
                self._ignored_token = 0  # the word changed: a later request parks again
            return False
        if token == self._ignored_token:
            return False
        target = self.writer.header_word("pause_group")
        if target and (group_key != target or call_index < self.writer.header_word("pause_call")):
            return False
        self._park()
        return True

    def park(self) -> None:
        """Park the calling thread now, until the request is released (or the trap's timeout):
        the step-boundary pause, between two training steps rather than before a collective."""
        if self.writer.header_word("control"):
            self._park()

    def _park(self) -> None:
        writer = self.writer
        timeout_s = pause_timeout_s()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._parked_threads += 1
            if self._parked_threads == 1:
                writer.set_header_word("parked", writer.header_word("write_index") + 1)
        try:
            while True:
                time.sleep(POLL_S)
                callback = self.on_parked
                if callback is not None:
                    try:
                        callback()
                    except Exception:
                        log.warning("failslow: work while parked failed", exc_info=True)
                now_token = writer.header_word("control")
                if now_token == 0 or now_token == self._ignored_token:
                    return
                if time.monotonic() >= deadline:
                    self._self_release(now_token, timeout_s)
                    return
        finally:
            with self._lock:
                self._parked_threads -= 1
                if self._parked_threads == 0 and not writer._mm.closed:
                    writer.set_header_word("parked", 0)

    def _self_release(self, token: int, timeout_s: float) -> None:
        writer = self.writer
        with self._lock:
            first = self._ignored_token != token
            self._ignored_token = token
            writer.set_header_word("self_releases", writer.header_word("self_releases") + 1)
        if first:
            log.warning(
                "failslow: paused for %.1f s without a release (%s); resuming on my own - "
                "is the controller gone?",
                timeout_s,
                writer.path,
            )
