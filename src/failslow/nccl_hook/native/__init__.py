"""The LD_PRELOAD NCCL capture shim (greyhound 4.2, 6): where it is and what it hooks.

The shim (``shim.c`` and friends in this folder) is plain C built by the package's own build
(``setup.py``) into ``libfailslow_nccl.so`` beside this file. It writes the ring of
:mod:`failslow.core.events` for every hooked NCCL call, publishes communicator membership as
:class:`~failslow.core.group_files.GroupMember` lines, and honours the ring's pause trap. Besides
the ``nccl*`` hooks it exports two C functions for diagnostics:

- ``const char *failslow_shim_version(void)``
- ``int failslow_shim_resolve(const char *nccl_path, char *out, size_t out_len)``: resolves
  every hooked symbol in ``nccl_path`` (NULL: ``$FAILSLOW_NCCL_LIB`` or ``libnccl.so.2``) the
  way the hooks do and writes ``name\\tpnccl|nccl|missing`` lines; returns how many resolved,
  or -1 after an ``error\\t<reason>`` line when the library cannot be opened.

Environment read by the shim: ``FAILSLOW_RING_DIR`` (recording off when unset),
``FAILSLOW_RING_CAPACITY``, ``FAILSLOW_PAUSE_TIMEOUT_S`` (default 60), ``FAILSLOW_NCCL_LIB``,
``FAILSLOW_DEVICE_TIMING``/``FAILSLOW_CUDART_LIB``, and RANK/LOCAL_RANK (or the OpenMPI and
Slurm equivalents).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from failslow.errors import FailslowError

LIBRARY_NAME = "libfailslow_nccl.so"

HOOKED_SYMBOLS: tuple[str, ...] = (
    "ncclAllReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclBroadcast",
    "ncclBcast",
    "ncclReduce",
    "ncclAlltoAll",
    "ncclGather",
    "ncclScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclCommInitRank",
    "ncclCommInitRankConfig",
    "ncclCommInitAll",
    "ncclCommSplit",
    "ncclCommDestroy",
    "ncclCommAbort",
)
"""Public NCCL entry points the shim hooks, in the order ``failslow_shim_resolve`` lists them."""

OPTIONAL_SYMBOLS: frozenset[str] = frozenset(
    {"ncclAlltoAll", "ncclGather", "ncclScatter", "ncclCommInitRankConfig", "ncclCommSplit"}
)
"""Hooked names that only newer NCCL releases export; their absence is not a fault."""


def shim_path() -> Path:
    """Path of the built shim library; :class:`FailslowError` when it was not built."""
    path = Path(str(resources.files(__package__) / LIBRARY_NAME))
    if not path.is_file():
        raise FailslowError(
            f"the failslow NCCL shim is not built ({path} is missing; FAILSLOW_SKIP_NATIVE may "
            "have been set at install): reinstall with gcc on PATH, e.g. `pip install -e .`"
        )
    return path


def native_available() -> bool:
    """Whether the shim library was built and installed."""
    try:
        shim_path()
    except FailslowError:
        return False
    return True


__all__ = ["HOOKED_SYMBOLS", "LIBRARY_NAME", "OPTIONAL_SYMBOLS", "native_available", "shim_path"]
