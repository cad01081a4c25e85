"""Trace files: reading iteration-time CSVs and collective-event JSONL logs, and exporting rings.

Two formats are accepted by ``failslow analyze`` (greyhound 4.2 works from either the
iteration times themselves or the collective calls they are derived from):

* CSV with a header row containing ``iteration_time_s`` (other columns are ignored);
* JSONL, one object per line with ``rank``, ``op``, ``group``, ``nbytes``, ``t_start_ns``,
  ``t_end_ns`` (other keys are ignored). ``op`` is a name such as ``"allreduce"``; ``group`` is
  a string (``"0x..."`` hex keys as written by :func:`export_rings`, or any other name).

Every parse error names the file, the line and what was expected.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from failslow.core.events import RECORD_DTYPE, Flags, OpCode, Source, _enum_or_unknown, group_key
from failslow.core.group_files import read_groups
from failslow.core.ring import RingFormatError, RingReader, find_rings
from failslow.errors import TraceFormatError

JSONL_KEYS = ("rank", "op", "group", "nbytes", "t_start_ns", "t_end_ns")


@dataclass
class Trace:
    """What one trace file holds: iteration times, or per-rank collective records."""

    path: str
    iteration_times: np.ndarray | None = None  # seconds, CSV traces
    records_by_rank: dict[int, np.ndarray] = field(default_factory=dict)  # JSONL traces

    @property
    def kind(self) -> str:
        return "iterations" if self.iteration_times is not None else "events"


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a CSV or JSONL trace; raises TraceFormatError naming the file and line."""
    name = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceFormatError(name, f"cannot read file ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise TraceFormatError(name, "not a text file (expected CSV or JSONL)") from None
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not first:
        raise TraceFormatError(name, "empty file (expected CSV or JSONL)")
    if first.startswith("{"):
        return Trace(name, records_by_rank=_read_jsonl(name, io.StringIO(text)))
    return Trace(name, iteration_times=_read_csv(name, io.StringIO(text)))


def _read_csv(name: str, fh: TextIO) -> np.ndarray:
    reader = csv.reader(fh)
    header: list[str] | None = None
    line = 0
    for row in reader:
        line = reader.line_num
        if any(cell.strip() for cell in row):
            header = [cell.strip() for cell in row]
            break
    if header is None or "iteration_time_s" not in header:
        raise TraceFormatError(
            name, f"expected a CSV header with an 'iteration_time_s' column, got {header}", line
        )
    col = header.index("iteration_time_s")
    values: list[float] = []
    for row in reader:
        line = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if col >= len(row):
            raise TraceFormatError(name, f"expected {len(header)} columns, got {len(row)}", line)
        cell = row[col].strip()
        try:
            value = float(cell)
        except ValueError:
            raise TraceFormatError(
                name, f"expected a number in 'iteration_time_s', got {cell!r}", line
            ) from None
        if not math.isfinite(value) or value <= 0:
            raise TraceFormatError(
                name, f"expected a positive finite 'iteration_time_s', got {cell!r}", line
            )
        values.append(value)
    if not values:
        raise TraceFormatError(name, "no data rows after the header")
    return np.asarray(values, dtype=np.float64)


def _int_field(name: str, line: int, obj: dict[str, Any], key: str, minimum: int | None) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(name, f"expected an integer '{key}', got {value!r}", line)
    if minimum is not None and value < minimum:
        raise TraceFormatError(name, f"expected '{key}' >= {minimum}, got {value}", line)
    return value


def parse_group(value: Any) -> int:
    """The ring's group key for a JSONL ``group`` value (hex keys round-trip exactly)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & ((1 << 63) - 1)
    text = str(value)
    if text.startswith("0x"):
        try:
            return int(text, 16)
        except ValueError:
            pass
    return group_key(text, [])


def _read_jsonl(name: str, fh: TextIO) -> dict[int, np.ndarray]:
    rows: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for line, raw in enumerate(fh, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(name, f"expected a JSON object ({exc.msg})", line) from None
        if not isinstance(obj, dict):
            raise TraceFormatError(name, f"expected a JSON object, got {type(obj).__name__}", line)
        missing = [k for k in JSONL_KEYS if k not in obj]
        if missing:
            raise TraceFormatError(
                name, f"expected keys {', '.join(JSONL_KEYS)}; missing {', '.join(missing)}", line
            )
        rank = _int_field(name, line, obj, "rank", 0)
        nbytes = _int_field(name, line, obj, "nbytes", 0)
        t_start = _int_field(name, line, obj, "t_start_ns", None)
        t_end = _int_field(name, line, obj, "t_end_ns", None)
        if t_end and t_end < t_start:
            raise TraceFormatError(name, f"expected t_end_ns >= t_start_ns, got {t_end}", line)
        try:
            op = OpCode.parse(str(obj["op"]))
        except ValueError as exc:
            raise TraceFormatError(name, str(exc), line) from None
        key = parse_group(obj["group"])
        rows[rank].append((t_start, t_end, nbytes, key, int(op), int(obj.get("peer", -1))))
    if not rows:
        raise TraceFormatError(name, "no events")
    out: dict[int, np.ndarray] = {}
    for rank, items in sorted(rows.items()):
        arr = np.zeros(len(items), dtype=RECORD_DTYPE)
        data = np.asarray(items, dtype=np.int64)
        arr["commit"] = np.arange(1, len(items) + 1)
        arr["t_start_ns"], arr["t_end_ns"], arr["nbytes"] = data[:, 0], data[:, 1], data[:, 2]
        arr["group_key"], arr["op"], arr["peer"] = data[:, 3], data[:, 4], data[:, 5]
        out[rank] = arr[np.argsort(arr["t_start_ns"], kind="stable")]
    return out


def iter_ring_rows(ring_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """JSONL rows (the format ``read_trace`` accepts) for every record in a run's rings."""
    rings = find_rings(ring_dir)
    if not rings:
        raise TraceFormatError(str(ring_dir), "no ring files (rank*-pid*.ring) in this directory")
    for ring in rings:
        try:
            reader = RingReader(ring)
        except RingFormatError as exc:
            raise TraceFormatError(str(ring), str(exc)) from None
        try:
            groups = read_groups(ring)
            rank = reader.global_rank
            records = reader.poll()
            for r in records:
                key = int(r["group_key"])
                row: dict[str, Any] = {
                    "rank": rank,
                    "op": _enum_or_unknown(OpCode, int(r["op"])).label,
                    "group": f"{key:#x}",
                    "nbytes": int(r["nbytes"]),
                    "t_start_ns": int(r["t_start_ns"]),
                    "t_end_ns": int(r["t_end_ns"]),
                    "peer": int(r["peer"]),
                    "call_index": int(r["call_index"]),
                    "source": _enum_or_unknown(Source, int(r["source"])).name.lower(),
                    # what t_end_ns is: the device's completion (CUDA events) or the call's return
                    "end": "enqueue" if int(r["flags"]) & Flags.END_IS_ENQUEUE else "complete",
                }
                info = groups.get(key)
                if info is not None:
                    row["group_ranks"] = list(info.ranks)
                yield row
            dropped = reader.dropped + reader.writer_dropped
            if dropped:
                yield {"rank": rank, "dropped": dropped}
        finally:
            reader.close()


def export_rings(ring_dir: str | os.PathLike[str], out: TextIO) -> tuple[int, int]:
    """Write every ring record of a run as JSONL; returns (records written, records lost)."""
    written = lost = 0
    for row in iter_ring_rows(ring_dir):
        if "dropped" in row:
            lost += int(row["dropped"])
            continue
        out.write(json.dumps(row, separators=(",", ":")) + "\n")
        written += 1
    return written, lost
