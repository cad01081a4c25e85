"""``failslow top --store URL``: a running job, live, from its control store (``observe/``).

For someone who attaches to a job they did not start: the viewer needs only the store's URL, no
job token, and never writes to the store. Each frame reads:

- ``failslow/status`` (:class:`~failslow.core.control.journal.StatusBoard`): controller state,
  diagnoses, the plan in effect, the last action, the newest step;
- ``failslow/job`` (rank 0's job record: topology, capabilities, world size), at most every
  :data:`JOB_EVERY_S` (it holds every role's host, O(world) bytes, and changes only on a
  topology swap);
- ``failslow/steps`` (rank 0's recent step times);
- ``failslow/node/ranks/{rank}`` (each rank's tracker state, :mod:`failslow.node.publisher`).

Rank records cost one read each. Up to :data:`FULL_READ_MAX` ranks every frame reads all of
them. Above that a frame reads at most :data:`SAMPLE_READS` records: first the ranks that
matter - those named by the last diagnosis, those whose latest onset (the node publishers'
``failslow/node/onsets/{n}``, read incrementally, at most :data:`RECENT_ONSETS` new ones a frame)
is not relieved, and the previous frame's K slowest - then every ``stride``-th rank from a phase
that advances by one each frame, so successive frames sweep the whole job (every rank is read
once per ``ceil(world / sample)`` frames). The viewer keeps the newest record it read of each
rank; the table and the aggregate (median, p99, max of ``median_s``, ranks flagged slow, and
transients - slowdowns each rank's detector verified that were over before they persisted, so
no fail-slow and no validation pause, issue 47) are over those, and the aggregate says how many
ranks that is. ``--once`` reads one such frame.

:mod:`.top_view` draws a frame; ``--once --json`` prints the same frame as one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from failslow.core.control import keys
from failslow.core.control.store import (
    Store,
    StoreUnavailable,
    first_line,
    open_store,
    parse_store_url,
)
from failslow.core.control.store import redacted as redacted_url
from failslow.core.topology import Topology
from failslow.errors import ConfigError, FailslowError

CONNECT_S = 10.0
"""Bound on connecting to the store and on every read."""
FULL_READ_MAX = 256
"""Up to this world size every frame reads every rank's record."""
SAMPLE_READS = 256
"""Rank records read per frame above :data:`FULL_READ_MAX` (at most half of them pinned)."""
RECENT_ONSETS = 64
"""Onset records read per frame at most (the newest), to pin ranks that are slow right now."""
JOB_EVERY_S = 30.0
"""How often the job record is read again."""
RANK_PREFIX = f"{keys.NODE}/ranks/"
ONSETS = f"{keys.NODE}/onsets"


@dataclass
class TopOptions:
    store_url: str
    once: bool = False
    as_json: bool = False
    interval_s: float = 2.0
    ranks: int = 16


def _check(options: TopOptions) -> None:
    if options.as_json and not options.once:
        raise ConfigError("failslow top: --json needs --once (one JSON object, then exit)")
    if not (math.isfinite(options.interval_s) and options.interval_s > 0):
        raise ConfigError(f"failslow top: --interval must be > 0 seconds, got {options.interval_s}")
    if options.ranks < 1:
        raise ConfigError(f"failslow top: --ranks must be >= 1, got {options.ranks}")
    _scheme, _host, _port, query, _db = parse_store_url(options.store_url)
    if query.get("master") == "1":
        raise ConfigError(
            f"failslow top: {redacted_url(options.store_url)!r} would host a new, empty store; "
            "give the job's store as tcp://HOST:PORT"
        )


MALFORMED = (TypeError, ValueError, KeyError, AttributeError, IndexError)
"""What reading or drawing a record that is not as failslow writes it raises."""


def malformed(url: str, exc: BaseException) -> FailslowError:
    """The one-line error for a record of another shape (anyone who reaches the store writes)."""
    return FailslowError(
        f"control store {url}: a record is not as failslow writes it "
        f"({type(exc).__name__}: {first_line(exc, 120)})"
    )


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _rank_record(raw: Any, rank: int) -> dict[str, Any] | None:
    """A rank record as the publisher writes it, or None when it is not one."""
    if not isinstance(raw, dict):
        return None
    median, last = _number(raw.get("median_s")), _number(raw.get("last_s"))
    if median is None or last is None:
        return None
    return {
        "rank": rank,
        "iterations": int(_number(raw.get("iterations")) or 0),
        "last_s": last,
        "median_s": median,
        "slow": bool(raw.get("slow", False)),
        "transients": max(int(_number(raw.get("transients")) or 0), 0),
        "wall": _number(raw.get("wall")),
    }


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


