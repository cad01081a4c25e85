"""``failslow demo`` options that fail before anything starts: one line naming what is wrong."""

from __future__ import annotations

import pytest

from failslow.demo.mitigation import MitigationDemoOptions
from failslow.errors import FailslowError


def test_the_link_fault_needs_root_and_says_so(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(FailslowError) as info:
        MitigationDemoOptions(framework="megatron", fault="link").validate()
    assert "needs root" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"framework": "deepspeed", "fault": "link"}, "--fault link needs --framework megatron"),
        ({"framework": "megatron", "fault": "disk"}, "--fault must be compute or link"),
    ],
)
def test_bad_fault_options_are_one_line(options, message):
    with pytest.raises(FailslowError) as info:
        MitigationDemoOptions(**options).validate()
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "S1"], "--strategies takes S2, S3, S4"),
        (["--framework", "megatron", "--strategies", "S4"], "shown alone on the DeepSpeed job"),
        (["--framework", "deepspeed", "--strategies", "S2,S4"], "shown alone"),
        (["--framework", "deepspeed", "--fault", "kill", "--strategies", "S4"], "shown alone"),
        (["--framework", "deepspeed", "--strategies", "S4", "--iterations", "50"], "do not apply"),
        (["--framework", "torch", "--strategies", "S2"], "needs a demo with mitigation"),
        (["--framework", "deepspeed", "--no-standby"], "--no-standby goes with --fault kill"),
    ],
)
def test_bad_strategies_are_one_line_before_anything_starts(argv, message, capsys):
    from failslow.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    text = str(info.value.code)
    assert message in text and "\n" not in text


def test_s4_demo_options_are_checked_in_one_line():
    from failslow.demo.s4 import S4DemoOptions

    for options, message in [
        ({"standbys": 0}, "needs a standby slot"),
        ({"slow_rank": 4}, "0 <= --slow-rank < world size"),
        ({"stopped_fraction": 1.0}, "--stopped-fraction must be in (0, 1)"),
    ]:
        with pytest.raises(FailslowError) as info:
            S4DemoOptions(**options).validate()
        assert message in str(info.value) and "\n" not in str(info.value)
