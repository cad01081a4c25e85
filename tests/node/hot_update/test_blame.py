"""Which code update an exception is traceable to (failslow.node.hot_update.blame)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from failslow.node.hot_update.blame import blame, changed_files
from failslow.node.hot_update.version import Version, code_version


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _record(*frames: tuple[Path | str, int, str], wall: float = 1.0) -> dict:
    return {"rank": 3, "type": "TypeError", "message": "bad", "wall": wall,
            "frames": [[str(f), line, fn] for f, line, fn in frames]}  # fmt: skip


def test_two_code_directories_are_compared_file_by_file(tmp_path: Path) -> None:
    old = _tree(tmp_path / "v1", {"train.py": "a", "pkg/model.py": "b", "pkg/data.py": "c"})
    new = _tree(tmp_path / "v2", {"train.py": "a", "pkg/model.py": "B", "pkg/fused.py": "d"})
    _tree(new, {"__pycache__/model.cpython-311.pyc": "x"})
    changed = changed_files(Version(("x",), code_dir=str(old)), Version(("x",), code_dir=str(new)))
    assert changed == {(new / "pkg/model.py").resolve(), (new / "pkg/fused.py").resolve()}
    train, model = new / "train.py", new / "pkg/model.py"
    found = blame([_record((train, 9, "<module>"), (model, 4, "forward"))], changed, str(new))
    assert found is not None and (found.line, found.function) == (4, "forward")
    assert "TypeError: bad at pkg/model.py:4 in forward, in a file update #2 changed" in (
        found.describe("update #2", str(new))
    )
    assert blame([_record((train, 9, "<module>"))], changed, str(new)) is None


def test_only_the_launch_s_first_exception_is_blamed_and_failed_collectives_are_not(
    tmp_path: Path,
) -> None:
    """A peer's collective that failed because a rank was lost is a consequence: a frame of
    the changed training loop under it does not blame the update; neither does a later
    exception when the first one is elsewhere."""
    new = _tree(tmp_path / "v2", {"train.py": "changed"})
    changed = {(new / "train.py").resolve()}
    dist = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    peer = _record((new / "train.py", 30, "main"), (dist, 3252, "all_reduce"), wall=1.0)
    assert blame([peer], changed, str(new)) is None
    first = _record(("/venv/lib/python3.11/site-packages/numpy/core.py", 5, "f"), wall=2.0)
    later = _record((new / "train.py", 12, "main"), wall=3.0)
    assert blame([later, first, peer], changed, str(new)) is None
    assert blame([later, peer], changed, str(new)) is not None


def test_in_place_changes_use_git_and_otherwise_the_whole_directory(tmp_path: Path) -> None:
    code = _tree(tmp_path / "code", {"train.py": "a", "model.py": "b"})
    plain = Version(("x",), code_dir=str(code), code_version="sha256:1")
    same = Version(("x",), code_dir=str(code), code_version="sha256:1")
    assert changed_files(plain, same) == set()
    after = Version(("x",), code_dir=str(code), code_version="sha256:2")
    assert changed_files(plain, after) is None  # cannot tell: every file of it counts
    assert blame([_record((code / "train.py", 1, "main"))], None, str(code)) is not None
    assert blame([_record(("/elsewhere/x.py", 1, "f"))], None, str(code)) is None

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(code), *args], check=True, capture_output=True)

    git("init", "-q")  # git comes with the clean clone the suite runs in
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    before = Version(("x",), code_dir=str(code), code_version=code_version(code))
    (code / "model.py").write_text("B")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "two")
    now = Version(("x",), code_dir=str(code), code_version=code_version(code))
    assert changed_files(before, now) == {(code / "model.py").resolve()}
