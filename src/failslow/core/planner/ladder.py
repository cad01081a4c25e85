"""The stop-time ladder for a training incident without a culprit (byterobust 4.2).

When training crashes or its metrics go bad (a NaN loss, a 5x jump; :mod:`..diagnosis.metrics`)
and no machine is named, byterobust climbs: *reattempt* - restart in place from the last good
checkpoint, for transient faults - then *roll back* the latest code update - "recent updates of
user code are highly risky" - then *replay* the bad step on groups of machines to find one that
silently corrupts it (dual-phase replay, :mod:`..diagnosis.replay`), and past those, a person.
:class:`Ladder` is that climb
for one job, pure: each incident gets the next rung, and an incident that comes back before the
job got ``repeat_within`` steps past the previous one is the same incident, one rung higher. A
job that trained well past it starts at the bottom again.

Every rung restarts from the newest in-memory snapshot *before* the first bad step
(:attr:`Rung.before_step`): the state of that step may already hold the bad values. The ladder
ends in :data:`NEEDS_PERSON` - a clear stop with the snapshots kept - never a loop of restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REATTEMPT = "reattempt"
ROLL_BACK_CODE = "roll back code"
REPLAY = "replay"
NEEDS_PERSON = "needs a person"


@dataclass(frozen=True, slots=True)
class Rung:
    name: str
    """:data:`REATTEMPT`, :data:`ROLL_BACK_CODE`, :data:`REPLAY` or :data:`NEEDS_PERSON`."""
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

    def next(
        self, step: int, what: str, *, code_update: str | None = None, replay: bool = False
    ) -> Rung:
        """The rung for an incident at ``step`` (``what`` says what went wrong);
        ``code_update`` names the latest code update that can be rolled back (None: none);
        ``replay``: the launcher can replay the step on groups of machines."""
        if self._last_step is None or step > self._last_step + self.repeat_within:
            self.taken = []
        self._last_step = step
        before = min([step, *(r.before_step for r in self.taken)])
        tried = [r.name for r in self.taken]
        again = f"{what}, again after {_list(tried)}" if tried else what
        if tried.count(REATTEMPT) < self.reattempts and ROLL_BACK_CODE not in tried:
            n = tried.count(REATTEMPT) + 1
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
        elif replay and REPLAY not in tried:
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
        self.taken.append(rung)
        return rung


def _list(names: list[str]) -> str:
    counts = {name: names.count(name) for name in dict.fromkeys(names)}
    return ", ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items())
