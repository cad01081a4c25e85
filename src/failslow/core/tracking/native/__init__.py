"""The tracking's native kernel: one BOCD update in C (``bocd.c``), loaded with ctypes.

A LocalAnalyzer poll spends most of its time in the detectors, and a detector update most of
its in :meth:`failslow.core.tracking.bocd.RunLengthPosterior.update`: ~25 numpy operations on
``max_run + 1`` (257) slots, each a microsecond of dispatch. ``bocd.c`` does the same
arithmetic in one pass per array (greyhound 4.2: the LocalAnalyzer's tracking must stay a
fraction of a percent of the ranks' CPU). It is plain C (no Python.h), built by the package's
own build (``setup.py``) into ``libfailslow_bocd.so`` beside this file; without it
(``FAILSLOW_SKIP_NATIVE=1`` at install) the numpy update runs, with the same results to the
last few ulps (the sums are added in another order).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from importlib import resources
from pathlib import Path

LIBRARY_NAME = "libfailslow_bocd.so"


def library_path() -> Path:
    return Path(str(resources.files(__package__) / LIBRARY_NAME))


@functools.cache
def bocd_update() -> Callable[..., None] | None:
    """``failslow_bocd_update`` of the built library, or None when it was not built."""
    path = library_path()
    if not path.is_file():
        return None
    fn = ctypes.CDLL(str(path)).failslow_bocd_update
    fn.restype = None
    fn.argtypes = [
        ctypes.c_int,  # n
        ctypes.c_double,  # y
        ctypes.c_int,  # first
        ctypes.c_double,  # hazard
        ctypes.c_double,  # beta0
        *[ctypes.c_void_p] * 10,  # log_c half_nu1 inv_nu_sf step shrink mu beta w out lik
    ]
    return fn  # type: ignore[no-any-return]


__all__ = ["LIBRARY_NAME", "bocd_update", "library_path"]
