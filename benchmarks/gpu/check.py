"""The GPU path, checked on a GPU (issue 50): one command, one table.

    python benchmarks/gpu/check.py [--quick] [--out DIR] [--rows 1,2,...] [--device cpu]

``benchmarks/gpu/run.sh`` installs the project and builds the shim and the C++ hook first, then
runs this. Each row runs in processes of its own (``workers.py``) under a time limit, so a
hang or a crash is that row's FAIL, not the end of the check. ``--device cpu`` is the dry run
on a machine without a GPU: the same code over gloo on the CPU; rows that need CUDA say SKIP.

Rows (issue 50's list):

1. ``failslow doctor`` against torch's own ``libnccl.so.2``: every hooked symbol resolves under
   both names;
2. a one-rank NCCL job under ``failslow run -- torchrun``, with and without
   ``FAILSLOW_DEVICE_TIMING=1``: its rings hold the shim's NCCL records, device-timed (CUDA
   events) in the first run, enqueue-timed in the second; ``failslow export`` and ``analyze``
   read them;
3. cost per real NCCL call (1 KiB all-reduce, host time): no capture; the shim passing through,
   recording, recording with device timing; the Python hook's Python and C++ kernels; the hook
   deferring to the shim (``failslow run``'s configuration);
4. tracking overhead on a GPT-2 medium step (355 M parameters, bf16 autocast, batch 8 x 1024,
   one-rank DDP on NCCL): processes under ``failslow run`` and plain, alternating (ABBA);
5. GEMM validation on the GPU: the controller's task (its time = the pause it costs), bf16 and
   fp32 spread over repetitions, and a GPU shared with a competing process named slow by the
   controller's own rule (:func:`failslow.core.localize.diagnose.diagnose`);
6. every-step in-memory snapshots of that GPT's model + AdamW state (4.3 GB): step time with
   and without, the training thread's stall, the D2H copy's bandwidth, snapshots taken/skipped;
7. the stop-time device checks (``python -m failslow.runtime.stop_check``) on CUDA: error
   against float64, time, and the same digest twice (deterministic);
8. Megatron-core's GPTModel on the GPU (TP1 PP1, no CPU redirect) with
   ``failslow.megatron.attach``: steps, a snapshot, a restore, the same steps again bit for bit;
9. the ``gpu``-marked tests (``pytest -m gpu``).

Writes ``table.txt``, ``results.json`` and ``check.log`` (every process's output) to ``--out``
(default ``$OUT`` or ``runs/gpu-check``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from tracking_overhead import _bootstrap_mean  # noqa: E402 (benchmarks/ is no package)

WORKERS = str(HERE / "workers.py")
PY = sys.executable
CLI = [PY, "-m", "failslow.cli"]
TORCHRUN = [shutil.which("torchrun") or "torchrun"]


def wait_for_hook_build() -> None:
    """run.sh builds the C++ hook beside rows 1-2; rows that time it wait for that build."""
    done = os.environ.get("FAILSLOW_GPU_HOOK_DONE")
    deadline = time.monotonic() + 300
    while done and not Path(done).is_file() and time.monotonic() < deadline:
        time.sleep(1)


@dataclass
class Row:
    number: int
    what: str
    verdict: str = "FAIL"  # PASS | FAIL | SKIP
    result: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class Check:
    def __init__(self, out: Path, device: str, quick: bool) -> None:
        self.out, self.device, self.quick = out, device, quick
        self.log = open(out / "check.log", "a", buffering=1)
        self.tmp = Path(tempfile.mkdtemp(prefix="fs-gpu-check-"))

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        what: str = "",
    ) -> subprocess.CompletedProcess[str]:
        """Run a process, its output into the log; a timeout is a TimeoutError naming it."""
        full = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.log.write(f"\n$ {' '.join(argv)}   # {what}\n")
        started = time.perf_counter()
        try:
            done = subprocess.run(
                argv, env=full, capture_output=True, text=True, timeout=timeout, cwd=ROOT
            )
        except subprocess.TimeoutExpired as exc:
            self.log.write(_text(exc.stdout) + _text(exc.stderr))
            raise TimeoutError(f"{what or argv[0]}: no end after {timeout:.0f} s") from None
        self.log.write(done.stdout + done.stderr)
        self.log.write(f"# exit {done.returncode} in {time.perf_counter() - started:.1f} s\n")
        return done

    def worker(
        self,
        row: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        prefix: list[str] | None = None,
    ) -> dict[str, Any]:
        """A workers.py row's JSON (its last stdout line); RuntimeError with its error if none."""
        argv = [*(prefix or []), PY, WORKERS, row, "--device", self.device, *args]
        done = self.run(argv, env=env, timeout=timeout, what=f"workers {row}")
        return _last_json(done, f"workers {row}")


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _last_json(done: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    for line in reversed(done.stdout.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"{what} exited {done.returncode}: {tail}")


# -- the rows ----------------------------------------------------------------------------------
def row_doctor(c: Check, row: Row) -> None:
    done = c.run([*CLI, "doctor", "--json"], what="doctor")
    report = json.loads(done.stdout)
    row.data = {k: report.get(k) for k in ("ok", "nccl", "shim", "symbols")}
    symbols = report.get("symbols") or []
    if not report.get("torch", {}).get("cuda"):
        row.verdict, row.result = "SKIP", "a CPU build of torch: no NCCL to hook"
        return
    from failslow.nccl_hook.native import HOOKED_SYMBOLS, OPTIONAL_SYMBOLS

    both = [s for s in symbols if s.get("pnccl") and s.get("nccl")]
    resolved = [s for s in symbols if s.get("shim") == "pnccl"]
    missing_required = [
        s["symbol"]
        for s in symbols
        if s["symbol"] not in OPTIONAL_SYMBOLS and s.get("shim") != "pnccl"
    ]
    nccl = report.get("nccl", {})
    row.result = (
        f"{nccl.get('path', '?')} ({nccl.get('found_by', '?')}): {len(both)}/"
        f"{len(HOOKED_SYMBOLS)} symbols under both names, {len(resolved)} resolved "
        f"by the shim"
    )
    errors = [f["message"] for f in report.get("findings", []) if f["level"] == "error"]
    if errors:
        row.result += "; errors: " + "; ".join(errors)
    row.verdict = "PASS" if report.get("ok") and not missing_required else "FAIL"


def _export(c: Check, ring_dir: Path, name: str) -> list[dict[str, Any]]:
    path = c.out / name
    c.run([*CLI, "export", str(ring_dir), "-o", str(path)], what="export")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def row_job(c: Check, row: Row) -> None:
    steps = "150" if c.quick else "400"
    runs: dict[str, list[dict[str, Any]]] = {}
    for timing in ("device", "host"):
        rings = c.tmp / f"rings-{timing}"
        env = {"FAILSLOW_DEVICE_TIMING": "1" if timing == "device" else "0"}
        argv = [
            *CLI,
            "run",
            "--ring-dir",
            str(rings),
            "--",
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            "1",
            WORKERS,
            "nccl_job",
            "--device",
            c.device,
            "--steps",
            steps,
        ]
        done = c.run(argv, env=env, timeout=180, what=f"failslow run ({timing} timing)")
        notes = [ln for ln in done.stderr.splitlines() if "failslow shim" in ln]
        row.data[f"{timing}_shim_notes"] = notes
        job = _last_json(done, "the job under failslow run")
        runs[timing] = _export(c, rings, f"rings-{timing}.jsonl")
        row.data[f"{timing}_step_ms"] = job["step_ms"]
    figures = {}
    for timing, events in runs.items():
        shim = [e for e in events if e.get("source") == "shim" and e.get("op") == "allreduce"]
        py = [e for e in events if e.get("source") == "python" and e.get("op") != "step"]
        timed = [e for e in shim if e.get("end") == "complete"]
        durations = [(e["t_end_ns"] - e["t_start_ns"]) / 1e3 for e in shim]
        figures[timing] = {
            "records": len(events),
            "shim_allreduce": len(shim),
            "python_calls": len(py),
            "device_timed": len(timed),
            "median_us": statistics.median(durations) if durations else None,
            "min_us": min(durations) if durations else None,
        }
    row.data["figures"] = figures
    analyzed = c.run([*CLI, "analyze", "--json", str(c.out / "rings-device.jsonl")], what="analyze")
    try:
        row.data["analyze"] = json.loads(analyzed.stdout)
    except json.JSONDecodeError:
        row.data["analyze"] = {"error": analyzed.stderr.strip()[-300:]}
    d, h = figures["device"], figures["host"]
    if c.device == "cuda" and d["device_timed"] < d["shim_allreduce"]:
        try:  # what the CUDA runtime answers to the shim's calls, for the report
            row.data["probe"] = c.worker("probe", timeout=60)
        except Exception as exc:
            row.data["probe"] = repr(exc)
    row.result = (
        f"device run: {d['shim_allreduce']} NCCL all-reduce records, "
        f"{d['device_timed']} device-timed, median {d['median_us'] or 0:.0f} us; host "
        f"run: {h['shim_allreduce']} records, median {h['median_us'] or 0:.0f} us "
        f"(enqueue); analyze: {'ok' if analyzed.returncode == 0 else 'FAILED'}"
    )
    notes = row.data.get("device_shim_notes") or []
    if notes:
        row.result += "; shim: " + " | ".join(n.split("failslow shim: ")[-1] for n in notes)
    if c.device != "cuda":
        row.verdict, row.result = "SKIP", "no NCCL on the CPU (gloo ran: " + row.result + ")"
        return
    ok = (
        d["shim_allreduce"] >= int(steps)
        and d["device_timed"] == d["shim_allreduce"]
        and (d["min_us"] or 0) > 0
        and h["shim_allreduce"] >= int(steps)
        and h["device_timed"] == 0
        and analyzed.returncode == 0
    )
    row.verdict = "PASS" if ok else "FAIL"


def _shim() -> str:
    from failslow.nccl_hook.native import shim_path

    return str(shim_path())


def row_calls(c: Check, row: Row) -> None:
    wait_for_hook_build()
    n = "5000" if c.quick else "20000"
    rounds = "2" if c.quick else "4"
    rings = str(c.tmp / "rings-calls")
    shim = _shim()
    variants = {  # name: (env, modes)
        "plain": ({"FAILSLOW_NATIVE_HOOK": "0"}, "off,hook"),
        "native": ({"FAILSLOW_NATIVE_HOOK": "1"}, "off,hook"),
        "pass": ({"LD_PRELOAD": shim}, "off"),
        "shim": ({"LD_PRELOAD": shim, "FAILSLOW_RING_DIR": rings, "RANK": "0"}, "off,hook"),
        "device": (
            {
                "LD_PRELOAD": shim,
                "FAILSLOW_RING_DIR": rings + "-d",
                "RANK": "0",
                "FAILSLOW_DEVICE_TIMING": "1",
            },
            "off,hook",
        ),
    }
    got: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for name, (env, modes) in variants.items():
        args = ["--calls", n, "--rounds", rounds, "--modes", modes]
        try:
            got[name] = c.worker("calls", *args, env=env, timeout=120)
        except Exception as exc:
            failed[name] = str(exc)
            gdb = shutil.which("cuda-gdb")
            if gdb and "exited -" in str(exc):  # a crash: where, for the report
                argv = [gdb, "-batch", "-ex", "run", "-ex", "bt 30", "--args", PY, WORKERS]
                argv += ["calls", "--device", c.device, *args]
                try:
                    done = c.run(argv, env=env, timeout=120, what=f"{name} under cuda-gdb")
                    trace = [ln for ln in done.stdout.splitlines() if ln.startswith("#")]
                    row.data[f"{name}_backtrace"] = trace[:30]
                except Exception as gdb_exc:
                    row.data[f"{name}_backtrace"] = repr(gdb_exc)
    row.data["failed"] = failed
    if "plain" not in got:
        raise RuntimeError(f"no baseline: {failed}")
    base = got["plain"]["ns_per_call"]["off"]
    wanted = {
        "no capture": ("plain", "off"),
        "shim, pass-through": ("pass", "off"),
        "shim, recording": ("shim", "off"),
        "shim, recording, device timing": ("device", "off"),
        "Python hook, Python kernel": ("plain", "hook"),
        "Python hook, C++ kernel": ("native", "hook"),
        "shim + hook (failslow run)": ("shim", "hook"),
        "shim + hook, device timing": ("device", "hook"),
    }
    lines = {k: got[v]["ns_per_call"][m] for k, (v, m) in wanted.items() if v in got}
    row.data["records"] = {k: [v.get("ring_records"), v.get("calls")] for k, v in got.items()}
    row.data.update(ns_per_call=lines, added_ns={k: v - base for k, v in lines.items()}, runs=got)
    row.result = ", ".join(
        f"{k}: {v - base:+.0f} ns" for k, v in lines.items() if k != "no capture"
    )
    row.result = f"no capture {base / 1e3:.1f} us/call; added: {row.result}"
    recorded = ", ".join(f"{k} {r}/{n}" for k, (r, n) in row.data["records"].items())
    row.result += f"; records/calls: {recorded}"
    native_ok = got.get("native", {}).get("native_hook") is True
    defers = got.get("shim", {}).get("hook_defers_nccl") is True or c.device != "cuda"
    row.verdict = "PASS" if native_ok and defers and not failed else "FAIL"
    if failed:
        row.result += "; failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
    if not native_ok:
        row.result += "; the C++ kernel did not load"
    if not defers:
        row.result += "; the hook did not defer NCCL calls to the shim"


def row_tracking(c: Check, row: Row) -> None:
    steps = "30" if c.quick else "150"
    pairs = 2 if c.quick else 4
    order = ["off", "on", "on", "off"] * (pairs // 2)
    step_s: dict[str, list[float]] = {"on": [], "off": []}
    cpu_s: dict[str, list[float]] = {"on": [], "off": []}
    records = []
    for i, mode in enumerate(order):
        prefix = None
        if mode == "on":
            prefix = [*CLI, "run", "--ring-dir", str(c.tmp / f"rings-gpt-{i}"), "--"]
        r = c.worker(
            "gpt",
            "--steps",
            steps,
            "--warmup",
            "8",
            "--rounds",
            "1",
            "--blocks",
            mode,
            timeout=240,
            prefix=prefix,
        )
        # --blocks X --rounds 1 runs the block twice (X, X): one figure per process
        step_s[mode].append(r["step_s"][mode])
        cpu_s[mode].append(r["cpu_s"][mode])
        if mode == "on":
            records.append(r["ring_records"])
        row.data.setdefault("params", r["params"])
    # pair k is the k-th on and the k-th off process, adjacent in time (off,on / on,off): a
    # machine's drift cancels within each pair
    ratios = [on / off - 1 for on, off in zip(step_s["on"], step_s["off"], strict=True)]
    overhead = statistics.mean(ratios)
    low, high = _bootstrap_mean(ratios)
    cpu = statistics.mean(cpu_s["on"]) / statistics.mean(cpu_s["off"]) - 1
    row.data.update(
        {
            "step_s": step_s,
            "cpu_s": cpu_s,
            "pair_overheads": ratios,
            "overhead": overhead,
            "overhead_95": [low, high],
            "cpu_overhead": cpu,
            "ring_records": records,
        }
    )
    per_step = min(records) / (2 * int(steps) + 8) if records else 0
    row.result = (
        f"{row.data['params'] / 1e6:.0f} M params, step "
        f"{1e3 * statistics.mean(step_s['off']):.1f} ms off / "
        f"{1e3 * statistics.mean(step_s['on']):.1f} ms on: wall {100 * overhead:+.2f}% "
        f"[95%: {100 * low:+.2f}, {100 * high:+.2f}] "
        f"(pairs {', '.join(f'{100 * x:+.2f}%' for x in ratios)}), CPU {100 * cpu:+.2f}%"
        f"; {per_step:.1f} records/step"
    )
    row.verdict = "PASS" if records and min(records) > 0 else "FAIL"
    if c.device != "cuda":
        row.verdict = "SKIP"


def row_gemm(c: Check, row: Row) -> None:
    r = c.worker("gemm", "--repeats", "5" if c.quick else "20", timeout=180)
    row.data = r
    spread = ", ".join(
        f"{d} {1e3 * v['median']:.2f} ms ({1e3 * v['min']:.2f}-{1e3 * v['max']:.2f})"
        for d, v in r["spread"].items()
    )
    row.result = (
        f"the controller's task {', '.join(r['first'])}: round "
        f"{1e3 * r['round_s']:.0f} ms; {spread}; beside a competing process "
        f"{r['slowdown']:.2f}x, named slow: {r['slowed_named'] == [3]}, healthy named: "
        f"{r['healthy_named'] or 'none'}; timed again before blame (the fastest of both): "
        f"{r['confirmed_slowdown']:.2f}x, still named: {r['confirmed_named'] == [3]}"
    )
    named = r["slowed_named"] == [3] and r["confirmed_named"] == [3]
    row.verdict = "PASS" if named and not r["healthy_named"] else "FAIL"
    if c.device != "cuda":
        row.verdict = "SKIP"


def row_snapshot(c: Check, row: Row) -> None:
    steps = "12" if c.quick else "40"
    r = c.worker(
        "gpt",
        "--steps",
        steps,
        "--warmup",
        "4",
        "--rounds",
        "1",
        "--blocks",
        "off,snapshot",
        "--snapshot",
        timeout=300,
    )
    row.data = r
    s = r["snapshot"]
    off, on = r["step_s"]["off"], r["step_s"]["snapshot"]
    added = on / off - 1
    row.data["added"] = added
    row.result = (
        f"{s['nbytes'] / 1e9:.2f} GB state; step {1e3 * off:.1f} -> {1e3 * on:.1f} ms "
        f"({100 * added:+.1f}%); training-thread stall {s['stall_ms_median']:.2f} ms "
        f"median ({s['stall_ms_max']:.1f} max); D2H copy {s['copy_s']:.3f} s "
        f"({s['copy_gb_s']:.1f} GB/s), seal {s['seal_s']:.2f} s; taken "
        f"{s['taken']}, skipped {s['skipped']}"
    )
    row.verdict = "PASS" if s["taken"] > 0 else "FAIL"
    if c.device != "cuda":
        row.verdict = "SKIP"


def row_stop_check(c: Check, row: Row) -> None:
    from failslow.core.control.stop import STOP_CHECKS, rank_result_path

    results = []
    for k in range(2):
        state = c.tmp / f"stop-{k}"
        state.mkdir()
        env = {
            "FAILSLOW_STOP_CHECK": json.dumps({"name": "gpu"}),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "FAILSLOW_STATE_DIR": str(state),
        }
        if c.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        done = c.run([PY, "-m", "failslow.runtime.stop_check"], env=env, what="stop check")
        path = rank_result_path(state, STOP_CHECKS, "gpu", 0)
        if done.returncode != 0 or not path.is_file():
            raise RuntimeError(f"stop check exited {done.returncode}, no result at {path}")
        results.append(json.loads(path.read_text()))
    row.data = {"runs": results}
    a, b = results
    same = a["digest"] == b["digest"]
    err = a["device"]["rel_error"]
    row.result = (
        f"on {a.get('on', '?')}: GEMM error {err:.1e} vs float64, "
        f"{1e3 * a['device']['seconds']:.2f} ms; digest the same twice: {same}; local "
        f"tests {a['local_s']:.1f} s"
    )
    ok = same and err < 1e-4 and (a.get("on", "").startswith("cuda") or c.device == "cpu")
    row.verdict = "PASS" if ok else "FAIL"


def row_megatron(c: Check, row: Row) -> None:
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        row.verdict, row.result = "SKIP", "megatron-core is not installed (run.sh carries .whl)"
        return
    r = c.worker("megatron", timeout=240)
    row.data = r
    same = r["after"] == r["again"] and r["max_param_diff"] == 0.0
    row.result = (
        f"megatron-core {r['megatron']} on {', '.join(r['devices'])}: step "
        f"{1e3 * r['step_s']:.0f} ms, losses {r['losses'][0]:.3f}->{r['losses'][-1]:.3f};"
        f" restored: {r['restored']}, the 3 steps after it repeat bit for bit: {same} "
        f"(max param diff {r['max_param_diff']:.1e})"
    )
    on_gpu = all(d.startswith("cuda") for d in r["devices"]) or c.device == "cpu"
    row.verdict = "PASS" if same and r["restored"] and on_gpu else "FAIL"


def row_tests(c: Check, row: Row) -> None:
    done = c.run(
        [
            PY,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "tests/gpu",
            "tests/core/localize/validation/test_gemm.py",
        ],
        timeout=300,
        what="pytest -m gpu",
    )
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    row.result = last.strip("= ")
    row.data = {"returncode": done.returncode, "summary": last}
    row.verdict = "PASS" if done.returncode == 0 and "passed" in last else "FAIL"
    if c.device != "cuda" and done.returncode == 0:
        row.verdict = "SKIP"


ROWS: list[tuple[str, Callable[[Check, Row], None]]] = [
    ("failslow doctor vs torch's libnccl", row_doctor),
    ("NCCL job under failslow run: rings", row_job),
    ("cost per NCCL call", row_calls),
    ("tracking overhead, GPT step", row_tracking),
    ("GEMM validation", row_gemm),
    ("every-step snapshot", row_snapshot),
    ("stop-time device checks", row_stop_check),
    ("Megatron-core GPTModel + attach", row_megatron),
    ("pytest -m gpu", row_tests),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats (~5 min)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check")
    ap.add_argument("--rows", help="comma-separated row numbers (default: all)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    wanted = {int(x) for x in args.rows.split(",")} if args.rows else None
    check = Check(out, args.device, args.quick)
    console = Console(width=160)
    rows: list[Row] = []
    for number, (what, fn) in enumerate(ROWS, 1):
        if wanted and number not in wanted:
            continue
        row = Row(number, what)
        started = time.perf_counter()
        console.print(f"[bold]{number}. {what}[/] ...")
        try:
            fn(check, row)
        except Exception as exc:  # the row fails, the check goes on
            row.verdict, row.result = "FAIL", f"{type(exc).__name__}: {exc}"
        row.seconds = time.perf_counter() - started
        console.print(f"   {row.verdict} ({row.seconds:.0f} s): {row.result}")
        rows.append(row)
        (out / "results.json").write_text(json.dumps([vars(r) for r in rows], indent=1))
    table = Table(
        title=f"failslow GPU check ({'quick' if args.quick else 'full'}, {_machine()})",
        show_lines=True,
    )
    for col in ("#", "row", "verdict", "s", "measured"):
        table.add_column(col, justify="right" if col in ("#", "s") else "left")
    for r in rows:
        table.add_row(str(r.number), r.what, r.verdict, f"{r.seconds:.0f}", r.result)
    console.print(table)
    with open(out / "table.txt", "w") as fh:
        Console(file=fh, width=160).print(table)
    return 0 if all(r.verdict != "FAIL" for r in rows) else 1


def _machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        return f"CPU, torch {torch.__version__}"
    except Exception:
        return "torch not importable"


if __name__ == "__main__":
    raise SystemExit(main())
