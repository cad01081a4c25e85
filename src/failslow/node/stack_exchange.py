"""Stack aggregation across the nodes of one job (byterobust 5.1; issue 18): at byterobust's
scale the capture runs on every node at once, each node dumping its own ranks, and one place
aggregates.

One node's stacks cannot name anyone when the outlier is elsewhere: in a hang every rank of a
node waits alike while the stuck rank is on another node, and an unexplained slowdown's rounds
need every rank's stacks of the same moment. So node 0's watch (:mod:`failslow.node.hang`,
:mod:`failslow.node.decline`) *asks*: it opens look ``n``; every other node answers with how long
its ranks have been quiet and, if the look wants them, their stacks (py-spy,
:mod:`failslow.node.stacks`); node 0 aggregates the union with the job's topology and *decides*:
the verdict names the ranks to evict (maybe none). Each node evicts the named ranks it holds
and claims the launch's stop (:meth:`failslow.node.rank_group.RankGroup.hang`); the other nodes
are released by that claim, as after any fail-stop.

The keys live under the launch's (:class:`failslow.node.nodes.NodeGroup`): ``look/count`` (only
node 0 adds to it), ``look{n}`` (what the look is for), ``look{n}/node{k}`` (the answers),
``look{n}/verdict``. The other nodes read the counter at most every ``every_s`` (one store read,
O(1) per node); node 0 reads O(nodes) answers only when it looks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from failslow.errors import FailslowError

HANG = "hang"
DECLINE = "decline"


@dataclass
class StackExchange:
    nodes: Any
    """This node's :class:`~failslow.node.nodes.NodeGroup`."""
    launch: int
    say: Callable[[str], None] = print
    answer_timeout_s: float = 20.0
    """How long node 0 waits for the other nodes' answers (each dumps its own ranks' stacks,
    py-spy's timeout being 10 s)."""
    every_s: float = 0.25
    """How often another node reads whether node 0 opened a look."""
    clock: Callable[[], float] = time.monotonic
    _answered: int = 0
    _pending: tuple[int, float] | None = None
    """The look this node answered and awaits node 0's verdict on, and when."""
    _checked: float = float("-inf")
    _trouble: bool = False

    @property
    def leads(self) -> bool:
        """Whether this node asks and decides (node 0)."""
        return bool(self.nodes.node_rank == 0)

    # -- node 0 ---------------------------------------------------------------------------------
    def ask(self, kind: str, min_quiet_s: float = 0.0) -> int | None:
        """Open a look for ``kind`` (the other nodes send stacks of ranks quiet for at least
        ``min_quiet_s``); its number, or None when the store is away."""
        try:
            what = {"kind": kind, "min_quiet_s": min_quiet_s}
            return int(self.nodes.open_look(self.launch, what))
        except (FailslowError, ValueError) as exc:
            self._away(exc)
            return None

    def gather(self, look: int, stacks: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """This node's ``stacks`` and the other nodes' answers to ``look``: every stack, and
        ``{"missing": [nodes that did not answer], "quiet": {node: its ranks' quiet time}}``."""
        from failslow.core.diagnosis.stacks import ProcessStack

        try:
            answers = self.nodes.look_answers(self.launch, look, self.answer_timeout_s)
        except (FailslowError, ValueError) as exc:
            self._away(exc)
            answers = {}
        quiet = {}
        for node, answer in sorted(answers.items()):
            quiet[node] = answer.get("quiet_s")
            stacks = stacks + [ProcessStack.from_dict(d) for d in answer.get("stacks", [])]
        missing = [k for k in range(1, self.nodes.options.nnodes) if k not in answers]
        return stacks, {"missing": missing, "quiet": quiet}

    def decide(self, look: int, ranks: list[int], cause: str) -> None:
        """Publish look ``look``'s verdict: ``ranks`` (maybe none) to evict for ``cause``."""
        try:
            self.nodes.decide_look(self.launch, look, {"ranks": ranks, "cause": cause})
        except (FailslowError, ValueError) as exc:
            self._away(exc)

    # -- every other node -----------------------------------------------------------------------
    def follow(
        self, pids: Mapping[int, int], quiet: float | None
    ) -> tuple[list[int], str] | None:
        """One check on another node than 0 (``pids``: its running ranks, ``quiet``: how long
        they have committed no collective, None: not known): answer node 0's new look, then
        read its verdict - the named ranks this node holds and why, once they are named."""
        from failslow.node.stacks import capture

        now = self.clock()
        if now - self._checked < self.every_s:
            return None
        self._checked = now
        nodes = self.nodes
        try:
            if self._pending is not None:
                look, since = self._pending
                verdict = nodes.look_verdict(self.launch, look)
                if verdict is None:
                    if now - since > 2 * self.answer_timeout_s:
                        self._pending = None  # node 0 gave up on it
                    return None
                self._pending = None
                named = [int(r) for r in verdict.get("ranks", [])]
                mine = [r for r in named if r in pids]
                if not mine:
                    return None
                self.say(f"node 0's look {look} named ranks {named}: evicting this node's {mine}")
                return mine, str(verdict.get("cause", "hung"))
            look = nodes.looks(self.launch)
            if look <= self._answered:
                return None
            self._answered = look
            asked = nodes.look(self.launch, look) or {}
            wanted = float(asked.get("min_quiet_s", 0.0))
            send = wanted <= 0 or (quiet is not None and quiet >= wanted)
            stacks = capture(pids, native=False) if send else []
            answer = {"quiet_s": quiet, "stacks": [s.to_dict() for s in stacks]}
            nodes.answer_look(self.launch, look, answer)
            self._pending = (look, now)
        except (FailslowError, ValueError) as exc:
            self._away(exc)
        return None

    def _away(self, exc: Exception) -> None:
        if not self._trouble:
            self._trouble = True
            self.say(f"stack aggregation across nodes: the job's store is away ({exc})")
