"""The stop-time ladder for a training incident without a culprit (byterobust 4.2).

When training crashes or its metrics go bad (a NaN loss, a 5x jump; :mod:`..diagnosis.metrics`)
and no machine is named, byterobust climbs. First it *diagnoses*: stop-time checks on every
machine - device, links, a bitwise-alignment step of a reference model
(:mod:`..diagnosis.stop_checks`) - and *evicts* the machines they name. When every machine
passes, it *reattempts* - restart in place from the last good checkpoint, for transient faults -
then *rolls back* the latest code update - "recent updates of user code are highly risky" - then
*replays* the bad step on groups of machines to find one that silently corrupts it (dual-phase
replay, :mod:`..diagnosis.replay`), and past those, a person. :class:`Ladder` is that climb for
one job, pure: each incident gets the next rung, and an incident that comes back before the job
got ``repeat_within`` steps past the previous one is the same incident, one rung higher. A job
that trained well past it starts at the bottom again. The checks run once per incident, as its
first rung; an eviction counts as its restart ("training crashes again after machine eviction"
goes on to the rollback).

Every rung restarts from the newest in-memory snapshot *before* the first bad step
(:attr:`Rung.before_step`): the state of that step may already hold the bad values. The ladder
ends in :data:`NEEDS_PERSON` - a clear stop with the snapshots kept - never a loop of restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DIAGNOSE = "diagnose"
EVICT = "evict"
REATTEMPT = "reattempt"
ROLL_BACK_CODE = "roll back code"
REPLAY = "replay"
NEEDS_PERSON = "needs a person"


@dataclass(frozen=True, slots=True)
class Rung:
    name: str
    """:data:`DIAGNOSE`, :data:`EVICT`, :data:`REATTEMPT`, :data:`ROLL_BACK_CODE`,
    :data:`REPLAY` or :data:`NEEDS_PERSON`."""
    before_step: int
    """Restart from the newest snapshot before this step (the first bad step seen)."""
    why: str


@dataclass(slots=True)
class Ladder:
    reattempts: int = 1
    """Restarts from memory before the code is suspected."""
    repeat_within: int = 16
    """An incident at most this many steps after the previous one is the same one, climbing."""
    taken: list[Rung] = field(default_factory=list)
    """The rungs of the current incident, in order."""
    _last_step: int | None = None
    _what: str = ""
    _code_update: str | None = None
    _replay: bool = False

    def next(
        self, step: int, what: str, *, code_update: str | None = None, replay: bool = False,
        diagnose: bool = False,
    ) -> Rung:  # fmt: skip
        """The rung for an incident at ``step`` (``what`` says what went wrong);
        ``code_update`` names the latest code update that can be rolled back (None: none);
        ``replay``: the launcher can replay the step on groups of machines; ``diagnose``: it
        can run the stop-time checks (then a new incident's first rung is :data:`DIAGNOSE`,
        and :meth:`diagnosed` gives the rung after them)."""
        if self._last_step is None or step > self._last_step + self.repeat_within:
            self.taken = []
        self._last_step = step
        self._what, self._code_update, self._replay = what, code_update, replay
        if diagnose and not self.taken:
            why = (
                f"{what}: no machine is named - stop-time checks on every machine first "
                f"(device, links, bitwise alignment of a reference step)"
            )
            return self._take(Rung(DIAGNOSE, step, why))
        return self._climb()

    def diagnosed(self, suspects: list[int], found: str) -> Rung:
        """The rung after the stop-time checks of the current incident: :data:`EVICT` the
        machines they named (``found`` says why), else the next rung of the ladder."""
        assert self.taken and self.taken[-1].name == DIAGNOSE, "diagnosed() follows DIAGNOSE"
        before = self.taken[-1].before_step
        if suspects:
            why = (
                f"{self._what}: the stop-time checks name machine(s) {suspects} ({found}) - "
                f"evict them and restart from the newest snapshot before step {before}"
            )
            return self._take(Rung(EVICT, before, why))
        return self._climb()

    def _take(self, rung: Rung) -> Rung:
        self.taken.append(rung)
        return rung

    def _climb(self) -> Rung:
        code_update, step = self._code_update, self._last_step
        assert step is not None, "_climb() follows next()"
        before = min([step, *(r.before_step for r in self.taken)])
        tried = [r.name for r in self.taken]
        if tried == [DIAGNOSE]:
            again = f"{self._what}, and every machine passed the stop-time checks"
        else:
            again = f"{self._what}, again after {_list(tried)}" if tried else self._what
        restarts = tried.count(REATTEMPT) + tried.count(EVICT)
        if restarts < self.reattempts and ROLL_BACK_CODE not in tried:
            n = restarts + 1
            why = (
                f"{again}: a transient fault is the likeliest cause - restart every rank from "
                f"the newest snapshot before step {before} (reattempt {n} of {self.reattempts})"
            )
            rung = Rung(REATTEMPT, before, why)
        elif code_update is not None and ROLL_BACK_CODE not in tried:
            why = (
                f"{again}: the latest code update ({code_update}) is the likeliest cause - "
                f"roll it back and restart from the newest snapshot before step {before}"
            )
            rung = Rung(ROLL_BACK_CODE, before, why)
        elif self._replay and REPLAY not in tried:
            why = (
                f"{again}: an unknown fault, a silent data corruption most likely - replay "
                f"step {before} on groups of machines (dual-phase) and evict the one that "
                f"corrupts it"
            )
            rung = Rung(REPLAY, before, why)
        else:
            left = (
                ""
                if code_update is not None or ROLL_BACK_CODE in tried
                else (" (no code update to roll back)")
            )
            why = (
                f"{again}{left}: nothing left to try - the job stops for a person; its "
                f"snapshots before step {before} are kept"
            )
            rung = Rung(NEEDS_PERSON, before, why)
        return self._take(rung)


def _list(names: list[str]) -> str:
    counts = {name: names.count(name) for name in dict.fromkeys(names)}
    return ", ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items())
