"""Every environment variable failslow reads or sets, defined once (DESIGN.md, one definition).

The launcher (``failslow run``) sets most of them for the processes it starts; the capture
layer, the rank runtime and the node layer read them. The C shim reads four of them by the same
names (``native/*.c``; a test checks that every ``getenv("FAILSLOW_...")`` there is listed here).
"""

from __future__ import annotations

# -- capture (nccl_hook, C shim) -----------------------------------------------------------------
RING_DIR = "FAILSLOW_RING_DIR"
"""Where each process writes its event ring (set by ``failslow run``)."""
RING_CAPACITY = "FAILSLOW_RING_CAPACITY"
"""Records per ring, a power of two."""
CAPTURE = "FAILSLOW_CAPTURE"
"""``1``: install the Python hook in every Python process (with :data:`RING_DIR`)."""
PAUSE_TIMEOUT_S = "FAILSLOW_PAUSE_TIMEOUT_S"
"""A paused rank resumes on its own after this many seconds (the pause trap's timeout)."""
NCCL_LIB = "FAILSLOW_NCCL_LIB"
"""The libnccl the shim and ``failslow doctor`` use instead of the one torch would load."""
CUDART_LIB = "FAILSLOW_CUDART_LIB"
"""The libcudart the shim uses for device timing."""
DEVICE_TIMING = "FAILSLOW_DEVICE_TIMING"
"""The shim's device-side timing (CUDA events) on or off."""
CHECKSUM_THREADS = "FAILSLOW_CHECKSUM_THREADS"
"""Threads that compute a snapshot's CRC-32 (:mod:`failslow.core.checkpoint.crc32`; default
min(4, CPUs))."""
NATIVE_HOOK = "FAILSLOW_NATIVE_HOOK"
"""``auto`` (default): the hook's C++ kernel when it is built, else its Python kernel; ``0``:
always the Python kernel; ``1``: the C++ kernel, built at install if needed
(:mod:`failslow.nccl_hook.native_hook`)."""
SKIP_NATIVE = "FAILSLOW_SKIP_NATIVE"
"""``1`` at install time: build neither the C shim nor the detectors' BOCD kernel (which then
runs in numpy)."""

# -- the rank runtime ----------------------------------------------------------------------------
STORE = "FAILSLOW_STORE"
"""The job's control store URL; honoured as the ``store`` setting."""
SNAPSHOT_DIR = "FAILSLOW_SNAPSHOT_DIR"
"""Node-local directory of in-memory snapshots and peers' backups (set by ``failslow run``)."""
RESHARD_FROM = "FAILSLOW_RESHARD_FROM"
"""Set by ``failslow run --min-ranks`` while a job that goes on with fewer ranks has no complete
snapshot of its own: a JSON list of the larger worlds it may restore from, newest first, each
``{"directory", "rank"}`` - the node memory this rank kept from that world and the rank it was
there (null: none). Each world's size and backup placement are in its ``placement.json``."""
LAYOUT = "FAILSLOW_LAYOUT"
"""Set by ``failslow run --min-ranks`` for a job that goes on in a layout the launcher chose
(odyssey reroute or reconfigure, :mod:`failslow.core.planner.odyssey.rigid`): JSON
``{"tp", "pp", "dp", "choice", "estimated_s", "before_s", "alternatives"}``. The training script
builds its grid from it (``failslow.megatron.parallel_sizes``)."""
ROLLBACK_BEFORE = "FAILSLOW_ROLLBACK_BEFORE"
"""Set by ``failslow run`` for the launch after a rank's metrics went bad (a NaN loss; byterobust
4.1-4.2): every rank forgets its snapshots and the backups it holds of this step or later, and
resumes from the newest one before it."""
REPLAY = "FAILSLOW_REPLAY"
"""Set by ``failslow run`` for a replay group of the stop-time ladder (byterobust 4.2, dual-phase
replay): JSON ``{"name", "until", "level", "jump"}``. The group's ranks resume the job's
snapshot before ``until`` (``$FAILSLOW_RESHARD_FROM``), train to it, and at
``failslow.report_metrics(until, ...)`` write whether the incident came back and exit."""
STOP_CHECK = "FAILSLOW_STOP_CHECK"
"""Set by ``failslow run`` for the stop-time checks of the ladder's first rung (byterobust 4.2,
"Diagnose"; :mod:`failslow.runtime.stop_check`): JSON ``{"name", "incident", "timeout_s"}``."""
JOB_TOKEN = "FAILSLOW_JOB_TOKEN"
"""The job's shared secret: ranks act only on pause requests and plans that carry it."""
CONFIG_PREFIX = "FAILSLOW__"
"""``FAILSLOW__SECTION__KEY=value`` sets one setting (two underscores between levels)."""
HOST = "FAILSLOW_HOST"
"""The host name a rank reports in the job's topology (default: the hostname); set where one
machine stands for several (the CPU demo gives each rank its own), so topology plans can move
roles between them."""
DISABLE_PLUGIN_AUTOLOAD = "FAILSLOW_DISABLE_PLUGIN_AUTOLOAD"
"""Set: no third-party plugins from the ``failslow`` entry-point group."""
PLUGINS = "FAILSLOW_PLUGINS"
"""Comma-separated plugins every plugin manager registers after the entry points, each a module
or ``module:attribute`` (as ``PYTEST_PLUGINS``): a plugin for every process of a job - its
ranks, its stop-time checks - without packaging an entry point."""

# -- the node layer (launcher, hot update) -------------------------------------------------------
STATE_DIR = "FAILSLOW_STATE_DIR"
"""The job's update history (``failslow update --state-dir``)."""
CODE_DIR = "FAILSLOW_CODE_DIR"
"""The code directory of the version running now."""
CODE_VERSION = "FAILSLOW_CODE_VERSION"
"""The content hash of :data:`CODE_DIR`."""
UPDATE_ID = "FAILSLOW_UPDATE_ID"
"""The last update applied to this launch (0: none)."""
RESTART = "FAILSLOW_RESTART"
"""How many times the launcher relaunched the command before this launch."""

# -- the rank launcher (failslow run --nproc-per-node) --------------------------------------------
SLOT = "FAILSLOW_SLOT"
"""The launcher's slot (device) a rank runs on: 0..N-1 first, standbys N.. after an eviction."""
WARM_FD = "FAILSLOW_WARM_FD"
"""A warm process's socket to its launcher (:mod:`failslow.node.warm`)."""
WARM_PRELOAD = "FAILSLOW_WARM_PRELOAD"
"""The modules a warm process imports before it is given a rank (comma-separated)."""
WARM_FORK = "FAILSLOW_WARM_FORK"
"""``1``: the process is a fork server - it imports, then forks warm processes on request
(:mod:`failslow.node.fork_server`)."""
