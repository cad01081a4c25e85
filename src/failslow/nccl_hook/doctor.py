"""``failslow doctor``: can failslow capture this machine's collectives, and if not, why not.

The capture layer of greyhound 4.2 has two paths here: the LD_PRELOAD shim over NCCL and the
Python hook over torch.distributed. The doctor checks what each needs, without loading NCCL:

* which ``libnccl.so.2`` torch would load ($FAILSLOW_NCCL_LIB first; then the RUNPATH of
  ``torch/lib/libtorch_cuda.so``, which points at the ``nvidia-nccl-cu1x`` wheel; then the
  wheel in every site-packages, ``torch/lib``, ``$LD_LIBRARY_PATH`` and ``ldconfig -p``), and
  which hooked entry points it exports under both names (``ncclX`` and ``pncclX``);
* that the shim is built, loads, and resolves those entry points in that library (the shim's
  ``failslow_shim_resolve``, run in a child process so a crash cannot take the doctor down);
* the Python hook: torch's version and whether the ``c10d::`` ops it hooks exist;
* ``/dev/shm``, where the rings live: present, writable, free space.

Every finding has a level: ``ok``, ``info``, ``warn`` or ``error``. Only errors (the shim
missing or broken while there is an NCCL to hook, an NCCL whose exported symbols the shim
cannot resolve, a CUDA torch whose NCCL cannot be found or is linked in statically) make the
exit status nonzero. A CPU build of torch with no NCCL is a plain answer, not a problem.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.core.events import RECORD_SIZE
from failslow.core.ring import DEFAULT_CAPACITY, HEADER_SIZE
from failslow.errors import FailslowError
from failslow.nccl_hook.elf import ElfInfo, read_elf

NCCL_SONAME = "libnccl.so.2"
SHM_MIN_FREE = 256 << 20


@dataclass(slots=True)
class Finding:
    area: str  # torch | python-hook | nccl | shim | symbols | shm | tracking (the CLI's)
    level: str  # ok | info | warn | error
    message: str


@dataclass(slots=True)
class Report:
    findings: list[Finding] = field(default_factory=list)
    torch: dict[str, Any] = field(default_factory=dict)
    nccl: dict[str, Any] = field(default_factory=dict)
    shim: dict[str, Any] = field(default_factory=dict)
    symbols: list[dict[str, Any]] = field(default_factory=list)
    shm: dict[str, Any] = field(default_factory=dict)

    def add(self, area: str, level: str, message: str) -> None:
        self.findings.append(Finding(area, level, message))

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


# -- torch and the Python hook --------------------------------------------------------------------
def _check_torch(report: Report) -> Path | None:
    """Fills ``report.torch``; returns torch's install directory (None without torch)."""
    try:
        import torch
    except Exception as exc:
        report.torch = {"importable": False, "error": repr(exc)}
        report.add("torch", "warn", f"torch is not importable ({exc}): no Python hook")
        return None
    import torch.distributed as dist

    cuda = torch.version.cuda
    info: dict[str, Any] = {
        "importable": True,
        "version": torch.__version__,
        "cuda": cuda,
        "path": str(Path(torch.__file__).parent),
        "distributed": dist.is_available(),
        "nccl_backend": bool(dist.is_available() and dist.is_nccl_available()),
        "gloo_backend": bool(dist.is_available() and dist.is_gloo_available()),
    }
    report.torch = info
    build = f"CUDA {cuda} build" if cuda else "CPU build"
    report.add("torch", "ok", f"torch {torch.__version__} ({build}), from {info['path']}")
    if not info["distributed"]:
        report.add("python-hook", "error", "torch.distributed is not available in this torch")
        return Path(info["path"])
    from failslow.nccl_hook.c10d_ops import OP_SPECS

    missing = [s.name for s in OP_SPECS if getattr(torch.ops.c10d, s.name, None) is None]
    info["hook_ops"] = len(OP_SPECS) - len(missing)
    info["hook_ops_missing"] = missing
    if len(missing) == len(OP_SPECS):
        report.add("python-hook", "error", "none of the c10d ops the Python hook needs exist")
    elif missing:
        report.add(
            "python-hook",
            "warn",
            f"Python hook: c10d ops absent in this torch, not recorded: {', '.join(missing)}",
        )
    else:
        report.add(
            "python-hook",
            "ok",
            f"Python hook: all {len(OP_SPECS)} c10d ops present "
            "(FAILSLOW_CAPTURE=1 or failslow run turns it on)",
        )
    _check_native_hook(report, info)
    return Path(info["path"])


