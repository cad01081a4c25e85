"""The update history (SQLite) and versions, without processes."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from failslow.errors import FailslowError
from failslow.node.hot_update.history import open_history
from failslow.node.hot_update.version import Version, code_version
from failslow.node.launcher import default_snapshot_dir
from failslow.runtime import SITE_DIR

pytestmark = pytest.mark.timeout(60)


def test_concurrent_writers_get_distinct_ids(tmp_path: Path) -> None:
    open_history(tmp_path, create=True).close()
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            with open_history(tmp_path) as history:
                for i in range(20):
                    history.submit(urgency="lazy", env={f"W{n}": str(i)})
                    history.due(0.0, 1.0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with open_history(tmp_path) as history:
        assert [u.id for u in history.updates()] == list(range(1, 81))


def test_due_urgent_now_lazy_after_its_window(tmp_path: Path) -> None:
    with open_history(tmp_path, create=True) as history:
        lazy = history.submit(urgency="lazy", env={"A": "1"})
        short = history.submit(urgency="lazy", env={"B": "1"}, window_s=10)
        urgent = history.submit(urgency="urgent", command=["python", "new.py"])
        now = lazy.submitted_at
        assert [u.id for u in history.due(now, 3600)] == [urgent.id]
        assert [u.id for u in history.due(now + 11, 3600)] == [short.id, urgent.id]
        assert len(history.due(now + 3601, 3600)) == 3


def test_rollback_undoes_the_target_and_what_came_after(tmp_path: Path) -> None:
    base = Version(command=("python", "train.py"))
    with open_history(tmp_path, create=True) as history:
        first = history.submit(urgency="urgent", env={"LR": "0.1"})
        second = history.submit(urgency="urgent", command=["python", "train2.py"])
        v1 = first.apply_to(base, history)
        history.record_applied(first, previous=base, version=v1, trigger="urgent", applied_step=7)
        v2 = second.apply_to(v1, history)
        history.record_applied(second, previous=v1, version=v2, trigger="urgent", applied_step=9)
        assert v2 == Version(command=("python", "train2.py"), env={"LR": "0.1"})
        rollback = history.request_rollback(first.id)
        assert rollback.apply_to(v2, history) == base
        history.record_applied(
            rollback, previous=v2, version=base, trigger="urgent", applied_step=11
        )
        assert [u.outcome for u in history.updates()] == ["rolled_back", "rolled_back", "probation"]
        with pytest.raises(FailslowError, match="not applied"):
            history.request_rollback(first.id)


def test_version_environment_applies_changes_and_code_dir(tmp_path: Path) -> None:
    version = Version(command=("x",), env={"A": "1", "GONE": None}, code_dir=str(tmp_path))
    env = version.environment({"GONE": "x", "PYTHONPATH": f"{SITE_DIR}:/lib"})
    assert env["A"] == "1" and "GONE" not in env
    assert env["PYTHONPATH"] == f"{SITE_DIR}:{tmp_path}:/lib"
    assert env["FAILSLOW_CODE_DIR"] == str(tmp_path)


def test_code_version_is_a_git_rev_or_a_content_hash(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    first = code_version(tmp_path)
    assert first.startswith("sha256:") and code_version(tmp_path) == first
    (tmp_path / "train.py").write_text("print(2)\n")
    assert code_version(tmp_path) != first
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    assert code_version(tmp_path).startswith("git:")
    (tmp_path / "train.py").write_text("print(3)\n")
    assert code_version(tmp_path).endswith("-dirty")


def test_snapshot_dir_is_node_local_and_stable(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    assert default_snapshot_dir(shm / "failslow-x") == shm / "failslow-x" / "snapshots"
    elsewhere = default_snapshot_dir(tmp_path / "rings")
    assert elsewhere.parent.parent == shm and elsewhere == default_snapshot_dir(tmp_path / "rings")
