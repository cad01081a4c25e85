"""``failslow run --controller``'s slow threshold: ``--threshold`` when given, else the job's
config (``FAILSLOW__DETECTION__THRESHOLD``) - the flag's default used to override the config
with 1.1, so a job configured for 2.0 (CPU ranks on shared cores) ran at 1.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from failslow.node.launcher import Launch, RunOptions, _job_control


@pytest.mark.parametrize(
    ("flag", "env", "want"), [(None, "2.0", 2.0), (1.5, "2.0", 1.5), (None, None, 1.1)]
)
def test_the_controllers_threshold_is_the_flag_else_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: float | None, env: str | None,
    want: float,
) -> None:  # fmt: skip
    if env is None:
        monkeypatch.delenv("FAILSLOW__DETECTION__THRESHOLD", raising=False)
    else:
        monkeypatch.setenv("FAILSLOW__DETECTION__THRESHOLD", env)
    options = RunOptions(command=["true"], controller_world_size=2, threshold=flag)
    launch = Launch(argv=["true"], env={}, ring_dir=tmp_path, shim=None)
    control = _job_control(options, launch)
    try:
        assert control.controller.detection.threshold == want
    finally:
        control.store.close()
