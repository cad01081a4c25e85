"""Build and load the hook's per-call work in C++ (``native/hook.cpp``; greyhound 4.2).

The Python kernel of :mod:`failslow.nccl_hook.capture` costs a DDP rank's training thread about
0.3 ms per collective (``benchmarks/tracking_overhead.py --kernel python`` against ``native``):
boxing every call into Python and taking the GIL on the autograd thread and on the backend's
completion threads. ``native/hook.cpp`` does the same work in C++ and calls Python only for a
group it has not seen, a requested pause and a ring not open yet.

It is a torch C++ extension, so it is built against the torch that is installed (its C++ ABI
changes between versions), not when failslow is installed: ``failslow build-hook`` (run by
``./dev setup``) compiles it with torch's own ``cpp_extension`` into a cache directory keyed by
the torch version, the Python version and the source's hash. :func:`load` imports it from there
and never compiles, so a rank's start never waits for a compiler; without a build, the hook
runs its Python kernel and says so once. ``FAILSLOW_NATIVE_HOOK``: ``auto`` (default: the
native hook when it is built), ``0`` (always the Python kernel), ``1`` (the native hook, built
now if it is not; an error when it cannot be).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

from failslow import envvars

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "hook.cpp"
HEADERS = (Path(__file__).parent / "native" / "ring.h",)
NAME = "failslow_hook"

_loaded: ModuleType | None = None
_said = False


class NativeHookError(RuntimeError):
    """The native hook was asked for and cannot be built or loaded."""


def build_dir() -> Path:
    """Where this torch + Python + source combination is built (``$XDG_CACHE_HOME/failslow``)."""
    import torch

    digest = hashlib.sha256()
    for path in (SOURCE, *HEADERS):
        digest.update(path.read_bytes())
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "failslow" / "hook" / f"{tag}-{digest.hexdigest()[:12]}"


def built() -> Path | None:
    """The compiled module, if it is built for this torch and this source."""
    path = build_dir() / f"{NAME}.so"
    return path if path.is_file() else None


def build(verbose: bool = False) -> Path:
    """Compile the native hook (about 20-60 s); returns the module's path."""
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        load(
            name=NAME,
            sources=[str(SOURCE)],
            extra_cflags=["-O2", f"-I{SOURCE.parent}"],
            build_directory=str(directory),
            verbose=verbose,
        )
    except Exception as exc:
        raise NativeHookError(
            f"failslow: cannot build the native hook ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}); "
            f"the Python hook is used instead"
        ) from exc
    path = built()
    if path is None:
        raise NativeHookError(f"failslow: the native hook build left no {NAME}.so in {directory}")
    return path


def mode() -> str:
    """``auto``, ``0`` or ``1`` from ``$FAILSLOW_NATIVE_HOOK`` (a bad value is an error)."""
    value = os.environ.get(envvars.NATIVE_HOOK, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(
            f"${envvars.NATIVE_HOOK}={value!r}: expected auto, 0 (the Python kernel) or 1 "
            "(the native hook, built if needed)"
        )
    return value


def load() -> ModuleType | None:
    """The native hook module, or None when the Python kernel is to be used (see module doc)."""
    global _loaded, _said
    if _loaded is not None:
        return _loaded
    how = mode()
    if how == "0":
        return None
    path = built()
    if path is None:
        if how == "auto":
            if not _said:
                _said = True
                log.info(
                    "failslow: the native hook is not built for torch %s; using the Python "
                    "kernel (run `failslow build-hook` once)",
                    _torch_version(),
                )
            return None
        path = build()
    import torch  # noqa: F401  (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location(
        NAME, path, loader=importlib.machinery.ExtensionFileLoader(NAME, str(path))
    )
    if spec is None or spec.loader is None:
        raise NativeHookError(f"failslow: cannot load the native hook from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded = module
    return module


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
