"""``failslow run`` (launch with capture on) and ``failslow doctor`` (can capture work here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from failslow.core.events import OpCode, records_to_events
from failslow.core.ring import RingReader, find_rings

pytestmark = pytest.mark.timeout(120)

ENV_KEYS = (
    "FAILSLOW_RING_DIR",
    "FAILSLOW_RING_CAPACITY",
    "FAILSLOW_PAUSE_TIMEOUT_S",
    "FAILSLOW_CAPTURE",
    "LD_PRELOAD",
    "PYTHONPATH",
)
PRINT_ENV = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {ENV_KEYS!r}}}))"


def _shim() -> str | None:
    try:
        from failslow.nccl_hook.native import shim_path

        return str(shim_path())
    except Exception:
        return None


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FAILSLOW_") and k not in ("LD_PRELOAD", "PYTHONPATH")
    }
    env.update(extra)
    return env


def _failslow(
    *args: str, env: dict[str, str] | None = None, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "failslow.cli", *args],
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _child_env(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- failslow run ---------------------------------------------------------------------------------
def test_run_passes_ring_dir_and_options(tmp_path: Path) -> None:
    out = _failslow(
        "run",
        "--no-shim",
        "--ring-dir",
        str(tmp_path / "rings"),
        "--capacity",
        "1024",
        "--pause-timeout",
        "2.5",
        "--",
        sys.executable,
        "-c",
        PRINT_ENV,
        env=_env(PYTHONPATH="/user/path"),
    )
    env = _child_env(out)
    assert env["FAILSLOW_RING_DIR"] == str(tmp_path / "rings") and (tmp_path / "rings").is_dir()
    assert env["FAILSLOW_RING_CAPACITY"] == "1024"
    assert float(env["FAILSLOW_PAUSE_TIMEOUT_S"]) == 2.5
    assert env["FAILSLOW_CAPTURE"] == "1"
    first, rest = env["PYTHONPATH"].split(os.pathsep, 1)
    assert first.endswith("_site") and rest == "/user/path"
    assert env["LD_PRELOAD"] is None, "--no-shim sets no LD_PRELOAD"
    assert str(tmp_path / "rings") in out.stderr  # says where the rings are


def test_run_default_ring_dir_is_fresh_under_dev_shm() -> None:
    env = _child_env(
        _failslow("run", "--no-shim", "--no-python-hook", "--", sys.executable, "-c", PRINT_ENV)
    )
    ring_dir = Path(env["FAILSLOW_RING_DIR"])
    try:
        assert ring_dir.is_dir() and ring_dir.name.startswith("failslow-")
        if Path("/dev/shm").is_dir():
            assert ring_dir.parent == Path("/dev/shm")
        assert env["FAILSLOW_CAPTURE"] is None and env["PYTHONPATH"] is None
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)


def test_run_prepends_shim_to_ld_preload(tmp_path: Path) -> None:
    shim = _shim()
    if shim is None:
        pytest.skip("the LD_PRELOAD shim is not built (FAILSLOW_SKIP_NATIVE, or no gcc at install)")
    out = _failslow(
        "run",
        "--ring-dir",
        str(tmp_path),
        "--",
        sys.executable,
        "-c",
        PRINT_ENV,
        env=_env(LD_PRELOAD="libm.so.6"),
    )
    assert _child_env(out)["LD_PRELOAD"] == f"{shim}:libm.so.6"


def test_run_without_a_built_shim_is_one_line(tmp_path: Path) -> None:
    if _shim() is not None:
        pytest.skip("the shim is built here")
    out = _failslow("run", "--ring-dir", str(tmp_path), "--", sys.executable, "-c", "pass")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--no-shim" in out.stderr


def test_run_returns_the_child_exit_status(tmp_path: Path) -> None:
    out = _failslow(
        "run",
        "--no-shim",
        "--ring-dir",
        str(tmp_path),
        "--",
        sys.executable,
        "-c",
        "raise SystemExit(3)",
    )
    assert out.returncode == 3


@pytest.mark.parametrize(
    "args",
    [
        ("run",),
        ("run", "--no-shim", "--"),
        ("run", "--no-shim", "python", "-V"),
        ("run", "--no-shim", "--", "/nonexistent/failslow-cmd"),
        ("run", "--no-shim", "--", "README.md"),
        ("run", "--no-shim", "--capacity", "1000", "--", "true"),
        ("run", "--no-shim", "--decline-every", "10", "--", "true"),
        ("run", "--no-shim", "--nproc-per-node", "2", "--decline-every", "-1", "--", "true"),
    ],
)
def test_run_user_errors_are_one_line(args: tuple[str, ...]) -> None:
    out = _failslow(*args)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("failslow run: ")


def test_run_forwards_sigterm_to_the_child(tmp_path: Path) -> None:
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "failslow.cli",
            "run",
            "--no-shim",
            "--no-python-hook",
            "--ring-dir",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            child,
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 7
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


GLOO_SCRIPT = """\
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
for _ in range(5):
    dist.all_reduce(torch.ones(16))
