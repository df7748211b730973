"""Which of a run's lineage promises were checked, and did they hold?

A lineage entry with verdict BITWISE_IDENTICAL_EXPECTED promises that the run is what it would have been without
the fault. The product checks that promise where it can: a replayed range is compared, fingerprint by fingerprint,
with the attempt that trained it first (`analytics.replay`). Each promise is then

- HELD: checked, every compared fingerprint bitwise equal;
- BROKEN: checked, and from `since_step` on the replay differs in `fields`;
- NOT_CHECKABLE: nothing to compare (no step of the range fingerprinted by both attempts, or a restart that
  trained no step twice), with why;
- NOT_PROMISED: the entry says CHANGED itself (its reasons are the answer).

`record_replay_verification` runs when a resumed attempt ends (the launcher calls it) and appends one
REPLAY_VERIFIED entry per earlier attempt it replayed: identical when it held, CHANGED
(`nondeterministic_replay`) from the first differing step when not — so the lineage itself stops promising.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.queries import fingerprints, replays
from rankwatch.analytics.replay import ReplayCheck, replay_checks
from rankwatch.analytics.store import open_run
from rankwatch.base.schema import ChangeReason, Comparability, Table
from rankwatch.recovery.lineage import (
    Details, Entry, EntryKind, Lineage, NewEntry, Verdict, check_lineage, lineage_path, read as read_lineage,
)

__all__ = ["Promise", "PromiseStatus", "ReplayCheck", "RunVerdict", "evaluate", "record_replay_verification", "replay_checks_of"]


class PromiseStatus(StrEnum):
    HELD = "checked_and_held"
    BROKEN = "checked_and_broken"
    NOT_CHECKABLE = "not_checkable"
    NOT_PROMISED = "not_promised"


@dataclass(frozen=True, kw_only=True, slots=True)
class Promise:
    seq: int
    """The lineage entry making (or declining) the promise."""
    kind: EntryKind
    attempt: int | None
    status: PromiseStatus
    since_step: int | None = None
    """BROKEN: the first step whose replay differs."""
    fields: tuple[str, ...] = ()
    """BROKEN: the fingerprint fields that differ at `since_step`."""
    why: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunVerdict:
    entries: tuple[Entry, ...]
    promises: tuple[Promise, ...]
    checks: tuple[ReplayCheck, ...]
    warnings: tuple[str, ...]
    """What the fingerprints reader left out (damaged parts), so "not checkable" is not mistaken for "held"."""

    @property
    def comparability(self) -> Comparability:
        changed = any(e.verdict.comparability is Comparability.CHANGED for e in self.entries)
        broken = any(p.status is PromiseStatus.BROKEN for p in self.promises)
        return Comparability.CHANGED if changed or broken else Comparability.BITWISE_IDENTICAL_EXPECTED

    @property
    def reasons(self) -> tuple[ChangeReason, ...]:
        seen = {r for e in self.entries for r in e.verdict.reasons}
        if any(p.status is PromiseStatus.BROKEN for p in self.promises):
            seen.add(ChangeReason.NONDETERMINISTIC_REPLAY)
        return tuple(r for r in ChangeReason if r in seen)


def replay_checks_of(run_dir: Path) -> tuple[tuple[ReplayCheck, ...], tuple[str, ...]]:
    """Every replay check the run's fingerprints allow, and the reader's warnings. A run without fingerprints has
    none (and says so in a warning)."""
    try:
        store = open_run(run_dir, tables={Table.FINGERPRINTS})
    except ValueError as exc:
        return (), (f"replay verification: {exc}",)
    frames = Frames.build(fingerprints=fingerprints(store.con), replays=replays(store.con))
    return replay_checks(frames), tuple(store.warnings)


def _covering(checks: tuple[ReplayCheck, ...], attempt: int | None, lo: int, hi: int) -> list[ReplayCheck]:
    """Checks of `attempt` (any, when unknown) that compared steps inside [lo, hi)."""
    return [c for c in checks if (attempt is None or c.attempt == attempt) and c.first_step < hi and c.last_step >= lo]


def evaluate(run_dir: Path) -> RunVerdict:
    """Verify the lineage chain (a ValueError naming the file when broken), then judge every promise. A run
    directory that does not exist is a ValueError, not an empty lineage."""
    if not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir}: not a run directory (does not exist or is not a directory)")
    path = lineage_path(Path(run_dir))
    check_lineage(path)
    entries = read_lineage(path)
    checks, warnings = replay_checks_of(Path(run_dir)) if entries else ((), ())
    out: list[Promise] = []
    for e in entries:
        d = e.details
        if e.kind is EntryKind.REPLAY_VERIFIED:
            continue  # the record of a check, not a promise
        if e.verdict.comparability is Comparability.CHANGED:
            out.append(Promise(seq=e.seq, kind=e.kind, attempt=d.attempt, status=PromiseStatus.NOT_PROMISED,
                               why="CHANGED: " + ", ".join(map(str, e.verdict.reasons))
                               + (f" ({e.verdict.note})" if e.verdict.note else "")))
            continue
        if e.kind is EntryKind.REPLAYED_DATA_RANGE and d.from_step is not None and d.to_step is not None:
            found = _covering(checks, d.attempt, d.from_step, d.to_step)
            broken = [c for c in found if not c.held and c.broken_step is not None]
            if broken:
                first = min(broken, key=lambda c: c.broken_step or 0)
                out.append(Promise(seq=e.seq, kind=e.kind, attempt=first.attempt, status=PromiseStatus.BROKEN,
                                   since_step=first.broken_step, fields=first.fields, why=first.describe()))
            elif found:
                out.append(Promise(seq=e.seq, kind=e.kind, attempt=found[0].attempt, status=PromiseStatus.HELD,
                                   why="; ".join(c.describe() for c in found)))
            else:
                why = (f"no step of {d.from_step}..{d.to_step - 1} was fingerprinted by both attempts"
                       + (f" ({len(warnings)} telemetry warning(s))" if warnings else ""))
                out.append(Promise(seq=e.seq, kind=e.kind, attempt=d.attempt, status=PromiseStatus.NOT_CHECKABLE,
                                   why=why))
        elif e.kind is EntryKind.RESTART:
            out.append(Promise(seq=e.seq, kind=e.kind, attempt=d.attempt, status=PromiseStatus.NOT_CHECKABLE,
                               why="a restart trains no step twice: nothing to compare without a reference run"))
    return RunVerdict(entries=entries, promises=tuple(out), checks=checks, warnings=warnings)


def record_replay_verification(run_dir: Path, attempt: int) -> tuple[ReplayCheck, ...]:
    """Append one REPLAY_VERIFIED entry per earlier attempt that `attempt` replayed fingerprinted steps of; return
    the checks. Refuses (ValueError) a lineage that does not verify."""
    checks, _ = replay_checks_of(Path(run_dir))
    mine = tuple(c for c in checks if c.attempt == attempt)
    book = Lineage(lineage_path(Path(run_dir)))
    for c in mine:
        if c.held:
            verdict = Verdict.identical(c.describe())
            details = Details(from_step=c.first_step, to_step=c.last_step + 1, attempt=attempt, text=c.describe())
        else:
            assert c.broken_step is not None
            verdict = Verdict.changed(ChangeReason.NONDETERMINISTIC_REPLAY, note=c.describe())
            details = Details(from_step=c.broken_step, to_step=c.last_step + 1, attempt=attempt, text=c.describe())
        book.append(NewEntry(kind=EntryKind.REPLAY_VERIFIED, verdict=verdict, details=details))
    return mine
