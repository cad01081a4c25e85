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
