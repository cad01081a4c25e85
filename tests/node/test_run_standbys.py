"""``failslow run --controller N --nproc-per-node N --standbys S`` tells the job's planner how
many hosts a restart can replace: ``failslow/standbys/<node>`` in the control store, written at
every launch (issue 16: S4 evicts no more hosts than the free standby slots replace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

RANK = textwrap.dedent(
    """
    import json, os, sys, time
    from failslow.core.control import keys
    from failslow.core.control.store import open_store

    with open_store(os.environ["FAILSLOW_STORE"]) as store:
        deadline = time.monotonic() + 30
        while not (names := store.keys(keys.STANDBYS + "/")) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = {name: store.get_json(name) for name in names}
    with open(sys.argv[1] + f"-{os.environ['RANK']}.json", "w") as f:
        json.dump({"seen": seen, "host": os.environ.get("FAILSLOW_HOST")}, f)
    """
)


def test_the_rank_launcher_publishes_its_free_standby_slots(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW")}
    argv = [
        sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--no-python-hook",
        "--controller", "2", "--ring-dir", str(tmp_path / "rings"),
        "--nproc-per-node", "2", "--standbys", "3", "--no-warm",
        "--", str(script), str(tmp_path / "seen"),
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"seen-{rank}.json").read_text())
        (value,) = record["seen"].values()
        assert value["free"] == 3 and value["slots"] == [2, 3, 4], record