dist.barrier()
import time; time.sleep(0.2)
dist.destroy_process_group()
print("done")
"""


@pytest.mark.multiprocess
def test_python_hook_records_an_unmodified_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(GLOO_SCRIPT)  # no failslow import anywhere
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    script_env = "import os; print('user site ran:', os.environ.get('USER_SITE_RAN'))\n"
    script.write_text(GLOO_SCRIPT + script_env)
    ring_dir = tmp_path / "rings"
    out = _failslow(
        "run",
        "--no-shim",
        "--python-hook",
        "--ring-dir",
        str(ring_dir),
        "--",
        sys.executable,
        str(script),
        env=_env(PYTHONPATH=str(user_site)),
    )
    assert out.returncode == 0, out.stderr
    assert "user site ran: 1" in out.stdout, "the user's own sitecustomize must still run"
    (ring,) = find_rings(ring_dir)
    reader = RingReader(ring)
    events = records_to_events(reader.poll())
    reader.close()
    reduces = [e for e in events if e.op == OpCode.ALLREDUCE]
    assert len(reduces) == 5 and all(e.nbytes == 64 for e in reduces)

    quiet = tmp_path / "quiet"
    out = _failslow(
        "run",
        "--no-shim",
        "--no-python-hook",
        "--ring-dir",
        str(quiet),
        "--",
        sys.executable,
        str(script),
    )
    assert out.returncode == 0, out.stderr
    assert find_rings(quiet) == []


def test_python_hook_and_shim_write_separate_rings(tmp_path: Path) -> None:
    """With the shim loaded, the Python hook writes ``...-py.ring`` (gloo calls) and leaves
    NCCL calls to the shim, so neither replaces the other's ring file."""
    if _shim() is None:
        pytest.skip("the NCCL shim is not built (FAILSLOW_SKIP_NATIVE?)")
    script = tmp_path / "train.py"
    script.write_text(GLOO_SCRIPT)
    ring_dir = tmp_path / "rings"
    out = _failslow(
        "run", "--python-hook", "--ring-dir", str(ring_dir), "--", sys.executable, str(script)
    )
    assert out.returncode == 0, out.stderr
    (ring,) = find_rings(ring_dir)  # no NCCL call here, so the shim made no ring of its own
    assert ring.name.endswith("-py.ring"), ring.name
    reader = RingReader(ring)
    events = records_to_events(reader.poll())
    reader.close()
    assert len([e for e in events if e.op == OpCode.ALLREDUCE]) == 5


