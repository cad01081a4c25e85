"""Several nodes, one job: ``failslow run --nproc-per-node N --nnodes M --node-rank K`` on each
node's launcher, and every launch of the job's ranks agreed through the job's control store
(byterobust 6.2-6.3: a fail-stop anywhere restarts every rank from memory, and warm standbys
are per machine).

Each node's launcher starts its own ``N`` ranks from warm processes (:mod:`failslow.node.ranks`):
node ``K``'s local rank ``i`` is the job's rank ``K * N + i``, in a world of ``M * N``. What the
launchers must agree on goes through the store the job already has (``--store``), under
:data:`failslow.core.control.keys.NODES`:

- **the run**: each launcher adds one to ``{NODES}/joined`` as it starts; the ``j``-th join
  belongs to run ``(j - 1) // M``, so a store that served an earlier run of the job (a Redis
  server) keeps that run's keys apart - the launchers of one run must all start before the
  next run's do (as with torchrun's rendezvous id, one store per job run is the simple rule);
- **each launch's rendezvous** (``{NODES}/run{r}/launch{g}/master``): node 0's launcher hosts a
  fresh TCPStore for launch ``g`` on ``--node-addr`` and writes its address; the other nodes
  wait for it (``rdzv_timeout_s``) and count themselves in (``.../joined``), and node 0 starts
  its own ranks once every node has - a node that does not come back ends the job with one
  line after ``rdzv_timeout_s``, not with ranks waiting for the collective timeout. The ranks
  use it as torchrun's agent store, so ``init_process_group("env://")`` works unchanged. Every
  launcher counts its launches the same way (they end together), so ``g`` is the same on every
  node;
- **each launch's version** (``.../launch{g}/version``): the command, environment changes and
  code directory node 0's agent launches with (:class:`failslow.node.hot_update.version.
  Version`): hot updates are submitted to node 0's launcher, whose stop plan stops every
  node's ranks at one step (the job's plan channel), and every node relaunches at node 0's
  version; a rollback is node 0's too. The code directory must exist on every node;
- **who failed** (``{NODES}/run{r}/launch{g}/stop``): the node that sees one of its ranks
  fail claims the launch's stop with compare-and-set (``{"node", "rank", "status", "at"}``);
  the other launchers read that key at every tick of their rank group (one ``get``, O(1) per
  node, never O(world)) and release their own ranks. A peer's ranks then fail too - their
  gloo collectives raise when the connection resets - and those failures are consequences,
  not fail-stops. So a rank killed by a signal (a crash, SIGKILL, the OOM killer) claims at
  once, while a rank that exited with a status is held until ``settle_s`` after it failed
  (its exception's time, from the record the runtime's exception hook leaves,
  :mod:`failslow.runtime.crash_record`; else when it was seen) and is a consequence if a
  claim names a killed rank or one that failed no later than it. The stop then names the rank
  that really failed although its launcher looked last (a loaded machine; within
  ``settle_s``), only its slot is evicted (onto its node's standby, else in place), and every
  node relaunches; the agents count the same failure on every node, so ``--max-restarts``
  runs out on all of them together. A store that is away leaves each node its own view (what
  one node alone would decide) until the next launch, whose rendezvous needs it.

- **stack aggregation** (``{NODES}/run{r}/launch{g}/look...``, :mod:`failslow.node.
  stack_exchange`): a hung job's ranks stop committing collectives on every node, but one
  node's ranks all wait alike, so no node can name the stuck one from its own stacks - nor an
  unexplained slowdown's degrader. Node 0's hang watch (once its ranks were quiet for
  ``--hang-after``) or decline watch opens a look; every other node answers with its ranks'
  stacks; node 0 aggregates the union with the job's topology and publishes the verdict. The
  nodes holding the named ranks evict them and claim the launch's stop; the others' ranks are
  released by that claim, as after any fail-stop.

- **the stop-time ladder** (``{NODES}/run{r}/launch{g}/incident/node{k}``, ``.../rung``,
  :mod:`failslow.node.incidents`): a rank whose metrics went bad exits with a rollback request,
  and its node claims the launch's stop for it (cause ``incident``), so the other nodes'
  ranks are released as consequences, not fail-stops. After the launch every node reports its
  ranks' requests (maybe none) and node 0 takes the rung for the whole job - the stop-time
  checks, reattempt, roll back node 0's latest code update, a person - which every node carries
  out: one ladder, so the nodes restart from the same step at the same version, or stop
  together. The checks are one world of every node's machines (its rendezvous at
  ``.../check/master``); each node reports its machines' results (``.../check/node{k}``), node
  0 publishes the verdict (``.../check/verdict``) and then the rung after it
  (``.../rungchecks``).

A launcher gives up with one line naming the node when a rendezvous does not come in time (a
node that is gone: membership changes are not handled yet - the job needs a person).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from failslow.core.control import keys
from failslow.errors import ConfigError, FailslowError


@dataclass(kw_only=True, slots=True)
class NodeOptions:
    """Where this node is in the job (``--nnodes``, ``--node-rank``, ``--node-addr``)."""

    nnodes: int
    node_rank: int
    addr: str = "127.0.0.1"
    """The address the other nodes' ranks reach this node's rendezvous store at (node 0)."""
    rdzv_timeout_s: float = 600.0
    """How long a node waits for node 0's rendezvous of a launch."""
    settle_s: float = 3.0
    """How long after it failed a rank that exited with a status waits for another node's
    claim (a rank's exit after an exception takes a while with torch loaded: 1 s was too short
    beside a CPU hog)."""
    check_every_s: float = 0.1
    """How often a running launch reads whether another node stopped it (one store read)."""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be between 0 and --nnodes - 1 ({self.nnodes - 1}), "
                f"got {self.node_rank}"
            )


