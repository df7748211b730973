"""The run directory: the one owner of every path under a run, the typed readers and writers of the run's own files,
and the one atomic write every writer under a run uses.

    <run>/run.json                          one record per launch of the job (`read_launches`, `append_launch`,
                                            `claim_launch`)
    <run>/telemetry/<table>/rank=<r>/       the collector's part files; host rollups under `_rollup/`
    <run>/live/                             liveness: each rank's heartbeat record, the launcher's exit records
    <run>/step_times/                       benchmark clocks a canary rank writes when asked
    <run>/checkpoints/step-XXXXXXXX/        committed checkpoints; `.step-XXXXXXXX.tmp/` is a save not published
    <run>/lineage.jsonl                     the hash-chained lineage (`recovery.lineage`)
    <run>/quarantine.json                   devices, hosts and links out of placement (`read_quarantine`)
    <run>/recovery/recovery-NNNN.json       what each recovery did; `dry-run.json`: a plan not carried out
                                            (`read_recovery_records`, `write_recovery_record`)
    <run>/evidence/<incident>/              evidence bundles (`recovery.evidence`)
    <run>/analysis/incidents.{parquet,json} the analysis; `analysis/views/`: what people look at
    <run>/alerts/outbox.sqlite              the monitor's durable outbox of signed alerts
    <run>/manager/state.sqlite              the recovery manager service's ledger; `alertmanager.jsonl` beside it
    <run>/labels.json                       a simulated run's ground truth

Readers fail loudly: a file of the wrong shape is a `RunFileError` (a ValueError) whose one line names the file and
the problem, never a KeyError. Writers publish whole files only (`atomic_write`: a temporary name in the same
folder, fsynced, renamed, the folder fsynced), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ALERTMANAGER_LOG", "ALERTS_DIR", "ANALYSIS_DIR", "CHECKPOINT_DIR", "DRY_RUN_FILE", "EVIDENCE_DIR",
    "INCIDENTS_JSON", "INCIDENTS_PARQUET", "LABELS_FILE", "LINEAGE_FILE", "LIVE_DIR", "MANAGER_DIR", "OUTBOX_FILE",
    "QUARANTINE_FILE", "RECOVERY_DIR", "RUN_FILE", "STATE_FILE", "STEP_TIMES_DIR", "TELEMETRY_DIR", "VIEWS_DIR",
    "DecisionRecord", "QuarantineEntry", "RecoveryRecordDoc", "RunDir", "RunFileError", "append_launch",
    "atomic_write", "claim_launch", "fsync_path", "handled_incidents", "private_file", "next_recovery_id", "read_launches", "read_quarantine", "read_recovery_records", "recovery_record_paths",
    "write_json", "write_quarantine", "write_recovery_record",
]

RUN_FILE = "run.json"
TELEMETRY_DIR = "telemetry"
LIVE_DIR = "live"
STEP_TIMES_DIR = "step_times"
CHECKPOINT_DIR = "checkpoints"
LINEAGE_FILE = "lineage.jsonl"
QUARANTINE_FILE = "quarantine.json"
RECOVERY_DIR = "recovery"
DRY_RUN_FILE = "dry-run.json"
"""`<run>/recovery/dry-run.json`: a recovery plan decided but not carried out, in a recovery record's shape."""
EVIDENCE_DIR = "evidence"
ANALYSIS_DIR = "analysis"
INCIDENTS_PARQUET = "incidents.parquet"
INCIDENTS_JSON = "incidents.json"
VIEWS_DIR = "views"
"""Under `<run>/analysis/`."""
ALERTS_DIR = "alerts"
OUTBOX_FILE = "outbox.sqlite"
MANAGER_DIR = "manager"
STATE_FILE = "state.sqlite"
ALERTMANAGER_LOG = "alertmanager.jsonl"
LABELS_FILE = "labels.json"
"""A simulated run's ground truth (`simulator.labels`)."""

_RECORD_PREFIX = "recovery-"

