"""A version of a job's launch: its command, environment changes and code directory.

byterobust 6.1 restarts a job in place "with the new code/config"; rollback (4.2, 8.1.2) restarts
it with the previous one. Both need the launch to be a value that can be recorded, changed and
restored: :class:`Version`. Its ``env`` holds the *changes* to the launcher's own environment
(``None`` unsets a variable); its ``code_dir`` is where the command runs (its working directory,
exported as ``FAILSLOW_CODE_DIR`` and put on ``PYTHONPATH``), identified by :func:`code_version`:
the git revision of the directory, or a hash of its files.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.errors import FailslowError
from failslow.runtime import SITE_DIR

HASH_LIMIT_BYTES = 256 << 20  # a code directory bigger than this is not hashed
SKIPPED_DIRS = {".git", "__pycache__", ".venv", "node_modules", ".mypy_cache", ".ruff_cache"}


@dataclass(frozen=True, slots=True)
class Version:
    """How the job is launched; the launcher's base version plus every applied update."""

    command: tuple[str, ...]
    env: Mapping[str, str | None] = field(default_factory=dict)
    code_dir: str | None = None
    code_version: str | None = None

    def changed(
        self,
        *,
        command: Sequence[str] | None = None,
        env: Mapping[str, str | None] | None = None,
        code_dir: str | None = None,
        code_version: str | None = None,
    ) -> Version:
        """This version with an update's changes applied (``None``: unchanged)."""
        return Version(
            command=tuple(command) if command else self.command,
            env={**self.env, **(env or {})},
            code_dir=code_dir if code_dir is not None else self.code_dir,
            code_version=code_version if code_dir is not None else self.code_version,
        )

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with this version's changes and its code directory applied."""
        env = dict(base)
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        if self.code_dir is not None:
            env[envvars.CODE_DIR] = self.code_dir
            paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            site = [p for p in paths[:1] if p == str(SITE_DIR)]  # failslow run's stays first
            rest = [p for p in paths[len(site) :] if p != self.code_dir]
            env["PYTHONPATH"] = os.pathsep.join([*site, self.code_dir, *rest])
        if self.code_version is not None:
            env[envvars.CODE_VERSION] = self.code_version
        return env

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": list(self.command),
            "env": dict(self.env),
            "code_dir": self.code_dir,
            "code_version": self.code_version,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Version:
        return cls(
            command=tuple(data["command"]),
            env=dict(data.get("env") or {}),
            code_dir=data.get("code_dir"),
            code_version=data.get("code_version"),
        )


def resolve_code_dir(path: str | os.PathLike[str]) -> str:
    """The absolute path of an existing directory; FailslowError naming it otherwise."""
    resolved = Path(path).expanduser().absolute()
    if not resolved.is_dir():
        raise FailslowError(f"code directory {str(path)!r} is not a directory")
    return str(resolved)


def code_version(directory: str | os.PathLike[str]) -> str:
    """``git:<rev>`` (``-dirty`` with uncommitted changes) for a git work tree, else
    ``sha256:<hex>`` of its files (names and contents), or ``unhashed`` when it is too big."""
    rev = _git(directory, "rev-parse", "HEAD")
    if rev:
        dirty = _git(directory, "status", "--porcelain", "--untracked-files=no")
        return f"git:{rev[:12]}{'-dirty' if dirty else ''}"
    digest = hashlib.sha256()
    total = 0
    root = Path(directory)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".pyc") or not path.is_file():
                continue
            total += path.stat().st_size
            if total > HASH_LIMIT_BYTES:
                return "unhashed"
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes())
    return f"sha256:{digest.hexdigest()[:12]}"


def _git(directory: str | os.PathLike[str], *args: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if out.returncode != 0:
        return ""
    return out.stdout.strip()
