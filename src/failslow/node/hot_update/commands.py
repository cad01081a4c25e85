"""What ``failslow update submit|list|rollback|cancel`` do (byterobust 6.1, in-place hot update).

The CLI's thin ``_cmd_update*`` functions call these. The history is found from ``--state-dir``,
else ``$FAILSLOW_STATE_DIR`` (set inside every job ``failslow run`` launches), else the one live
launcher on this machine whose state is in the default place (``/dev/shm/failslow-*``).
"""

from __future__ import annotations

import datetime
import os
import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.errors import FailslowError
from failslow.node.hot_update.history import DB_NAME, History, Update, open_history
from failslow.node.hot_update.version import code_version, resolve_code_dir

DEFAULT_BASES = (Path("/dev/shm"), Path(tempfile.gettempdir()))


def locate(state_dir: str | None) -> History:
    """The history named by ``--state-dir``, ``$FAILSLOW_STATE_DIR`` or the one live launcher."""
    given = state_dir or os.environ.get(envvars.STATE_DIR)
    if given:
        return open_history(given)
    live = [path for path in _candidates() if _launcher_alive(path)]
    if len(live) == 1:
        return open_history(live[0])
    if not live:
        raise FailslowError(
            "no state directory: pass --state-dir DIR (failslow run prints it) "
            f"or set {envvars.STATE_DIR}"
        )
    raise FailslowError(
        f"{len(live)} running launchers ({', '.join(str(p.parent) for p in live)}): "
        "pass --state-dir DIR"
    )


def _candidates() -> list[Path]:
    found: list[Path] = []
    for base in DEFAULT_BASES:
        if base.is_dir():
            found.extend(sorted(base.glob(f"failslow-*/{DB_NAME}")))
    return found


def _launcher_alive(path: Path) -> bool:
    try:
        history = open_history(path)
        launcher = history.job("launcher") or {}
        history.close()
        os.kill(int(launcher["pid"]), 0)
    except (FailslowError, KeyError, ValueError, TypeError, ProcessLookupError):
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def parse_env(assignments: Sequence[str], unset: Sequence[str]) -> dict[str, str | None]:
    """``--env K=V`` and ``--unset-env K`` as one change set; FailslowError for a bad item."""
    changes: dict[str, str | None] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key or not _is_name(key):
            raise FailslowError(f"--env {item!r}: expected NAME=VALUE")
        changes[key] = value
    for key in unset:
        if not _is_name(key):
            raise FailslowError(f"--unset-env {key!r}: expected a variable name")
        changes[key] = None
    return changes


def _is_name(key: str) -> bool:
    return bool(key) and "=" not in key and "\0" not in key and not key[0].isdigit()


def submit(
    history: History,
    *,
    urgent: bool,
    command: str | None,
    env: Sequence[str],
    unset_env: Sequence[str],
    code_dir: str | None,
    note: str,
    window_s: float | None,
) -> Update:
    argv = None
    if command is not None:
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise FailslowError(f"--command {command!r}: {exc}") from None
        if not argv:
            raise FailslowError("--command is empty")
    node = history.job("node") or {}
    if int(node.get("node_rank", 0)) != 0:
        raise FailslowError(
            f"this launcher is node {node['node_rank']} of {node.get('nnodes')}: submit updates "
            "to node 0's launcher (its --state-dir); every node relaunches at node 0's version"
        )
    resolved = resolve_code_dir(code_dir) if code_dir is not None else None
    if urgent and window_s is not None:
        raise FailslowError("--window only applies to a lazy update")
    return history.submit(
        urgency="urgent" if urgent else "lazy",
        command=argv,
        env=parse_env(env, unset_env),
        code_dir=resolved,
        code_version=code_version(resolved) if resolved else None,
        note=note,
        window_s=window_s,
    )


def to_json(update: Update) -> dict[str, Any]:
    return {
        "id": update.id,
        "kind": update.kind,
        "urgency": update.urgency,
        "change": update.describe(),
        "note": update.note,
        "outcome": update.outcome,
        "trigger": update.trigger,
        "submitted_at": update.submitted_at,
        "applied_at": update.applied_at,
        "applied_step": update.applied_step,
        "detail": update.detail,
        "previous": update.previous.to_dict() if update.previous else None,
        "version": update.version.to_dict() if update.version else None,
    }


OUTCOME_STYLE = {
    "pending": "yellow",
    "probation": "cyan",
    "applied": "green",
    "failed": "red",
    "rolled_back": "magenta",
}


def print_table(history: History, updates: list[Update]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    launcher = history.job("launcher") or {}
    current = history.job("current")
    head = f"[bold]{history.path}[/bold]"
    if launcher:
        head += f", launcher pid {launcher.get('pid')}"
    if current:
        head += f", running {shlex.join(current['command'])}"
        if current.get("code_version"):
            head += f" ({current['code_version']})"
    console.print(head, soft_wrap=True)
    if not updates:
        console.print("  no updates")
        return
    table = Table("id", "submitted", "urgency", "change", "outcome", "applied", "note / detail")
    for u in updates:
        style = OUTCOME_STYLE.get(u.outcome, "")
        applied = _clock(u.applied_at) if u.applied_at else ""
        if u.applied_step is not None:
            applied += f" step {u.applied_step}"
        if u.trigger:
            applied += f" ({u.trigger})"
        table.add_row(
            str(u.id),
            _clock(u.submitted_at),
            u.urgency,
            u.describe(),
            f"[{style}]{u.outcome}[/{style}]" if style else u.outcome,
            applied,
            " - ".join(t for t in (u.note, u.detail) if t),
        )
    console.print(table)


def _clock(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%m-%d %H:%M:%S")