RUN_MARKERS = (RUN_FILE, TELEMETRY_DIR, LIVE_DIR, CHECKPOINT_DIR, LINEAGE_FILE)
"""What every run directory holds at least one of: a folder with none of them is not a run."""


def run_dir_problem(path: Path | str) -> str | None:
    """Why `path` is not a run directory, in one line naming it (None: it is one)."""
    p = Path(path)
    if not p.exists():
        return f"{p}: not a run directory (does not exist)"
    if not p.is_dir():
        return f"{p}: not a run directory (a file)"
    if not any((p / m).exists() for m in RUN_MARKERS):
        return f"{p}: not a run directory (none of {', '.join(RUN_MARKERS)} in it)"
    return None


class RunFileError(ValueError):
    """One of the run directory's own files (run.json, a recovery record, the quarantine list) cannot be read as
    what it should be; the message names the file and the problem on one line."""


@dataclass(frozen=True, slots=True)
class RunDir:
    """Every path under one run directory (see the module docstring); nothing is created or checked."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def telemetry(self) -> Path:
        return self.root / TELEMETRY_DIR

    @property
    def live(self) -> Path:
        return self.root / LIVE_DIR

    @property
    def step_times(self) -> Path:
        return self.root / STEP_TIMES_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINT_DIR

    @property
    def lineage(self) -> Path:
        return self.root / LINEAGE_FILE

    @property
    def quarantine(self) -> Path:
        return self.root / QUARANTINE_FILE

    @property
    def recovery(self) -> Path:
        return self.root / RECOVERY_DIR

    def recovery_record(self, rid: str) -> Path:
        return self.recovery / f"{rid}.json"

    @property
    def dry_run(self) -> Path:
        return self.recovery / DRY_RUN_FILE

    @property
    def evidence(self) -> Path:
        return self.root / EVIDENCE_DIR

    @property
    def analysis(self) -> Path:
        return self.root / ANALYSIS_DIR

    @property
    def views(self) -> Path:
        return self.analysis / VIEWS_DIR

    @property
    def alerts(self) -> Path:
        return self.root / ALERTS_DIR

    @property
    def outbox(self) -> Path:
        return self.alerts / OUTBOX_FILE

    @property
    def manager(self) -> Path:
        return self.root / MANAGER_DIR

    @property
    def manager_state(self) -> Path:
        return self.manager / STATE_FILE

    @property
    def alertmanager_log(self) -> Path:
        return self.manager / ALERTMANAGER_LOG

    def job_log(self, attempt: int) -> Path:
        """The output of an attempt the recovery manager launched by command (`control.command`)."""
        return self.manager / f"attempt-{attempt}.log"


# ---------------------------------------------------------------------------------------------------- writing


def fsync_path(path: Path | str) -> None:
    """fsync a file or a folder by path (a folder: so a rename inside it survives a host crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path | str, data: bytes | str | Callable[[Path], object], *, durable: bool = True,
                 tmp: Path | None = None) -> Path:
    """Publish `path` whole: write under a temporary name in the same folder (made if missing), then rename over
    `path`. `data` is the bytes or text, or a function that writes the temporary file at the path it is given (a
    parquet writer; the checkpoint protocol's fault injection mid-write). `durable`: fsync the file before the rename
    and the folder after it, so the file survives a host crash, not only a killed process; writers whose files are
    derived or hot pass False, and say why where they do. `tmp`: the temporary name when a protocol names it (the
    checkpoint commit protocol's `<file>.tmp`); by default a hidden name unique to this write. The temporary file
    is removed when the write fails (a full disk) and the exception propagates. Files get the mode the umask gives,
    as a plain `open` would."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        if callable(data):
            data(tmp)
            if durable:
                fsync_path(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)
    return path


def private_file(path: Path | str) -> Path:
    """`path` made (empty) if missing and readable and writable by its owner only (mode 0600): the run's state files
    that hold what others must not read or forge (the service's ledger, the monitor's outbox). SQLite gives a
    database's -wal and -shm files the database file's mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)
    return path