@dataclass(slots=True)
class NodeGroup:
    """This node's side of the protocol (module docstring) over the job's control ``store``."""

    options: NodeOptions
    store: Any
    say: Callable[[str], None] = print
    run: int | None = None
    """This run's index (:meth:`join`)."""
    _warned: set[str] = field(default_factory=set)

    @property
    def node_rank(self) -> int:
        return self.options.node_rank

    def join(self) -> int:
        """Count this launcher into the job's current run; its index."""
        try:
            joined = int(self.store.add(f"{keys.NODES}/joined", 1))
        except FailslowError as exc:
            raise FailslowError(f"node {self.node_rank} cannot join the job: {exc}") from None
        self.run = (joined - 1) // self.options.nnodes
        return self.run

    def _key(self, launch: int, what: str) -> str:
        if self.run is None:
            self.join()
        return f"{keys.NODES}/run{self.run}/launch{launch}/{what}"

    def rendezvous(
        self, launch: int, host: Callable[[str], Any], what: str = ""
    ) -> tuple[Any, str, int]:
        """Launch ``launch``'s rendezvous store (``what``: of another world of every node's
        slots after it, the stop-time checks' ``check/``): node 0 hosts it (``host(addr)``
        returns the store) and publishes where; every other node waits for that. ``(store or
        None, address, port)``."""
        from failslow.node.control import port_of

        key, joined = self._key(launch, f"{what}master"), self._key(launch, f"{what}joined")
        timeout = self.options.rdzv_timeout_s
        if self.node_rank == 0:
            store = host(self.options.addr)
            port = port_of(store)
            self.store.set_json(key, {"addr": self.options.addr, "port": port,
                                      "wall": time.time()})  # fmt: skip
            self.store.add(joined, 1)
            # every node's ranks start for this launch, or none: ranks that started alone would
            # wait in their rendezvous for the collective timeout (30 minutes with gloo)
            deadline = time.monotonic() + timeout
            while (n := int(self.store.add(joined, 0))) < self.options.nnodes:
                if time.monotonic() > deadline:
                    store.close()
                    raise FailslowError(
                        f"node 0: {self.options.nnodes - n} of the other nodes did not join "
                        f"launch {launch} within {timeout:g} s (their launchers are gone, or "
                        "use another --store): the job needs a person"
                    )
                time.sleep(0.05)
            return store, self.options.addr, port
        if not self.store.wait([key], timeout):
            raise FailslowError(
                f"node {self.node_rank}: node 0 did not start launch {launch} within "
                f"{timeout:g} s (is its launcher running, with the same --store?)"
            )
        record = self.store.get_json(key)
        self.store.add(joined, 1)
        return None, str(record["addr"]), int(record["port"])

    def version(self, launch: int, version: dict[str, Any]) -> dict[str, Any]:
        """The version every node runs launch ``launch`` at: node 0's (its hot updates and
        rollbacks, :mod:`failslow.node.hot_update`), which node 0 publishes and the other
        nodes wait for (``rdzv_timeout_s``) - ``version`` is this node's own."""
        key = self._key(launch, "version")
        if self.node_rank == 0:
            self.store.set_json(key, version)
            return version
        if not self.store.wait([key], self.options.rdzv_timeout_s):
            raise FailslowError(
                f"node {self.node_rank}: node 0 did not start launch {launch} within "
                f"{self.options.rdzv_timeout_s:g} s (is its launcher running, with the same "
                "--store?)"
            )
        return self.store.get_json(key)  # type: ignore[no-any-return]

    def stopped(self, launch: int) -> dict[str, Any] | None:
        """The launch's stop as claimed by any node (None: none yet, or the store is away)."""
        try:
            return self.store.get_json(self._key(launch, "stop"))  # type: ignore[no-any-return]
        except (FailslowError, ValueError) as exc:
            self._warn("read", exc)
            return None

    def claim(self, launch: int, record: dict[str, Any]) -> dict[str, Any]:
        """Claim the launch's stop for ``record`` (one of this node's failed ranks): the stop
        that holds - this one, or another node's that came first."""
        claim = {**record, "node": self.node_rank}
        key = self._key(launch, "stop")
        raw = json.dumps(claim, sort_keys=True).encode()
        try:
            if self.store.compare_set(key, None, raw):
                return claim
            held = self.store.get_json(key)
        except (FailslowError, ValueError) as exc:
            self._warn("claim", exc)
            return claim  # no store: this node's own view is all there is
        return held if isinstance(held, dict) else claim

    def _warn(self, action: str, exc: Exception) -> None:
        if action not in self._warned:
            self._warned.add(action)
            self.say(f"node {self.node_rank}: cannot {action} the launch's stop ({exc})")

    # -- stack aggregation across the nodes (node 0 asks and decides, :mod:`.stack_exchange`) --
    def looks(self, launch: int) -> int:
        """How many looks node 0 opened in this launch (one store read)."""
        return int(self.store.add(self._key(launch, "look/count"), 0))

    def open_look(self, launch: int, what: dict[str, Any]) -> int:
        """Node 0 (the counter's only writer) opens the next look for ``what``; its number."""
        look = self.looks(launch) + 1
        self.store.set_json(self._key(launch, f"look{look}"), what)
        return int(self.store.add(self._key(launch, "look/count"), 1))

    def look(self, launch: int, look: int) -> dict[str, Any] | None:
        got = self.store.get_json(self._key(launch, f"look{look}"))
        return got if isinstance(got, dict) else None

    def answer_look(self, launch: int, look: int, answer: dict[str, Any]) -> None:
        self.store.set_json(self._key(launch, f"look{look}/node{self.node_rank}"), answer)

    def look_answers(self, launch: int, look: int, timeout_s: float) -> dict[int, dict[str, Any]]:
        """The other nodes' answers to ``look`` that came within ``timeout_s``, by node."""
        return self._answers(launch, f"look{look}", timeout_s)

    def _answers(self, launch: int, what: str, timeout_s: float) -> dict[int, dict[str, Any]]:
        """What the other nodes wrote at ``what/node<k>`` within ``timeout_s``, by node."""
        names = {k: self._key(launch, f"{what}/node{k}") for k in range(1, self.options.nnodes)}
        self.store.wait(list(names.values()), timeout_s)
        got = {k: self.store.get_json(key) for k, key in names.items()}
        return {k: a for k, a in got.items() if isinstance(a, dict)}

    def decide_look(self, launch: int, look: int, verdict: dict[str, Any]) -> None:
        self.store.set_json(self._key(launch, f"look{look}/verdict"), verdict)

    def look_verdict(self, launch: int, look: int) -> dict[str, Any] | None:
        got = self.store.get_json(self._key(launch, f"look{look}/verdict"))
        return got if isinstance(got, dict) else None

    # -- the stop-time ladder across the nodes (node 0 decides: .incidents, .stop_checks) -------
    def report(self, launch: int, what: str, record: dict[str, Any]) -> None:
        """This node's ``record`` of ``what`` after launch ``launch`` (its ranks' rollback
        requests, its machines' check results), for node 0 (:meth:`reports`)."""
        self.store.set_json(self._key(launch, f"{what}/node{self.node_rank}"), record)

    def reports(self, launch: int, what: str, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Node 0: the other nodes' records of ``what`` that came within ``timeout_s``, by node
        (a node missing from it did not report)."""
        return self._answers(launch, what, timeout_s)

    def decide(self, launch: int, what: str, decision: dict[str, Any] | None) -> None:
        """Node 0: what every node takes for ``what`` after launch ``launch`` (a rung, None:
        none; the checks' verdict)."""
        self.store.set_json(self._key(launch, what), {"decision": decision})

    def decision(
        self, launch: int, what: str, timeout_s: float
    ) -> tuple[bool, dict[str, Any] | None]:
        """Node 0's decision of ``what`` after launch ``launch``: ``(came within timeout_s, the
        decision or None)``."""
        key = self._key(launch, what)
        if not self.store.wait([key], timeout_s):
            return False, None
        got = self.store.get_json(key)
        decision = got.get("decision") if isinstance(got, dict) else None
        return True, decision if isinstance(decision, dict) else None