def _check_native_hook(report: Report, info: dict[str, Any]) -> None:
    """Whether the hook's C++ kernel is built for this torch (native_hook.py)."""
    from failslow.nccl_hook import native_hook

    try:
        how = native_hook.mode()
    except ValueError as exc:
        report.add("native-hook", "error", str(exc))
        return
    path = native_hook.built()
    info["native_hook"] = str(path) if path else None
    if how == "0":
        report.add("native-hook", "ok", f"native hook off ({envvars.NATIVE_HOOK}=0): Python kernel")
    elif path is not None:
        report.add("native-hook", "ok", f"native hook built for this torch: {path}")
    else:
        report.add(
            "native-hook",
            "warn",
            "native hook not built for this torch: every collective is recorded from Python "
            "(about 0.1-0.3 ms per call); run `failslow build-hook` once",
        )


# -- finding NCCL ---------------------------------------------------------------------------------
def _site_dirs() -> list[Path]:
    dirs = [
        *site.getsitepackages(),
        site.getusersitepackages(),
        sysconfig.get_paths()["purelib"],
        *sys.path,
    ]
    out: list[Path] = []
    for d in dirs:
        p = Path(d) if d else None
        if p is not None and p.is_dir() and p not in out:
            out.append(p)
    return out


def _ldconfig_paths() -> list[Path]:
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [
        Path(line.rsplit("=>", 1)[1].strip())
        for line in out.splitlines()
        if line.strip().startswith(NCCL_SONAME) and "=>" in line
    ]


def _nccl_candidates(torch_dir: Path | None, report: Report) -> list[tuple[str, Path]]:
    """(how found, path) of every libnccl.so.2 in the order torch's loader would try them."""
    found: list[tuple[str, Path]] = []
    if torch_dir is not None:
        libtorch_cuda = torch_dir / "lib" / "libtorch_cuda.so"
        if libtorch_cuda.exists():
            try:
                elf = read_elf(libtorch_cuda)
            except FailslowError as exc:
                report.add("nccl", "warn", str(exc))
            else:
                report.nccl["libtorch_cuda_needs_nccl"] = NCCL_SONAME in elf.needed
                if NCCL_SONAME not in elf.needed and elf.exports("ncclAllReduce"):
                    report.nccl["static_in"] = str(libtorch_cuda)
                for d in elf.rpath:
                    found.append(("libtorch_cuda.so RUNPATH", Path(d) / NCCL_SONAME))
    for d in _site_dirs():
        found.append(("nvidia-nccl wheel", d / "nvidia" / "nccl" / "lib" / NCCL_SONAME))
    if torch_dir is not None:
        found += [("torch/lib", p) for p in sorted((torch_dir / "lib").glob("libnccl.so*"))]
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if d:
            found.append(("$LD_LIBRARY_PATH", Path(d) / NCCL_SONAME))
    found += [("ldconfig -p", p) for p in _ldconfig_paths()]
    seen: set[Path] = set()
    out = []
    for how, p in found:
        if p.exists() and p.resolve() not in seen:
            seen.add(p.resolve())
            out.append((how, p))
    return out


def _locate_nccl(torch_dir: Path | None, report: Report) -> Path | None:
    override = os.environ.get(envvars.NCCL_LIB, "").strip()
    candidates = _nccl_candidates(torch_dir, report)
    report.nccl["candidates"] = [{"found_by": how, "path": str(p)} for how, p in candidates]
    if override:
        path = Path(override)
        report.nccl.update(path=str(path), found_by=f"${envvars.NCCL_LIB}")
        if not path.is_file():
            report.add("nccl", "error", f"${envvars.NCCL_LIB}={override} is not a file")
            return None
        report.add("nccl", "ok", f"NCCL: {path} (from ${envvars.NCCL_LIB})")
        return path
    cuda = report.torch.get("cuda")
    static = report.nccl.get("static_in")
    if static:
        report.add(
            "nccl",
            "error",
            f"NCCL is linked statically into {static}: LD_PRELOAD "
            "cannot intercept it (use a torch wheel that loads libnccl.so.2, or rely on "
            "the Python hook)",
        )
        return None
    if not candidates:
        if report.torch.get("importable") and not cuda:
            report.add(
                "nccl",
                "info",
                f"torch {report.torch['version']} is a CPU build: no NCCL to hook; the "
                "Python hook (FAILSLOW_CAPTURE=1) covers gloo",
            )
        elif cuda:
            report.add(
                "nccl",
                "error",
                f"torch is a CUDA {cuda} build but no {NCCL_SONAME} was "
                f"found (looked in torch's RUNPATH, site-packages/nvidia/nccl/lib, "
                f"torch/lib, $LD_LIBRARY_PATH, ldconfig); set ${envvars.NCCL_LIB}",
            )
        else:
            report.add(
                "nccl",
                "info",
                f"no {NCCL_SONAME} found on this machine: nothing for the shim to hook",
            )
        return None
    how, path = candidates[0]
    report.nccl.update(path=str(path), found_by=how)
    if report.torch.get("importable") and not cuda:
        report.add(
            "nccl",
            "info",
            f"NCCL found at {path} ({how}), but torch "
            f"{report.torch['version']} is a CPU build and will not load it",
        )
    else:
        report.add("nccl", "ok", f"NCCL torch would load: {path} ({how})")
    return path


