"""The stop-time checks' verdict (byterobust 4.2 "Diagnose", 4.3): failslow.core.diagnosis.
stop_checks.judge. The processes that produce the results are in
tests/node/test_stop_check_runner.py."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.stop_checks import DEVICE_TOLERANCE, judge

GOOD = "ab" * 32


def _result(rank: int, n: int, *, digest: str = GOOD, error: float = 4e-7,
            link: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    link = link or {"from": (rank - 1) % n, "ok": True, "why": "", "seconds": 0.002}
    return {"device": {"rel_error": error, "seconds": 0.01}, "digest": digest, "link": link}


def _world(n: int, **per_rank: dict[str, Any]) -> dict[int, Any]:
    return {r: _result(r, n, **per_rank.get(f"r{r}", {})) for r in range(n)}


def test_healthy_machines_pass_and_the_table_says_so() -> None:
    verdict = judge(_world(4), 4)
    assert verdict.suspects == [] and "every machine passed" in verdict.why
    assert [row["verdict"] for row in verdict.table] == ["pass"] * 4
    assert verdict.table[0]["digest"] == GOOD[:12] and verdict.table[0]["link"] == "ok"


def test_the_minority_digest_is_named_against_the_majority() -> None:
    verdict = judge(_world(4, r2={"digest": "cd" * 32}), 4)
    assert verdict.suspects == [2]
    assert "machine 2 computes the reference step differently" in verdict.why
    assert "of 3 of 4 machines" in verdict.why


def test_no_strict_majority_names_nobody_by_alignment() -> None:
    """2 against 2: no telling which half is right (the tests do not guess)."""
    verdict = judge(_world(4, r2={"digest": "cd" * 32}, r3={"digest": "cd" * 32}), 4)
    assert verdict.suspects == [] and "no majority" in verdict.why


def test_a_wrong_or_nan_gemm_names_the_device() -> None:
    verdict = judge(_world(3, r0={"error": 0.3}, r1={"error": math.nan}), 3)
    assert verdict.suspects == [0, 1]
    assert "GEMM is off by 0.3" in verdict.why and "off by nan" in verdict.why
    assert judge(_world(3, r0={"error": DEVICE_TOLERANCE}), 3).suspects == []


def test_a_machine_that_reported_nothing_is_named_unless_nobody_reported() -> None:
    results = _world(3)
    results[1] = None
    verdict = judge(results, 3)
    assert verdict.suspects == [1] and "reported nothing" in verdict.why
    assert verdict.table[1]["digest"] is None
    nobody = judge({}, 3)
    assert nobody.suspects == [] and "did not run" in nobody.why
    assert [row["verdict"] for row in nobody.table] == ["reported nothing"] * 3  # a row each


def test_the_machine_on_every_bad_link_is_named_else_both_ends() -> None:
    bad = {"ok": False, "why": "12 of 262144 words corrupted"}
    # machine 1 sends corrupt data to 2 and receives corrupt data from 0: both its links
    verdict = judge(_world(4, r1={"link": {"from": 0, **bad}}, r2={"link": {"from": 1, **bad}}), 4)
    assert verdict.suspects == [1] and "bad link 0 -> 1" in verdict.why
    one = judge(_world(4, r3={"link": {"from": 2, **bad}}), 4)
    assert one.suspects == [2, 3]  # one bad link: no telling which end
    assert one.table[3]["link"] == "12 of 262144 words corrupted"


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 64),
    wrong=st.sets(st.integers(0, 63)),
    silent=st.sets(st.integers(0, 63)),
)
def test_property_suspects_are_the_wrong_digests_and_the_silent_when_a_majority_agrees(
    n: int, wrong: set[int], silent: set[int]
) -> None:
    wrong, silent = {r for r in wrong if r < n}, {r for r in silent if r < n} - wrong
    results: dict[int, Any] = {
        r: None if r in silent else _result(r, n, digest=f"{r:064x}" if r in wrong else GOOD,
                                            link={"from": (r - 1) % n, "ok": True})
        for r in range(n)
    }  # fmt: skip
    verdict = judge(results, n)
    reporting = n - len(silent)
    agree = reporting - len(wrong)
    if reporting == 0:
        assert verdict.suspects == []
    elif agree * 2 > reporting:
        assert verdict.suspects == sorted(wrong | silent)
    else:
        assert set(verdict.suspects) == silent  # no majority digest: alignment names nobody
    assert len(verdict.table) == n
