"""Enable the Python collective hook from the environment (greyhound 4.2, transparency R1).

Importing this module installs :func:`failslow.nccl_hook.install` when ``$FAILSLOW_CAPTURE`` is
``1`` and ``$FAILSLOW_RING_DIR`` is set, so a launcher can turn capture on without code changes
(``import failslow.nccl_hook.auto`` from a ``sitecustomize``). ``python -m
failslow.nccl_hook.auto script.py args...`` installs the same way and then runs the script.
"""

from __future__ import annotations

import os
import runpy
import sys

from failslow import envvars
from failslow.nccl_hook.capture import Capture, install


def autoinstall() -> Capture | None:
    """Install the hook if the environment asks for it; returns the capture or None."""
    if os.environ.get(envvars.CAPTURE) == "1" and os.environ.get(envvars.RING_DIR):
        return install()
    return None


capture = autoinstall()

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m failslow.nccl_hook.auto script.py [args...]")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
