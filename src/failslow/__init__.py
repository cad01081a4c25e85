"""failslow: find and outlast fail-slow GPUs, CPUs and links in hybrid-parallel training.

Public API only; see ``failslow.core`` for the framework-agnostic pieces. ``hookimpl`` marks
plugin hook implementations (``@failslow.hookimpl def failslow_on_diagnosis(diagnosis): ...``);
the specs are in :mod:`failslow.hookspecs`.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("failslow")

__all__ = ["__version__", "hookimpl"]
