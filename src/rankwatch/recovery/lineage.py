"""Lineage: an append-only, tamper-evident record of everything that makes a run differ from an uninterrupted one.

One JSON object per line at `<run>/lineage.jsonl`. Every replay, rollback, restart, world-size or layout change,
device swap or quarantine, code or config change is an entry, with a comparability verdict: BITWISE_IDENTICAL_EXPECTED
(the run should match an uninterrupted one bit for bit) or CHANGED with the reasons (ordering, batch composition,
numerics, hardware) and free text.

Tamper evidence: each entry carries `prev_hash` (the previous entry's `hash`; 64 zeros for the first) and `hash`, the
SHA-256 of the entry's canonical JSON (sorted keys, no whitespace) without `hash` but with `prev_hash`. `verify`
names the first broken seq and how: an edited entry, a deleted or reordered one, an altered hash, a truncated last
line. What a hash chain cannot show alone: a deleted tail (the file simply ends earlier) and a forger who rewrites
every hash from the edit onward. Both are caught by comparing the head hash with an anchor kept elsewhere (e.g. in a
checkpoint manifest): `verify(path, anchor=...)`.

Appends are safe across processes: `append` takes an exclusive `fcntl.flock` on the file, reads the last entry under
the lock, writes the new line with one `write` on an O_APPEND descriptor, and fsyncs before releasing the lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.base.rundir import LINEAGE_FILE, fsync_path
from rankwatch.base.schema import ChangeReason, Comparability, LineageKind
from rankwatch.base.topology import Layout
from rankwatch.recovery.determinism import DeterminismInputs

GENESIS = "0" * 64
_TAIL_READ = 1 << 16


# The vocabulary lives in the one schema module, where analytics (the recovery policy) reads it too.
EntryKind = LineageKind


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """Comparability of the run after this entry with the run before it."""

    comparability: Comparability
    reasons: tuple[ChangeReason, ...] = ()
    """Non-empty exactly when CHANGED, in `ChangeReason` order without repeats."""
    note: str = ""

    def __post_init__(self) -> None:
        if (self.comparability is Comparability.CHANGED) != bool(self.reasons):
            raise ValueError(f"verdict {self.comparability} with reasons {list(map(str, self.reasons))}")
        order = list(ChangeReason)
        object.__setattr__(self, "reasons", tuple(sorted(set(self.reasons), key=order.index)))

    @classmethod
    def identical(cls, note: str = "") -> Verdict:
        return cls(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED, note=note)

    @classmethod
    def changed(cls, *reasons: ChangeReason, note: str = "") -> Verdict:
        return cls(comparability=Comparability.CHANGED, reasons=reasons, note=note)


@dataclass(frozen=True, kw_only=True, slots=True)
class Details:
    """What changed; which fields an entry needs depends on its kind (`REQUIRED`)."""

    from_step: int | None = None
    """First step of a replayed range, or the step a rollback/restart left from."""
    to_step: int | None = None
    """Step a rollback/restart resumes at, or the end (exclusive) of a replayed range."""
    checkpoint_id: str | None = None
    old_world_size: int | None = None
    new_world_size: int | None = None
    old_layout: str | None = None
    """As `Layout.__str__`: 'dp=2,tp=2,pp=1'."""
    new_layout: str | None = None
    old_device: str | None = None
    """Device UUID replaced, or quarantined."""
    new_device: str | None = None
    subject: str | None = None
    """A quarantined host or link ('host:h1', 'link:h0<->h1') when the subject is not one device."""
    old_hash: str | None = None
    """Code (git sha / wheel hash) or config hash before a CODE_CHANGE / CONFIG_CHANGE; at START, the code hash."""
    new_hash: str | None = None
    """Code or config hash after; at START, the config hash."""
    text: str = ""
    attempt: int | None = None
    """The launch attempt the entry is about (a resume's, or the replay a REPLAY_VERIFIED entry checked)."""
    old_global_batch: int | None = None
    """At WORLD_SIZE_CHANGE (a resume) or BATCH_CHANGE (a restart from step 0 on another world): the samples per
    optimizer step across the job before the change, where the job declared them
    (`recovery.Checkpointer(global_batch=...)`). Left out of the hashed body when None, as `determinism`."""
    new_global_batch: int | None = None
    """... and after it: a data-parallel job that goes on with fewer replicas keeps its global batch (re-split) or
    its per-rank batch (the global one shrinks); the lineage says which."""
    determinism: str | None = None
    """At RESTART / ROLLBACK: the attempt's determinism inputs (`recovery.determinism.DeterminismInputs`) as canonical
    JSON. Left out of an entry's hashed body when None, so entries written before it existed still verify."""


REQUIRED: dict[EntryKind, tuple[str, ...]] = {
    EntryKind.START: (),
    EntryKind.RESTART: ("to_step",),
    EntryKind.ROLLBACK: ("from_step", "to_step", "checkpoint_id"),
    EntryKind.REPLAYED_DATA_RANGE: ("from_step", "to_step"),
    EntryKind.WORLD_SIZE_CHANGE: ("old_world_size", "new_world_size"),
    EntryKind.LAYOUT_CHANGE: ("old_layout", "new_layout"),
    EntryKind.BATCH_CHANGE: ("old_world_size", "new_world_size", "old_global_batch", "new_global_batch"),
    EntryKind.DEVICE_REPLACED: ("old_device", "new_device"),
    EntryKind.DEVICE_QUARANTINED: (),
    EntryKind.CODE_CHANGE: ("old_hash", "new_hash"),
    EntryKind.CONFIG_CHANGE: ("old_hash", "new_hash"),
    EntryKind.REPLAY_VERIFIED: ("from_step", "to_step", "attempt"),
}
"""Details fields each kind must fill."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NewEntry:
    """An entry before `append` numbers, stamps and chains it."""

    kind: EntryKind
    details: Details
    verdict: Verdict
    time_ns: int | None = None
    """Wall clock (`time.time_ns()`); None: stamped by `append`."""

    def __post_init__(self) -> None:
        missing = [f for f in REQUIRED[self.kind] if getattr(self.details, f) is None]
        if missing:
            raise ValueError(f"lineage {self.kind} entry: missing details {', '.join(missing)}")
        d = self.details
        if self.kind is EntryKind.REPLAYED_DATA_RANGE and d.from_step is not None and d.to_step is not None \
                and d.from_step >= d.to_step:
            raise ValueError(f"lineage {self.kind} entry: empty range [{d.from_step}, {d.to_step})")
        same = {EntryKind.WORLD_SIZE_CHANGE: ("old_world_size", "new_world_size"),
                EntryKind.LAYOUT_CHANGE: ("old_layout", "new_layout"),
                EntryKind.DEVICE_REPLACED: ("old_device", "new_device"),
                EntryKind.CODE_CHANGE: ("old_hash", "new_hash"), EntryKind.CONFIG_CHANGE: ("old_hash", "new_hash")}
        if self.kind in same:
            a, b = same[self.kind]
            if getattr(d, a) == getattr(d, b):
                raise ValueError(f"lineage {self.kind} entry: {a} equals {b} ({getattr(d, a)!r}): nothing changed")
        if self.kind is EntryKind.BATCH_CHANGE and (d.old_world_size, d.old_global_batch) == (
                d.new_world_size, d.new_global_batch):
            raise ValueError(f"lineage {self.kind} entry: the same world ({d.old_world_size}) and global batch "
                             f"({d.old_global_batch}) before and after: nothing changed")
        if self.kind is EntryKind.DEVICE_QUARANTINED and d.old_device is None and d.subject is None:
            raise ValueError("lineage device_quarantined entry: names neither old_device nor subject")


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    seq: int
    """0 for the first entry, +1 for each."""
    time_ns: int
    kind: EntryKind
    details: Details
    verdict: Verdict
    prev_hash: str
    hash: str

    def body(self) -> dict[str, Any]:
        """Everything the hash covers: the entry without `hash`."""
        return {
            "seq": self.seq, "time_ns": self.time_ns, "kind": str(self.kind),
            "details": {f.name: getattr(self.details, f.name) for f in fields(Details)
                        if f.name not in _OPTIONAL_DETAILS or getattr(self.details, f.name) is not None},
            "verdict": {"comparability": str(self.verdict.comparability),
                        "reasons": [str(r) for r in self.verdict.reasons], "note": self.verdict.note},
            "prev_hash": self.prev_hash,
        }

    def to_line(self) -> str:
        return _canonical({**self.body(), "hash": self.hash}) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Entry:
        v = d["verdict"]
        return cls(
            seq=int(d["seq"]), time_ns=int(d["time_ns"]), kind=EntryKind(d["kind"]), details=Details(**d["details"]),
            verdict=Verdict(comparability=Comparability(v["comparability"]),
                            reasons=tuple(ChangeReason(r) for r in v["reasons"]), note=v["note"]),
            prev_hash=str(d["prev_hash"]), hash=str(d["hash"]),
        )


_OPTIONAL_DETAILS = frozenset({"attempt", "determinism", "old_global_batch", "new_global_batch"})
"""Details fields added after lineage files existed: in the hashed body only when set."""


def inputs_json(inputs: DeterminismInputs) -> str:
    return _canonical(inputs.to_dict())


def _canonical(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(body).encode()).hexdigest()


def _seal(new: NewEntry, seq: int, prev_hash: str) -> Entry:
    time_ns = new.time_ns if new.time_ns is not None else time.time_ns()
    draft = Entry(seq=seq, time_ns=time_ns, kind=new.kind, details=new.details, verdict=new.verdict,
                  prev_hash=prev_hash, hash="")
    return Entry(seq=seq, time_ns=time_ns, kind=new.kind, details=new.details, verdict=new.verdict,
                 prev_hash=prev_hash, hash=_digest(draft.body()))


def lineage_path(run_dir: Path) -> Path:
    return run_dir / LINEAGE_FILE


class Lineage:
    """Appends to one lineage file (`lineage_path(run_dir)` for a run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, new: NewEntry) -> Entry:
        """Number, chain, write and fsync one entry; safe against concurrent appenders in other processes.
        Refuses (ValueError) to append to a lineage whose chain does not verify (an entry edited, deleted or
        reordered, a truncated or unreadable line): nothing is written then."""
        created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                _check(self.path, _verify_bytes(_read_all(fd)), "refusing to append to a tampered lineage")
                last = self._last(fd)
                entry = _seal(new, 0 if last is None else last.seq + 1, GENESIS if last is None else last.hash)
                data = entry.to_line().encode()
                written = os.write(fd, data)
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        if created:
            fsync_path(self.path.parent)
        return entry

    def _last(self, fd: int) -> Entry | None:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        if os.pread(fd, 1, size - 1) != b"\n":
            raise ValueError(f"{self.path}: last line is truncated; run verify and repair before appending")
        start = size
        tail = b"\n"
        while start > 0 and tail.count(b"\n") < 2:
            start = max(0, start - _TAIL_READ)
            tail = os.pread(fd, size - start, start)
        line = tail[:-1].rsplit(b"\n", 1)[-1]
        try:
            entry = Entry.from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.path}: last line unreadable ({type(exc).__name__}); verify before appending") from None
        if _digest(entry.body()) != entry.hash:
            raise ValueError(f"{self.path}: last entry seq {entry.seq} fails its hash; verify before appending")
        return entry


