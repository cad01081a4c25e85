"""Dual-phase replay on the node's ranks (failslow.node.replay, LocalRanks.spawn_replay).

Real processes from the launcher's warm pool, a small script for a rank: it checks what a
replay group's rank is given - its group as a world of its own, the old world's memory to read
every old rank's state from, the step to replay, no control store - and reports, as
``failslow.report_metrics`` does in a replay, that the incident came back when its slot is one
of ``BAD_SLOTS`` (a machine that corrupts its steps). The DeepSpeed job replaying for real is
in tests/e2e/test_failstop.py."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from failslow.node import replay
from failslow.node.ranks import LocalRanks, RankOptions

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from failslow.core.control.stop import REPLAYS, write_rank_result

    spec = os.environ.get("FAILSLOW_REPLAY")
    if spec is None:
        sys.exit(0)  # the job's own launch
    spec = json.loads(spec)
    [source] = json.loads(os.environ["FAILSLOW_RESHARD_FROM"])
    assert "FAILSLOW_STORE" not in os.environ
    assert int(os.environ["WORLD_SIZE"]) == 2 and source["before"] == spec["until"] == 12
    assert sorted(source["readable"]) == ["0", "1", "2", "3"]  # every old rank's memory
    assert source["directory"] == source["readable"][str(source["rank"])]
    assert os.environ["FAILSLOW_SNAPSHOT_DIR"].startswith(os.environ["REPLAY_BASE"])
    rings = os.environ["FAILSLOW_RING_DIR"]  # its own, below the job's
    assert rings == os.path.join(os.environ["JOB_RINGS"], "replay-" + spec["name"])
    assert os.path.isdir(rings)
    slot = int(os.environ["FAILSLOW_SLOT"])
    roles = json.loads(os.environ.get("ROLES", "{}")).get(spec["name"], {})
    assert source["rank"] == roles.get(str(slot), slot), (spec["name"], slot, source)
    if slot in json.loads(os.environ.get("CRASH_SLOTS", "[]")):
        sys.exit(1)
    bad = slot in json.loads(os.environ["BAD_SLOTS"])
    write_rank_result(os.environ["FAILSLOW_STATE_DIR"], REPLAYS, spec["name"],
                        int(os.environ["RANK"]), {"step": 12, "reproduced": bad})
    """
)


def _replay(
    tmp_path: Path, bad: list[int], crash: list[int] = (), pipelines: bool = False
) -> replay.ReplayOutcome:
    ranks = LocalRanks(
        RankOptions(nproc=4, standbys=1, preload=("colorsys",), refill_delay_s=0.0,
                    slots_as_hosts=True),
        say=lambda _: None,
    )  # fmt: skip
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    state = tmp_path / "state"
    base = tmp_path / "snapshots"
    env = {
        **os.environ, "FAILSLOW_STATE_DIR": str(state), "FAILSLOW_SNAPSHOT_DIR": str(base),
        "FAILSLOW_STORE": "tcp://127.0.0.1:1", "BAD_SLOTS": json.dumps(bad),
        "CRASH_SLOTS": json.dumps(list(crash)), "REPLAY_BASE": str(base / "replay-"),
        "FAILSLOW_RING_DIR": str(tmp_path / "rings"), "JOB_RINGS": str(tmp_path / "rings"),
        # on the PP2 x DP2 grid, the place each slot's rank takes in a re-formed pipeline
        "ROLES": json.dumps({"v0": {"1": 3}, "v1": {"2": 0}} if pipelines else {}),
    }  # fmt: skip
    try:
        assert ranks.spawn([str(script)], env, str(tmp_path)).wait(timeout=60) == 0
        if pipelines:  # the ranks noted a PP2 x DP2 grid with their snapshots
            from failslow.core.checkpoint.layout_notes import write_note
            from failslow.core.topology import Topology

            grid = Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=1, micro_batches=4)
            for rank in range(4):
                (base / f"slot{rank}").mkdir(parents=True, exist_ok=True)
                write_note(base / f"slot{rank}", rank, grid, None)
        outcome = replay.run(ranks, [str(script)], env, str(tmp_path), until=12,
                             incident={"metric": "grad_norm", "level": 0.03}, state_dir=state,
                             timeout_s=60)  # fmt: skip
    finally:
        ranks.close()
    assert not list(base.glob("replay-*")), "a replay group's snapshots outlived it"
    return outcome


@pytest.mark.parametrize("bad", [1, 2])
def test_the_two_phases_name_the_one_bad_machine(tmp_path: Path, bad: int) -> None:
    outcome = _replay(tmp_path, [bad])
    assert outcome.suspects == [bad], outcome.why
    verdicts = [[g["reproduced"] for g in p["groups"]] for p in outcome.phases]
    assert verdicts == [[bad < 2, bad >= 2], [bad % 2 == 0, bad % 2 == 1]]


def test_a_replay_that_does_not_come_back_or_is_not_one_machine_names_nobody(
    tmp_path: Path,
) -> None:
    clean = _replay(tmp_path / "clean", [])
    assert clean.suspects == [] and "did not come back" in clean.why
    assert len(clean.phases) == 1  # the horizontal phase already names nobody
    two = _replay(tmp_path / "two", [0, 3])
    assert two.suspects == [] and "is not one machine's" in two.why


def test_a_group_that_does_not_finish_its_replay_counts_as_faulty(tmp_path: Path) -> None:
    outcome = _replay(tmp_path, [], crash=[3])
    assert outcome.suspects == [3], outcome.why
    group = outcome.phases[0]["groups"][1]
    assert (group["members"], group["finished"], group["status"]) == ([2, 3], False, 1)


@pytest.mark.parametrize("bad", [1, 2])
def test_a_pipeline_grid_is_replayed_on_whole_then_re_formed_pipelines(
    tmp_path: Path, bad: int
) -> None:
    """PP2 x DP2 in Megatron's order: ranks 0, 1 are stage 0 of replicas 0, 1 and ranks 2, 3
    stage 1, so the machines (replica, stage) are ranks 0, 2, 1, 3. Horizontally the groups
    are the job's pipelines, ranks {0, 2} and {1, 3}; vertically {0, 1}, where rank 1 takes
    stage 1 (rank 3's place: the script checks it is told so), and {2, 3}, where rank 2 takes
    stage 0 (rank 0's). Either way the bad machine is found, whatever stage it replayed."""
    outcome = _replay(tmp_path, [bad], pipelines=True)
    assert outcome.suspects == [bad], outcome.why
    assert "TP1 x PP2 grid" in outcome.why
    verdicts = [[(g["ranks"], g["reproduced"]) for g in p["groups"]] for p in outcome.phases]
    assert verdicts == [
        [([0, 2], bad == 2), ([1, 3], bad == 1)], [([0, 1], bad == 1), ([2, 3], bad == 2)],
    ]  # fmt: skip
