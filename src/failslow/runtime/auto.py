"""Start the rank runtime from the environment, for scripts that never call failslow themselves.

greyhound 4.2 asks for transparency (R1): no change to the training code. ``failslow run``
puts a ``sitecustomize`` first on ``PYTHONPATH`` that imports this module right after torch; it

- installs the collective hook when ``$FAILSLOW_CAPTURE`` is ``1`` and ``$FAILSLOW_RING_DIR``
  is set (:mod:`failslow.nccl_hook.auto`), and
- with ``$FAILSLOW_STORE`` set, attaches the rank's control agent once the ring exists (the
  default process group is up): the rank can then be paused for validation
  (:mod:`failslow.runtime.rank_control`);
- registers the runtime's exit handler (:mod:`failslow.runtime.teardown`): failslow's threads
  stop and the default process group is destroyed before interpreter teardown, so a job that
  finished is not reported failed.

``python -m failslow.runtime.auto script.py args...`` does the same, then runs the script.
"""

from __future__ import annotations

import runpy
import sys

from failslow.nccl_hook.auto import autoinstall
from failslow.runtime import rank_control, teardown

capture = autoinstall()
if capture is not None:
    teardown.install()
    capture.on_ring(rank_control.attach_from_environment)

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m failslow.runtime.auto script.py [args...]")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