def test_python_hook_does_not_import_torch_into_other_processes(tmp_path: Path) -> None:
    out = _failslow(
        "run",
        "--no-shim",
        "--ring-dir",
        str(tmp_path),
        "--",
        sys.executable,
        "-c",
        "import sys; print('torch' in sys.modules)",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- failslow doctor ------------------------------------------------------------------------------
def _no_nccl_here() -> bool:
    import torch

    from failslow.nccl_hook.doctor import Report, _nccl_candidates

    return torch.version.cuda is None and not _nccl_candidates(None, Report())


def test_doctor_on_a_cpu_machine_says_there_is_no_nccl() -> None:
    if not _no_nccl_here():
        pytest.skip("this machine has a CUDA torch or an NCCL library")
    out = _failslow("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CPU build: no NCCL to hook" in out.stdout and "Traceback" not in out.stderr
    report = json.loads(_failslow("doctor", "--json").stdout)
    assert report["ok"] is True and report["torch"]["cuda"] is None
    assert report["torch"]["hook_ops_missing"] == []
    assert report["shm"]["present"] == Path("/dev/shm").is_dir()
    # the analyzer's BOCD kernel is reported beside capture (this venv builds it)
    (tracking,) = [f for f in report["findings"] if f["area"] == "tracking"]
    assert tracking["level"] == "ok" and "runs in C" in tracking["message"], tracking


STUB_C = """\
/* a stub NCCL missing most entry points: pnccl* strong, nccl* weak aliases, as NCCL does */
typedef struct ncclComm *ncclComm_t;
int pncclAllReduce(const void *s, void *r, unsigned long n, int dt, int op, ncclComm_t c,
                   void *st) { return 0; }
int ncclAllReduce(const void *, void *, unsigned long, int, int, ncclComm_t, void *)
    __attribute__((weak, alias("pncclAllReduce")));
int pncclGroupStart(void) { return 0; }
int ncclGroupStart(void) __attribute__((weak, alias("pncclGroupStart")));
int ncclSend(const void *s, unsigned long n, int dt, int peer, ncclComm_t c, void *st) {
  return 0;
}
"""


def test_doctor_reports_symbols_a_stub_nccl_lacks(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed")
    (tmp_path / "stub.c").write_text(textwrap.dedent(STUB_C))
    lib = tmp_path / "libnccl.so.2"
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-Wl,-soname,libnccl.so.2",
            "-o",
            str(lib),
            str(tmp_path / "stub.c"),
        ],
        check=True,
        capture_output=True,
    )
    env = _env(FAILSLOW_NCCL_LIB=str(lib))
    out = _failslow("doctor", "--json", env=env)
    report = json.loads(out.stdout)
    rows = {r["symbol"]: r for r in report["symbols"]}
    assert rows["ncclAllReduce"]["nccl"] == "weak" and rows["ncclAllReduce"]["pnccl"] == "global"
    assert rows["ncclSend"]["nccl"] == "global" and rows["ncclSend"]["pnccl"] is None
    assert rows["ncclBroadcast"]["nccl"] is None and rows["ncclBroadcast"]["pnccl"] is None
    assert report["nccl"]["path"] == str(lib) and report["nccl"]["soname"] == "libnccl.so.2"
    missing = next(
        f["message"]
        for f in report["findings"]
        if f["area"] == "symbols" and "missing" in f["message"]
    )
    assert "ncclBroadcast" in missing and "ncclAllReduce" not in missing
    shim = _shim()
    if shim is None:  # an NCCL to hook and no shim: that is a real problem
        assert out.returncode == 1 and not report["ok"]
        assert any(f["area"] == "shim" and f["level"] == "error" for f in report["findings"])
    else:
        assert out.returncode == 0, report["findings"]
        assert rows["ncclAllReduce"]["shim"] != "missing"
        assert rows["ncclBroadcast"]["shim"] == "missing"
    text = _failslow("doctor", env=env)
    assert "missing" in text.stdout and "ncclBroadcast" in text.stdout
    assert "Traceback" not in text.stderr


def test_doctor_with_a_bad_nccl_lib_path_is_a_clear_error(tmp_path: Path) -> None:
    out = _failslow("doctor", env=_env(FAILSLOW_NCCL_LIB=str(tmp_path / "nope.so")))
    assert out.returncode == 1 and "FAILSLOW_NCCL_LIB" in out.stdout
    assert "Traceback" not in out.stderr