def read(path: Path) -> tuple[Entry, ...]:
    """Every entry, in file order. A missing file is no entries; an unreadable line is a ValueError naming it.
    Reading does not check the chain: `verify` does."""
    if not path.exists():
        return ()
    lines = path.read_bytes().split(b"\n")
    if lines[-1]:
        raise ValueError(f"{path}: line {len(lines)} is truncated (no newline)")
    out = []
    for n, line in enumerate(lines[:-1], start=1):
        try:
            out.append(Entry.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: line {n} is not a lineage entry ({type(exc).__name__}: {exc})") from None
    return tuple(out)


class Problem(StrEnum):
    EDITED = "edited"
    """An entry's content no longer matches its hash, or was re-hashed so the next entry no longer links to it."""
    DELETED = "deleted"
    """A seq is missing (or, with an anchor, the tail after the last entry)."""
    REORDERED = "reordered"
    """Entries are out of seq order, or one is repeated."""
    BAD_HASH = "bad_hash"
    """The `hash` field was altered: the content is intact (the next entry links to its true hash)."""
    TRUNCATED = "truncated"
    """The last line is incomplete (a write cut short)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyResult:
    ok: bool
    entries: int
    """Lines read (a truncated last line included)."""
    head: str
    """Hash of the last intact entry (GENESIS for none): store it elsewhere as an anchor."""
    broken_seq: int | None = None
    """The seq expected at the first broken position."""
    problem: Problem | None = None
    why: str = ""


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _check(path: Path, result: VerifyResult, consequence: str) -> None:
    if not result.ok:
        raise ValueError(f"{path}: lineage does not verify at seq {result.broken_seq} ({result.problem}: {result.why});"
                         f" {consequence}")


def check_lineage(path: Path, *, consequence: str = "its entries cannot be trusted") -> VerifyResult:
    """`verify`, as a one-line ValueError naming the file and `consequence` when the chain is broken (a missing
    file is fine)."""
    if path.exists() and not path.is_file():
        raise ValueError(f"{path}: not a file")
    result = verify(path)
    _check(path, result, consequence)
    return result


def verify(path: Path, *, anchor: str | None = None) -> VerifyResult:
    """Check the chain from the first line; report the first break. With `anchor` (a head hash kept elsewhere), also
    a deleted tail or a re-hashed suffix."""
    return _verify_bytes(path.read_bytes() if path.exists() else b"", anchor=anchor)


def _verify_bytes(raw: bytes, *, anchor: str | None = None) -> VerifyResult:
    lines = raw.split(b"\n")
    complete, torn = lines[:-1], lines[-1]
    parsed: list[Entry | None] = []
    for line in complete:
        try:
            parsed.append(Entry.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            parsed.append(None)
    n_lines = len(complete) + (1 if torn else 0)

    def broken(seq: int, problem: Problem, why: str, head: str) -> VerifyResult:
        return VerifyResult(ok=False, entries=n_lines, head=head, broken_seq=seq, problem=problem, why=why)

    prev = GENESIS
    seen = {e.seq for e in parsed if e is not None}
    for pos, e in enumerate(parsed):
        if e is None:
            return broken(pos, Problem.EDITED, f"line {pos + 1} is not a lineage entry", prev)
        if e.seq != pos:
            if e.seq > pos and pos not in seen:
                return broken(pos, Problem.DELETED, f"line {pos + 1} has seq {e.seq}; seq {pos} is missing", prev)
            return broken(pos, Problem.REORDERED, f"line {pos + 1} has seq {e.seq}, expected {pos}", prev)
        true_hash = _digest(e.body())
        if true_hash != e.hash:
            nxt = parsed[pos + 1] if pos + 1 < len(parsed) else None
            if (nxt.prev_hash == true_hash) if nxt is not None else (anchor == true_hash):
                return broken(pos, Problem.BAD_HASH, f"seq {pos}: hash field altered; content intact", prev)
            return broken(pos, Problem.EDITED, f"seq {pos}: content does not match its hash", prev)
        if e.prev_hash != prev:
            if pos == 0:
                return broken(0, Problem.EDITED, "seq 0 does not start the chain: rewritten and re-hashed", prev)
            return broken(pos - 1, Problem.EDITED,
                          f"seq {pos} links to {e.prev_hash[:12]}, not to seq {pos - 1}'s hash {prev[:12]}: "
                          f"seq {pos - 1} was rewritten and re-hashed", prev)
        prev = e.hash
    if torn:
        return broken(len(parsed), Problem.TRUNCATED, f"line {len(parsed) + 1} is truncated", prev)
    if anchor is not None and anchor != prev:
        known = {e.hash: e.seq for e in parsed if e is not None}
        if anchor in known:
            return VerifyResult(ok=True, entries=n_lines, head=prev,
                                why=f"anchor is seq {known[anchor]}; later entries appended since")
        return broken(len(parsed), Problem.DELETED, "head does not match the anchor: tail deleted or suffix re-hashed",
                      prev)
    return VerifyResult(ok=True, entries=n_lines, head=prev)


def comparability_of_resume(old_layout: Layout, new_layout: Layout, old_world: int, new_world: int, *,
                            same_code: bool, same_config: bool, same_devices: bool = True,
                            determinism_changes: tuple[str, ...] = ()) -> Verdict:
    """Comparability of a resumed run with the run it resumes. Identical only if nothing changed.

    world size or dp degree -> batch composition + ordering (data resharded, reduction over other summands);
    tp degree -> numerics (matmul reductions split differently); pp degree -> ordering (another schedule);
    code -> numerics; config -> numerics (its effect is not analysed here); devices -> hardware; a determinism input
    (`determinism_changes`, one 'name old->new' each) -> determinism_inputs."""
    for name, layout, world in (("old", old_layout, old_world), ("new", new_layout, new_world)):
        if layout.world_size != world:
            raise ValueError(f"{name} layout {layout} has {layout.world_size} ranks but {name} world size is {world}")
    reasons: list[ChangeReason] = []
    notes: list[str] = []
    if old_world != new_world or old_layout.dp != new_layout.dp:
        reasons += [ChangeReason.BATCH_COMPOSITION, ChangeReason.ORDERING]
        notes.append(f"world {old_world}->{new_world}, dp {old_layout.dp}->{new_layout.dp}")
    if old_layout.tp != new_layout.tp:
        reasons.append(ChangeReason.NUMERICS)
        notes.append(f"tp {old_layout.tp}->{new_layout.tp}")
    if old_layout.pp != new_layout.pp:
        reasons.append(ChangeReason.ORDERING)
        notes.append(f"pp {old_layout.pp}->{new_layout.pp}")
    if not same_code:
        reasons.append(ChangeReason.NUMERICS)
        notes.append("code changed")
    if not same_config:
        reasons.append(ChangeReason.NUMERICS)
        notes.append("config changed")
    if not same_devices:
        reasons.append(ChangeReason.HARDWARE)
        notes.append("devices changed")
    if determinism_changes:
        reasons.append(ChangeReason.DETERMINISM_INPUTS)
        notes.append("determinism inputs changed: " + ", ".join(determinism_changes))
    if not reasons:
        return Verdict.identical("same layout, world size, code, config, devices and determinism inputs")
    return Verdict.changed(*reasons, note="; ".join(notes))
