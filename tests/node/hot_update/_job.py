"""A stand-in for a training job under ``failslow run``: it trains nothing but behaves like ranks.

Each rank counts steps (20 ms each). With ``FAILSLOW_STORE`` set it runs the real plan channel
(:class:`PlanReceiver`): on a ``StopForUpdate`` it writes its step to ``FAILSLOW_SNAPSHOT_DIR``
and exits 75 at the agreed boundary; a restarted rank resumes from that step. Control files in
``JOB_CTL``: ``crash`` (consumed) makes rank 0 exit 1, ``done`` makes every rank exit 0, ``nan``
(consumed; its text is a step) makes rank 0 report a NaN loss at that step as
``failslow.report_metrics`` does under ``failslow run`` (a rollback request, exit 79).
Every start and stop is a JSON line in ``JOB_LOG``. ``JOB_WORLD`` > 1 spawns that many ranks
and exits as torchrun would (1 if any rank failed), except 75 when all stopped for an update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

STEP_S = 0.02


def log(**record: object) -> None:
    record.update(pid=os.getpid(), t=time.time())
    with open(os.environ["JOB_LOG"], "a") as fh:
        fh.write(json.dumps(record) + "\n")


def code_version() -> str | None:
    code_dir = os.environ.get("FAILSLOW_CODE_DIR")
    version = Path(code_dir, "VERSION") if code_dir else None
    return version.read_text().strip() if version and version.is_file() else None


def rank_main(rank: int) -> int:
    snapshot_dir = Path(os.environ["FAILSLOW_SNAPSHOT_DIR"])
    snapshot = snapshot_dir / f"rank{rank}.json"
    step = json.loads(snapshot.read_text())["step"] if snapshot.is_file() else 0
    ctl = Path(os.environ["JOB_CTL"])
    log(
        event="start",
        rank=rank,
        step=step,
        version=os.environ.get("JOB_VERSION"),
        code=code_version(),
        update_id=os.environ.get("FAILSLOW_UPDATE_ID"),
        restart=os.environ.get("FAILSLOW_RESTART"),
        rollback_before=os.environ.get("FAILSLOW_ROLLBACK_BEFORE"),
        cwd=os.getcwd(),
    )
    receiver = None
    if os.environ.get("FAILSLOW_STORE"):
        from failslow.core.control.plan_channel import PlanReceiver
        from failslow.core.control.stop import StopForUpdate
        from failslow.core.control.store import open_store

        def prepare(plan: object) -> None:
            if not isinstance(plan, StopForUpdate):
                raise ValueError(f"cannot apply {type(plan).__name__}")

        store = open_store(os.environ["FAILSLOW_STORE"])
        receiver = PlanReceiver(
            store, rank=rank, prepare=prepare, step=lambda: step, poll_s=0.05
        ).start()
    log(event="ready", rank=rank, step=step)
    while True:
        if receiver is not None:
            plan = receiver.due(step)
            if plan is not None:
                snapshot_dir.mkdir(parents=True, exist_ok=True)
                snapshot.write_text(json.dumps({"step": step}))
                log(event="stop", rank=rank, step=step, update_id=plan.update_id)
                return 75
        if (ctl / "done").exists():
            log(event="done", rank=rank, step=step)
            return 0
        if rank == 0 and (ctl / "nan").exists():
            from failslow.core.control.stop import EXIT_ROLLBACK, request_rollback

            bad = int((ctl / "nan").read_text())
            (ctl / "nan").unlink()
            why = f"loss is nan at step {bad}"
            request_rollback(os.environ["FAILSLOW_STATE_DIR"], rank, {"step": bad, "why": why})
            log(event="nan", rank=rank, step=bad)
            return EXIT_ROLLBACK
        if rank == 0 and (ctl / "crash").exists():
            (ctl / "crash").unlink()
            log(event="crash", rank=rank, step=step)
            return 1
        time.sleep(STEP_S)
        step += 1


def main() -> int:
    if os.environ.get("JOB_CRASH_AT_START"):
        log(event="start", rank=0, step=0, version=os.environ.get("JOB_VERSION"), crash=True)
        return 1
    world = int(os.environ.get("JOB_WORLD", "1"))
    if world == 1:
        return rank_main(0)
    ranks = [
        subprocess.Popen([sys.executable, __file__], env={**os.environ, "JOB_WORLD": "1",
                                                           "JOB_RANK": str(r)})
        for r in range(world)
    ]  # fmt: skip
    codes = {}
    while len(codes) < world:
        for r, p in enumerate(ranks):
            if r not in codes and p.poll() is not None:
                codes[r] = p.returncode
                if p.returncode not in (0, 75):  # torchrun: one failure ends the group
                    for q in ranks:
                        q.kill()
                    return 1
        time.sleep(0.01)
    return 75 if all(c == 75 for c in codes.values()) else 0


if __name__ == "__main__":
    rank = os.environ.get("JOB_RANK")
    sys.exit(rank_main(int(rank)) if rank is not None else main())
