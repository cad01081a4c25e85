"""failslow: find and outlast fail-slow GPUs, CPUs and links in hybrid-parallel training.

Public API only; see ``failslow.core`` for the framework-agnostic pieces.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