# -- symbols and the shim -------------------------------------------------------------------------
def hooked_symbols() -> tuple[str, ...]:
    """The shim's hooked entry points as ``ncclX`` names."""
    from failslow.nccl_hook.native import HOOKED_SYMBOLS as names

    out: list[str] = []
    for name in names:
        base = name[1:] if name.startswith("pnccl") else name
        base = base if base.startswith("nccl") else f"nccl{base}"
        if base not in out:
            out.append(base)
    return tuple(out)


def optional_symbols() -> frozenset[str]:
    """Hooked names only newer NCCL releases export (their absence is no fault)."""
    try:
        from failslow.nccl_hook.native import OPTIONAL_SYMBOLS
    except ImportError:
        return frozenset(
            {"ncclAlltoAll", "ncclGather", "ncclScatter", "ncclCommInitRankConfig", "ncclCommSplit"}
        )
    return frozenset(OPTIONAL_SYMBOLS)


_RESOLVE_SCRIPT = r"""
import ctypes, json, sys
out = {"loaded": False}
try:
    lib = ctypes.CDLL(sys.argv[1])
    out["loaded"] = True
    if len(sys.argv) > 2:
        fn = lib.failslow_shim_resolve
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        buf = ctypes.create_string_buffer(1 << 16)
        out["count"] = fn(sys.argv[2].encode(), buf, len(buf))
        out["lines"] = buf.value.decode("utf-8", "replace")
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _run_shim(shim: str, nccl: Path | None) -> dict[str, Any]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "FAILSLOW_RING_DIR", "FAILSLOW_CAPTURE")
    }
    argv = [sys.executable, "-I", "-c", _RESOLVE_SCRIPT, shim, *([str(nccl)] if nccl else [])]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        return {"loaded": False, "error": "timed out after 60 s"}
    if proc.returncode != 0:
        how = (
            f"killed by signal {-proc.returncode}"
            if proc.returncode < 0
            else f"exit status {proc.returncode}"
        )
        return {
            "loaded": False,
            "error": f"the probe process died ({how}): {proc.stderr.strip()[-300:]}",
        }
    try:
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"loaded": False, "error": f"unreadable probe output: {proc.stdout[-300:]!r}"}
    return result


def _check_shim(report: Report, nccl: Path | None) -> dict[str, str] | None:
    """Fills ``report.shim``; returns the shim's resolution by symbol (None if not run)."""
    # Without an NCCL to hook, a missing or broken shim costs nothing on this machine.
    severe = "error" if nccl is not None else "warn"
    try:
        from failslow.nccl_hook.native import shim_path

        shim = str(shim_path())
    except (ImportError, FailslowError) as exc:
        report.shim = {"built": False, "error": str(exc)}
        report.add("shim", severe if nccl is not None else "info", f"shim not available: {exc}")
        return None
    report.shim = {"built": True, "path": shim}
    probe = _run_shim(shim, nccl)
    report.shim.update(probe)
    if not probe.get("loaded"):
        report.add("shim", severe, f"shim {shim} does not load: {probe.get('error')}")
        return None
    if nccl is None:
        report.add("shim", "ok", f"shim loads: {shim}")
        return None
    resolved: dict[str, str] = {}
    reason = probe.get("error") or "failslow_shim_resolve returned -1"
    for line in str(probe.get("lines", "")).splitlines():
        name, _, how = line.partition("\t")
        if name == "error":
            reason = how.strip()
        elif name:
            base = name[1:] if name.startswith("pnccl") else name
            resolved[base] = how.strip()
    if "error" in probe or probe.get("count", -1) < 0:
        report.add("shim", "error", f"shim {shim} could not resolve symbols in {nccl}: {reason}")
        return None
    report.add("shim", "ok", f"shim loads and resolved {probe['count']} symbols: {shim}")
    return resolved