def write_json(path: Path | str, doc: Any, *, indent: int | None = 2) -> Path:
    """`doc` as JSON, published whole and durably (`atomic_write`)."""
    return atomic_write(path, json.dumps(doc, indent=indent))


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunFileError(f"{path}: unreadable {what} ({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------------------------------------------- run.json


_LAUNCH_TYPES = {"attempt": int, "started_wall_ns": int, "world_size": int, "layout": str, "steps": int}
"""Types of the keys every reader relies on, checked where present (what a consumer needs and lacks, it names)."""


def read_launches(run_dir: Path | str, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Every launch record of `<run>/run.json`, oldest first. A missing file is [] with `missing_ok`, else a
    RunFileError; a file that is not a run file (not JSON, not an object with a `launches` list of objects, a key of
    the wrong type, attempts out of order) is a RunFileError naming it and the problem."""
    path = RunDir(Path(run_dir)).run_file
    if not path.exists():
        if missing_ok:
            return []
        raise RunFileError(f"{path}: no run file — not a canary run directory")
    if not path.is_file():
        raise RunFileError(f"{path}: not a file")
    doc = _read_json(path, "run file")
    if not isinstance(doc, dict) or not isinstance(doc.get("launches"), list):
        raise RunFileError(f"{path}: not a run file (expected an object with a 'launches' list)")
    launches: list[dict[str, Any]] = doc["launches"]
    for n, rec in enumerate(launches):
        if not isinstance(rec, dict):
            raise RunFileError(f"{path}: launch {n} is not an object")
        for key, kind in _LAUNCH_TYPES.items():
            if key in rec and (not isinstance(rec[key], kind) or isinstance(rec[key], bool)):
                raise RunFileError(f"{path}: launch {n}: {key!r} is {rec[key]!r}, not {kind.__name__}")
        if rec.get("attempt", n) != n:
            raise RunFileError(f"{path}: launch {n} says attempt {rec['attempt']}: records edited or reordered")
    return launches


def claim_launch(run_dir: Path | str, key: str, record: Mapping[str, Any]) -> int:
    """The attempt number of the launch `key` names (e.g. torchrun's run id and restart count), the same in every
    process of that launch: the launch already recorded under `key` in `<run>/run.json`, else `record` appended
    under it. Every rank of a launch (and its host agent) calls it, on any host that shares the run directory, so
    the appending is serialized by an exclusive lock on ``run.json.lock`` (`fcntl.flock`) and needs no collective.
    RunFileError as `read_launches` when the run file is not one."""
    import fcntl

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    lock = RunDir(run).run_file.with_name(RunDir(run).run_file.name + ".lock")
    with open(lock, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            for rec in read_launches(run, missing_ok=True):
                if rec.get("launch_key") == key:
                    return int(rec["attempt"])
            return append_launch(run, {**record, "launch_key": key})
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def append_launch(run_dir: Path | str, record: Mapping[str, Any]) -> int:
    """Append one launch to `<run>/run.json` (its `attempt` is set here) and return its attempt number. The file is
    replaced whole and durably; a run file that cannot be read is not overwritten (RunFileError)."""
    launches = read_launches(run_dir, missing_ok=True)
    attempt = len(launches)
    launches.append({"attempt": attempt, **{k: v for k, v in record.items() if k != "attempt"}})
    write_json(RunDir(Path(run_dir)).run_file, {"launches": launches})
    return attempt


# ------------------------------------------------------------------------------------------------- quarantine


@dataclass(frozen=True, kw_only=True, slots=True)
class QuarantineEntry:
    """One device (UUID), host or link taken out of placement, and why."""

    kind: str
    """`device`, `host` or `link` (the recovery policy's target kinds)."""
    id: str
    incident: str = ""
    """The incident behind it."""
    recovery: str = ""
    """The recovery record that quarantined it."""
    wall_ns: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "incident": self.incident, "recovery": self.recovery,
                "wall_ns": self.wall_ns}


def read_quarantine(run_dir: Path | str) -> tuple[QuarantineEntry, ...]:
    """The run's quarantine list (`<run>/quarantine.json`), in the order entries were added; () when there is none.
    RunFileError naming the file when it is not a quarantine list."""
    path = RunDir(Path(run_dir)).quarantine
    if not path.exists():
        return ()
    doc = _read_json(path, "quarantine list")
    items = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise RunFileError(f"{path}: not a quarantine list (expected an object with an 'entries' list)")
    out = []
    for it in items:
        if not isinstance(it, dict) or "kind" not in it or "id" not in it:
            raise RunFileError(f"{path}: not a quarantine list (an entry without kind and id: {it!r:.80})")
        wall = it.get("wall_ns")
        out.append(QuarantineEntry(kind=str(it["kind"]), id=str(it["id"]), incident=str(it.get("incident") or ""),
                                   recovery=str(it.get("recovery") or ""),
                                   wall_ns=wall if isinstance(wall, int) and not isinstance(wall, bool) else None))
    return tuple(out)


def write_quarantine(run_dir: Path | str, entries: Iterable[QuarantineEntry]) -> Path:
    """Replace the run's quarantine list whole and durably."""
    return write_json(RunDir(Path(run_dir)).quarantine, {"entries": [e.to_dict() for e in entries]})


# ------------------------------------------------------------------------------------------- recovery records


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionRecord:
    """One incident's decision as a recovery record keeps it."""

    incident: str
    klass: str
    subject: str
    action: str
    target: str | None
    path: tuple[str, ...]
    reasons: tuple[str, ...]
    comparability: str | None
    changed: tuple[str, ...]
    incident_doc: Mapping[str, Any] | None
    """The whole incident as analytics wrote it (`Incident.to_dict`), when the record carries it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryRecordDoc:
    """A recovery record (`<run>/recovery/recovery-NNNN.json`) or the dry-run plan (`dry-run.json`), as read."""

    path: Path
    id: str
    wall_ns: int | None
    incidents: tuple[str, ...]
    """The incidents it decided about."""
    action: str | None
    """The one action carried out for all of them."""
    checkpoint: str | None
    decisions: tuple[DecisionRecord, ...]
    outcome: str
    """observed | quarantined | recovered | relaunch_failed | relaunch_refused; `proposed` for the dry-run plan."""
    proposed: bool
    """True for the dry-run plan: decided, never carried out."""
    doc: Mapping[str, Any]
    """The whole record as written (escalations, evidence, retired checkpoints, the relaunch, the advice)."""
    detected_wall_ns: int | None = None
    """When the manager's side first knew the attempt needed it (`detected_by` says how); None in a record written
    before the manager recorded it. `wall_ns` is when the record was written: after the relaunch it started."""
    detected_by: str | None = None
    """What that first knowledge was: the launcher's exit record of a rank that ended abnormally, the alert that
    reached the service, or the analysis that raised the incidents."""
    decided_wall_ns: int | None = None
    """When the manager had decided (its plan made, before anything it does is begun); None in an older record."""


def _strs(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise TypeError(f"{what} is not a list")
    return tuple(str(v) for v in value)


def _decision(d: Any) -> DecisionRecord:
    if not isinstance(d, dict):
        raise TypeError(f"a decision is {type(d).__name__}, not an object")
    lineage = d.get("lineage") or {}
    doc = d.get("incident_doc")
    return DecisionRecord(
        incident=str(d["incident"]), klass=str(d["class"]), subject=str(d["subject"]), action=str(d["action"]),
        target=None if d.get("target") is None else str(d["target"]), path=_strs(d.get("path", []), "path"),
        reasons=_strs(d.get("reasons", []), "reasons"),
        comparability=None if lineage.get("comparability") is None else str(lineage["comparability"]),
        changed=_strs(lineage.get("changed", []), "lineage.changed"), incident_doc=doc if doc else None)


def _record(path: Path) -> RecoveryRecordDoc:
    doc = _read_json(path, "recovery record")
    proposed = path.name == DRY_RUN_FILE
    try:
        if not isinstance(doc, dict):
            raise TypeError(f"the record is {type(doc).__name__}, not an object")
        wall = doc.get("wall_ns")
        by = doc.get("detected_by")
        if by is not None and not isinstance(by, str):
            raise RunFileError(f"{path}: detected_by is {type(by).__name__}, not a string")
        return RecoveryRecordDoc(
            path=path, id=str(doc.get("id") or path.stem),
            wall_ns=wall if isinstance(wall, int) and not isinstance(wall, bool) else None,
            incidents=_strs(doc["incidents"], "incidents"),
            action=None if doc.get("action") is None else str(doc["action"]),
            checkpoint=None if doc.get("checkpoint") is None else str(doc["checkpoint"]),
            decisions=tuple(_decision(d) for d in doc["decisions"]),
            outcome=str(doc.get("outcome") or ("proposed" if proposed else "")), proposed=proposed, doc=doc,
            detected_wall_ns=_wall_ns(doc, "detected_wall_ns", path), detected_by=by,
            decided_wall_ns=_wall_ns(doc, "decided_wall_ns", path))
    except (KeyError, TypeError, AttributeError) as exc:
        raise RunFileError(f"{path}: not a recovery record ({type(exc).__name__}: {exc})") from None


def _wall_ns(doc: Mapping[str, Any], key: str, path: Path) -> int | None:
    """An optional wall-clock time in ns: absent or null is None (a record written before the key existed)."""
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RunFileError(f"{path}: {key} is {value!r}, not a wall-clock time in ns (an integer >= 0)")
    return value


def recovery_record_paths(run_dir: Path | str) -> list[Path]:
    """The run's recovery records (`recovery-NNNN.json`), oldest first; the dry-run plan is not one."""
    return sorted(RunDir(Path(run_dir)).recovery.glob(f"{_RECORD_PREFIX}*.json"))


def read_recovery_records(run_dir: Path | str, *, dry_run: bool = False,
                          damaged: list[str] | None = None) -> tuple[RecoveryRecordDoc, ...]:
    """Every recovery record of the run, oldest first (`recovery-NNNN.json` by number), then with `dry_run` the
    dry-run plan when there is one. A record that cannot be read is a RunFileError naming it, unless the caller
    passes a `damaged` list: the live loop, which must keep going, then gets each such record's one-line problem
    there and the record is left out."""
    rd = RunDir(Path(run_dir))
    paths = recovery_record_paths(run_dir)
    if dry_run and rd.dry_run.exists():
        paths.append(rd.dry_run)
    out = []
    for p in paths:
        try:
            out.append(_record(p))
        except RunFileError as exc:
            if damaged is None:
                raise
            damaged.append(str(exc))
    return tuple(out)


def next_recovery_id(run_dir: Path | str) -> str:
    """The id the next recovery record of the run takes: recovery-0001, recovery-0002, ..."""
    n = len(recovery_record_paths(run_dir))
    return f"{_RECORD_PREFIX}{n + 1:04d}"


def write_recovery_record(run_dir: Path | str, rid: str, doc: Mapping[str, Any]) -> Path:
    """Publish a recovery record (or, with `rid` "dry-run", the dry-run plan, replacing the previous one) whole and
    durably. A dry-run plan is never read as a recovery that happened (`read_recovery_records` reads it only when
    asked, flagged `proposed`)."""
    rd = RunDir(Path(run_dir))
    return write_json(rd.dry_run if rid == "dry-run" else rd.recovery_record(rid), dict(doc))


def handled_incidents(records: Sequence[RecoveryRecordDoc]) -> set[str]:
    """The incident ids the (non-dry-run) records acted on."""
    return {i for r in records if not r.proposed for i in r.incidents}