class TopReader:
    """Reads frames of one job from ``store``; keeps what it read of each rank between frames."""

    def __init__(self, store: Store, *, ranks: int, url: str) -> None:
        self.store = store
        self.k = ranks
        self.url = redacted_url(url)
        self.records: dict[int, dict[str, Any]] = {}
        """The newest record read of each rank."""
        self._phase = 0
        self._slowest: list[int] = []
        self._onsets_seen = 0
        self._onset_type: dict[int, str] = {}
        self._job: dict[str, Any] | None = None
        self._job_summary: dict[str, Any] | None = None
        self._job_read_at = -math.inf

    # ---- reads ------------------------------------------------------------------------------
    def _json(self, key: str) -> Any:
        try:
            return self.store.get_json(key)
        except ValueError:
            raise FailslowError(f"control store {self.url}: {key} is not JSON") from None

    def _counter(self, key: str) -> int:
        raw = self.store.get(key)  # never add(key, 0): that registers the key, a write
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def _job_record(self, now: float) -> dict[str, Any] | None:
        if self._job is None or now - self._job_read_at >= JOB_EVERY_S:
            job = self._json(keys.JOB)
            self._job_read_at = now
            if job != self._job:
                self._job, self._job_summary = job, _job_summary(job) if job else None
        return self._job_summary

    def _diagnoses(self, status: dict[str, Any] | None) -> tuple[int, dict[str, Any] | None]:
        if status is not None:
            return int(status.get("diagnoses") or 0), status.get("last_diagnosis")
        count = self._counter(keys.DIAGNOSES)
        last = self._json(f"{keys.DIAGNOSES}/{count}") if count else None
        if isinstance(last, dict):
            last.pop("evidence", None)
        return count, last

    def _unrelieved(self) -> list[int]:
        """Ranks whose newest onset record is an onset, from the records new since last frame."""
        count = self._counter(ONSETS)
        for n in range(max(self._onsets_seen + 1, count - RECENT_ONSETS + 1), count + 1):
            record = self._json(f"{ONSETS}/{n}")
            if isinstance(record, dict) and isinstance(record.get("rank"), int):
                self._onset_type[record["rank"]] = str(record.get("type"))
        self._onsets_seen = count
        return sorted(r for r, kind in self._onset_type.items() if kind == "onset")

    def _to_read(self, world: int, diagnosis: dict[str, Any] | None) -> list[int]:
        if world <= FULL_READ_MAX:
            return list(range(world))
        pinned: dict[int, None] = {}
        named = [s[0] for s in (diagnosis or {}).get("slow_ranks", [])]
        named += [r for link in (diagnosis or {}).get("slow_links", []) for r in link[:2]]
        for rank in [*named, *self._unrelieved(), *self._slowest]:
            if isinstance(rank, int) and 0 <= rank < world and len(pinned) < SAMPLE_READS // 2:
                pinned[rank] = None
        stride = math.ceil(world / (SAMPLE_READS - len(pinned)))
        self._phase = (self._phase + 1) % stride
        sweep = (r for r in range(self._phase, world, stride) if r not in pinned)
        return [*pinned, *sweep]

    def _read_ranks(self, ranks: list[int], world: int) -> int:
        if world <= FULL_READ_MAX:
            self.records = {}
        for rank in [r for r in self.records if r >= world]:
            del self.records[rank]
        for rank in ranks:
            try:
                record = _rank_record(self._json(f"{RANK_PREFIX}{rank}"), rank)
            except FailslowError:
                record = None
            if record is None:
                self.records.pop(rank, None)
            else:
                self.records[rank] = record
        return len(ranks)

    # ---- one frame ----------------------------------------------------------------------------
    def frame(self) -> dict[str, Any]:
        """Everything one view shows, JSON-able (what ``--once --json`` prints)."""
        try:
            return self._frame()
        except MALFORMED as exc:
            raise malformed(self.url, exc) from None

    def _frame(self) -> dict[str, Any]:
        now = time.time()
        status = self._json(keys.STATUS)
        status = status if isinstance(status, dict) else None
        job = self._job_record(now)
        frame: dict[str, Any] = {
            "store": self.url,
            "wall": now,
            "waiting": status is None and job is None,
            "job": job,
            "status": status,
            "diagnoses": {"count": 0, "last": None},
            "steps": [],
            "ranks": [],
            "aggregate": None,
        }
        if frame["waiting"]:
            return frame
        world = int((status or {}).get("world_size") or (job or {}).get("world_size") or 0)
        count, last = self._diagnoses(status)
        frame["diagnoses"] = {"count": count, "last": last}
        steps = self._json(keys.STEPS)
        if isinstance(steps, dict) and isinstance(steps.get("steps"), list):
            frame["steps"] = steps["steps"][-20:]
        read = self._read_ranks(self._to_read(world, last), world)
        frame["ranks"], frame["aggregate"] = self._summary(world, read, now)
        return frame

    def _summary(
        self, world: int, read: int, now: float
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        known = list(self.records.values())
        medians = sorted(r["median_s"] for r in known)
        middle = statistics.median(medians) if medians else None
        slowest = sorted(known, key=lambda r: (-r["median_s"], r["rank"]))[: self.k]
        self._slowest = [r["rank"] for r in slowest]
        rows = [
            {
                **{k: v for k, v in r.items() if k != "wall"},
                "x_median": r["median_s"] / middle if middle else None,
                "age_s": None if r["wall"] is None else max(now - r["wall"], 0.0),
            }
            for r in slowest
        ]
        aggregate = {
            "world_size": world,
            "sampled": world > FULL_READ_MAX,
            "read": read,
            "reporting": len(known),
            "median_s": middle,
            "p99_s": _percentile(medians, 0.99) if medians else None,
            "max_s": medians[-1] if medians else None,
            "slow": sum(r["slow"] for r in known),
            "transients": sum(r["transients"] for r in known),
        }
        return rows, aggregate


def _job_summary(job: Any) -> dict[str, Any]:
    """World size, layout, hosts, framework and capabilities of a job record."""
    if not isinstance(job, dict):
        raise FailslowError(f"{keys.JOB}: expected a JSON object, got {type(job).__name__}")
    summary: dict[str, Any] = {
        "world_size": job.get("world_size"),
        "framework": job.get("framework"),
        "capabilities": job.get("capabilities") or {},
    }
    if job.get("topology"):
        try:
            topology = Topology.from_dict(job["topology"])
        except ConfigError as exc:  # its message holds the whole record: O(world)
            raise FailslowError(f"{keys.JOB}: {first_line(exc)}") from None
        summary.update(
            tp=topology.tp,
            pp=topology.pp,
            dp=topology.dp,
            hosts=len(set(topology.hosts)),
            micro_batches=topology.micro_batches,
        )
        summary["world_size"] = summary["world_size"] or topology.world_size
    return summary


def run_top(options: TopOptions) -> int:
    """Show the job in ``options.store_url``; the exit status. A user error (bad URL, a store
    that cannot be reached within :data:`CONNECT_S`) raises a one-line FailslowError."""
    _check(options)
    # The viewer's own process: torch's C++ warning for a broken connection (a stack trace)
    # would scribble over the view, which shows the error itself. Read when torch loads.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        store = connect(options.store_url)
    except KeyboardInterrupt:
        if options.once:
            raise
        return 0
    reader = TopReader(store, ranks=options.ranks, url=options.store_url)
    try:
        if options.once:
            frame = reader.frame()
            if options.as_json:
                print(json.dumps(frame, sort_keys=True))
            else:
                from failslow.observe.top_view import print_frame

                print_frame(frame)
            return 0
        from failslow.observe.top_view import watch

        try:
            watch(reader, options.interval_s, lambda: _reopen(reader, options.store_url))
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        reader.store.close()


def _reopen(reader: TopReader, url: str) -> None:
    """After the store failed: a new connection (StoreUnavailable while it is still down)."""
    try:
        reader.store.close()
    except StoreUnavailable:
        pass
    reader.store = connect(url)


def connect(url: str) -> Store:
    """``open_store(url)`` with a bounded connect (:data:`CONNECT_S`; a port that accepts and
    never answers is given up on by the store's own connect)."""
    return open_store(url, timeout_s=CONNECT_S)