def _check_symbols(report: Report, nccl: Path, resolved: dict[str, str] | None) -> None:
    try:
        elf: ElfInfo = read_elf(nccl)
    except FailslowError as exc:
        report.add("symbols", "error", str(exc))
        return
    report.nccl["soname"] = elf.soname
    if elf.soname and elf.soname != NCCL_SONAME:
        report.add(
            "nccl",
            "warn",
            f"{nccl} has soname {elf.soname!r}, not {NCCL_SONAME!r}: "
            "the shim finds NCCL by that name",
        )
    missing, unresolved = [], []
    optional = optional_symbols()
    for base in hooked_symbols():
        plain, prefixed = elf.exports(base), elf.exports("p" + base)
        row: dict[str, Any] = {
            "symbol": base,
            "nccl": plain.binding if plain else None,
            "pnccl": prefixed.binding if prefixed else None,
        }
        if resolved is not None:
            row["shim"] = resolved.get(base, "missing")
            if (plain or prefixed) and row["shim"] == "missing":
                unresolved.append(base)
        row["optional"] = base in optional
        if not plain and not prefixed:
            missing.append(base)
        report.symbols.append(row)
    total = len(report.symbols)
    if missing:
        required = [m for m in missing if m not in optional]
        note = (
            f"; {len(required)} of them every NCCL release has - is this really NCCL?"
            if required
            else " (only newer NCCL releases have them)"
        )
        report.add(
            "symbols",
            "warn" if required else "info",
            f"{len(missing)} of {total} hooked symbols missing in {nccl.name}, those "
            f"hooks are simply off: {', '.join(missing)}{note}",
        )
    else:
        report.add("symbols", "ok", f"all {total} hooked symbols exported by {nccl.name}")
    if unresolved:
        report.add(
            "symbols",
            "error",
            f"the shim cannot resolve symbols this NCCL exports: {', '.join(unresolved)}",
        )


# -- /dev/shm -------------------------------------------------------------------------------------
def _check_shm(report: Report) -> None:
    shm = Path("/dev/shm")
    ring_bytes = HEADER_SIZE + DEFAULT_CAPACITY * RECORD_SIZE
    if not shm.is_dir():
        report.shm = {"present": False}
        report.add(
            "shm",
            "warn",
            "/dev/shm is missing: rings go to the temp directory (slower if that is not a tmpfs)",
        )
        return
    st = os.statvfs(shm)
    free = st.f_bavail * st.f_frsize
    writable = os.access(shm, os.W_OK | os.X_OK)
    report.shm = {
        "present": True,
        "writable": writable,
        "free_bytes": free,
        "ring_bytes": ring_bytes,
    }
    if not writable:
        report.add("shm", "warn", "/dev/shm is not writable: rings go to the temp directory")
    elif free < SHM_MIN_FREE:
        report.add(
            "shm",
            "warn",
            f"/dev/shm has only {free / 2**20:.0f} MiB free (a ring of "
            f"{DEFAULT_CAPACITY} records is {ring_bytes / 2**20:.1f} MiB per process)",
        )
    else:
        report.add(
            "shm",
            "ok",
            f"/dev/shm writable, {free / 2**30:.1f} GiB free (a ring is "
            f"{ring_bytes / 2**20:.1f} MiB per process)",
        )


# -- the report -----------------------------------------------------------------------------------
def diagnose() -> Report:
    report = Report()
    torch_dir = _check_torch(report)
    nccl = _locate_nccl(torch_dir, report)
    resolved = _check_shim(report, nccl)
    if nccl is not None:
        _check_symbols(report, nccl, resolved)
    _check_shm(report)
    return report


def print_report(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    style = {"ok": "green", "info": "cyan", "warn": "yellow", "error": "bold red"}
    for f in report.findings:
        s = style[f.level]
        console.print(
            f"[{s}]{f.level:>5}[/{s}]  {f.area:<11} {f.message}", soft_wrap=True, highlight=False
        )
    if report.symbols:
        table = Table(
            "symbol",
            "ncclX",
            "pncclX",
            "shim resolves via",
            title=f"hooked symbols in {report.nccl.get('path')}",
        )
        for row in report.symbols:
            table.add_row(
                row["symbol"],
                row["nccl"] or "[red]missing[/red]",
                row["pnccl"] or "[red]missing[/red]",
                row.get("shim", "-"),
            )
        console.print(table)
    verdict = "[green]no problems[/green]" if report.ok else "[bold red]problems found[/bold red]"
    console.print(f"failslow doctor: {verdict}", highlight=False)


def main(*, as_json: bool = False, report: Report | None = None) -> int:
    """Print ``report`` (by default :func:`diagnose`'s) as a table or JSON; 1 if it has an error."""
    report = diagnose() if report is None else report
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    return 0 if report.ok else 1
