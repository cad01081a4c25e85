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
def _load() -> tuple[Callable[..., None] | None, str, str]:
    """The kernel (or None), and the level and words ``failslow doctor`` reports it with."""
    path = library_path()
    if not path.is_file():
        why = f"{LIBRARY_NAME} was not built (installed with FAILSLOW_SKIP_NATIVE=1?)"
        return None, "info", f"the BOCD update runs in numpy: {why}; same results, slower"
    try:
        fn = ctypes.CDLL(str(path)).failslow_bocd_update
    except (OSError, AttributeError) as e:  # a broken or foreign file: numpy, and say so
        return None, "warn", f"the BOCD update runs in numpy: {path} does not load ({e})"
    fn.restype = None
    fn.argtypes = [
        ctypes.c_int,  # n
        ctypes.c_double,  # y
        ctypes.c_int,  # first
        ctypes.c_double,  # hazard
        ctypes.c_double,  # beta0
        *[ctypes.c_void_p] * 10,  # log_c half_nu1 inv_nu_sf step shrink mu beta w out lik
    ]
    return fn, "ok", f"the BOCD update runs in C ({path})"


def bocd_update() -> Callable[..., None] | None:
    """``failslow_bocd_update`` of the built library, or None when it was not built or does
    not load (then the numpy update runs; :func:`status` says why)."""
    return _load()[0]


def status() -> tuple[str, str]:
    """``(level, message)`` for ``failslow doctor``: ``ok`` when the C kernel runs, ``info``
    when it was not built, ``warn`` when it was built but does not load."""
    _, level, message = _load()
    return level, message


__all__ = ["LIBRARY_NAME", "bocd_update", "library_path", "status"]
