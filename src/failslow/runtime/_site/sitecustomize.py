"""``failslow run``: turn the rank runtime on in every Python process of a command.

``failslow run --python-hook`` puts this directory first on ``PYTHONPATH``; Python imports the
first ``sitecustomize`` it finds at startup. This one arranges for
:mod:`failslow.runtime.auto` (the collective hook, and the rank's control agent when a control
store is set) to be imported right after the process finishes importing torch
(when ``$FAILSLOW_CAPTURE`` is ``1`` and ``$FAILSLOW_RING_DIR`` is set), so a process that
never imports torch pays nothing and never imports it; once it imports DeepSpeed, engines built
by the plain ``deepspeed.initialize`` from a config with a ``"failslow"`` block are checked
(:mod:`failslow.adapters.deepspeed.unattached`: one line when nothing attached failslow). Then
it runs the user's own ``sitecustomize`` (the next one on ``sys.path``), if any, as Python
would have.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install_hook() -> None:
    try:
        import failslow.runtime.auto  # noqa: F401  (starts from the environment)
    except Exception as exc:  # never break the user's process
        sys.stderr.write(f"failslow: Python hook not installed in pid {os.getpid()}: {exc!r}\n")


def _watch_deepspeed() -> None:
    try:
        from failslow.adapters.deepspeed.unattached import watch

        watch(sys.modules["deepspeed"])
    except Exception as exc:  # never break the user's process
        sys.stderr.write(f"failslow: DeepSpeed not watched in pid {os.getpid()}: {exc!r}\n")


class _LoadThenInstall:
    """Wraps a package's loader: runs it, puts it back on the module, then calls ``then``."""

    def __init__(self, loader: Any, then: Any) -> None:
        self._loader = loader
        self._then = then

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._then()


class _AfterImport:
    """A meta-path finder that only wraps the loader of one top-level package."""

    def __init__(self, name: str, then: Any) -> None:
        self._name = name
        self._then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self._name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoadThenInstall(spec.loader, self._then)
        return spec


def _after_import(name: str, then: Any) -> None:
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _chain_user_sitecustomize() -> None:
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("FAILSLOW_CAPTURE") == "1" and os.environ.get("FAILSLOW_RING_DIR"):
    _after_import("torch", _install_hook)
    _after_import("deepspeed", _watch_deepspeed)
_chain_user_sitecustomize()
