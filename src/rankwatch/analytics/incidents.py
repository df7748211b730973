"""Incidents: one typed, frozen record per thing that went wrong, with the evidence behind it.

Every detector returns a tuple of `Incident`. An incident names its failure class, the subject at the level the
evidence supports (a rank, a device, a host's input pipeline, an inter-host link, a pipeline stage, a data-parallel
replica, the job), the ranks involved, when it started and when it could first be told, how sure the detector is,
the cause when the evidence supports one, and the rows that support it. An incident whose device shows direct
hardware evidence (`hardware`: throttling with clock loss, new uncorrectable ECC errors, hardware XIDs, corrected
ECC errors rising on that device only) is a device fault (`device_fault`) and names the device as its subject.

Incidents serialize to JSON (`to_json`) and to a parquet table (`incidents_table`) with one row per incident and
the evidence as a JSON string column; `read_incidents` reads either back.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rankwatch.base.rundir import INCIDENTS_JSON, INCIDENTS_PARQUET, atomic_write

INCIDENTS_VERSION = 3
"""2: `hardware` (and `device_fault`, derived from it) added; version-1 files read as incidents without hardware
evidence. 3: `impact` added; earlier files read as incidents without one."""
EVIDENCE_ROWS_MAX = 20
"""Evidence keeps at most this many rows per item: enough to show the pattern, small enough to read."""


class IncidentClass(StrEnum):
    STRAGGLER = "straggler"
    """Alive but late: a rank, host input pipeline or link that holds the others back, persistently or in bursts."""
    FAIL_STOP = "fail_stop"
    """Gone: the rank stopped (exit, signal, killed) while its peers went on or blocked waiting for it."""
    HANG = "hang"
    """Alive but stuck: the process still beats its heartbeat but no longer completes steps or collectives."""
    DIVERGENCE = "divergence"
    """Ranks of one consistency domain disagree on step, RNG, data position, or state after such a disagreement."""
    CORRUPTION = "corruption"
    """Wrong values, no error: a state disagreement while step, RNG and data position agree, non-finite values,
    or local gradient-norm / loss outliers before the all-reduce."""
    IMBALANCE = "imbalance"
    """A job-design issue, not a device fault: a whole pipeline stage slower than the others, or random
    per-step data skew that makes a different rank late each step."""
    UNCLASSIFIED = "unclassified"
    """The anomaly model saw something unusual that no class explains; reported, not guessed."""
    CHECKPOINT = "checkpoint"
    """The job's own machinery failed: checkpoint saves that committed nothing. The job trains on, but the work since
    its last committed checkpoint has no recovery point (analytics/saves.py)."""


class SubjectKind(StrEnum):
    RANK = "rank"
    DEVICE = "device"
    HOST = "host"
    LINK = "link"
    STAGE = "stage"
    REPLICA = "replica"
    DOMAIN = "domain"
    JOB = "job"


class Cause(StrEnum):
    UNKNOWN = "unknown"
    # straggler causes
    THERMAL_THROTTLE = "thermal_throttle"
    POWER_THROTTLE = "power_throttle"
    HW_SLOWDOWN = "hw_slowdown"
    DATALOADER = "dataloader"
    CHECKPOINT_IO = "checkpoint_io"
    STORAGE_FULL = "storage_full"
    """A checkpoint save failed for want of space ("No space left on device", ENOSPC, or torch's short write)."""
    SLOW_LINK = "slow_link"
    DEVICE_SLOW = "device_slow"
    """Device clock: the rank's GPU took longer for its own work while its host thread kept pace (no throttle bits
    explain it)."""
    HOST_STALL = "host_stall"
    """Device clock: the rank's host thread took longer in its phases (outside dataloader waits), and its GPU waited
    for it — a stalled host thread or a slow CPU-side step, not the GPU."""
    # imbalance causes
    STAGE_IMBALANCE = "stage_imbalance"
    DATA_SKEW = "data_skew"
    # fail-stop / hang causes
    EXIT = "exit"
    SIGNAL = "signal"
    EXCEPTION = "exception"
    VANISHED = "vanished"
    NETWORK = "network"
    """The rank's own connections failed locally (aborted by its own stack, network down or unreachable) while its
    peers saw it go (analytics.transport): a partition of that rank; its process may be alive."""
    STUCK_IN_COLLECTIVE = "stuck_in_collective"
    STUCK_IN_STEP = "stuck_in_step"
    TRANSIENT_STALL = "transient_stall"
    """A rank stalled for seconds (one step many times the usual) while its peers waited for it, then carried on."""
    # divergence causes (the first field that disagreed)
    STEP_MISMATCH = "step_mismatch"
    RNG_MISMATCH = "rng_mismatch"
    DATA_POSITION_MISMATCH = "data_position_mismatch"
    STATE_MISMATCH = "state_mismatch"
    NONDETERMINISTIC_REPLAY = "nondeterministic_replay"
    """A step trained again after a rollback ended in another state than the attempt that trained it first."""
    # corruption causes
    HARDWARE_ERROR = "hardware_error"
    NON_FINITE = "non_finite"
    GRAD_NORM_OUTLIER = "grad_norm_outlier"
    LOSS_OUTLIER = "loss_outlier"
    VALUE_MISMATCH = "value_mismatch"


class HardwareSignal(StrEnum):
    """Direct evidence, from the device's own counters, that its hardware is at fault."""

    THROTTLE = "throttle"
    """Slowdown throttle reasons (thermal, power, hardware slowdown) on the device during its slow steps, not on its
    peers."""
    CLOCK_LOSS = "clock_loss"
    """The device's SM clock (relative to its max) below its peers' during its slow steps, by enough to explain a
    good part of the slowdown."""
    ECC_DBE = "ecc_dbe"
    """New uncorrectable (double-bit) ECC errors during the run."""
    XID = "xid"
    """Hardware XID events (memory, bus, NVLink faults; not application errors)."""
    ECC_SBE_RISING = "ecc_sbe_rising"
    """Corrected (single-bit) ECC errors rising during the run on this device, not on the others."""
    ROW_REMAP = "row_remap"
    """New remapped rows or retired pages during the run (the memory took a faulty row out of use)."""
    DRIVER_ERROR = "driver_error"
    """The rank's own error event carries the CUDA driver's report of a hardware fault on its device (uncorrectable
    ECC or NVLink error, the GPU fallen off the bus, a hardware XID): direct evidence even when the rank died before
    its NVML sampler read the counters."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Subject:
    """What the incident is about. `id` is the rank number, device UUID, host name, link name ('h0<->h1'),
    stage ('pp=1'), replica ('dp=0'), consistency-domain name, or 'job'."""

    kind: SubjectKind
    id: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence:
    """Rows behind an incident: which named query or table they come from, what they show, and up to
    `EVIDENCE_ROWS_MAX` rows of it (values are JSON: scalars, or lists such as a rank's steps)."""

    source: str
    summary: str
    columns: tuple[str, ...] = ()
    rows: tuple[tuple[Any, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.rows) > EVIDENCE_ROWS_MAX:
            object.__setattr__(self, "rows", self.rows[:EVIDENCE_ROWS_MAX])
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"evidence {self.source!r}: row {row!r} has {len(row)} values for {len(self.columns)} columns")


class ImpactBasis(StrEnum):
    WHATIF = "whatif"
    """Replayed: the job's steps replayed through their dependencies with the subject's work made ideal
    (`analytics.whatif`); what that saves is what the subject cost."""
    UNMEASURED = "unmeasured"
    """No time figure: the incident costs what its recovery costs (a rollback, a restart: `rankwatch goodput`), or
    the window could not be replayed; `Impact.note` says which."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Impact:
    """What an incident cost the job over the steps it was measured on. `lost_s`: wall seconds the job's steps took
    longer because of it; `gpu_hours`: that time on every rank of the job (everyone waits for a straggler);
    `share`: `lost_s` over the replayed time of the incident's span (its onset to the window's end), the share of
    step time lost; `slowdown`: the job's slowdown with only the subject slow (S_X = T(X as measured, the rest
    ideal) / T_ideal). None where the basis gives no figure."""

    basis: ImpactBasis
    lost_s: float | None = None
    gpu_hours: float | None = None
    share: float | None = None
    slowdown: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    """The steps the figures were measured over."""
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "basis", ImpactBasis(self.basis))
        for name in ("lost_s", "gpu_hours", "share", "slowdown"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"impact {name} {v!r}: not a finite number")

    def describe(self) -> str:
        if self.lost_s is None:
            return f"impact not measured ({self.note})" if self.note else "impact not measured"
        return (f"cost {self.share or 0.0:.1%} of step time over steps {self.first_step}..{self.last_step}: "
                f"{self.lost_s:.2f} s lost, {self.gpu_hours or 0.0:.4f} GPU-hours")

    def to_dict(self) -> dict[str, Any]:
        return {"basis": str(self.basis), "lost_s": self.lost_s, "gpu_hours": self.gpu_hours, "share": self.share,
                "slowdown": self.slowdown, "first_step": self.first_step, "last_step": self.last_step,
                "note": self.note}

    @classmethod
    def from_dict(cls, d: Any) -> Impact:
        if not isinstance(d, Mapping):
            raise TypeError(f"impact is {type(d).__name__}, not an object")
        return cls(basis=ImpactBasis(_typed(d, "basis", str)),
                   lost_s=_num(_typed(d, "lost_s", (int, float), none=True, default=None)),
                   gpu_hours=_num(_typed(d, "gpu_hours", (int, float), none=True, default=None)),
                   share=_num(_typed(d, "share", (int, float), none=True, default=None)),
                   slowdown=_num(_typed(d, "slowdown", (int, float), none=True, default=None)),
                   first_step=_typed(d, "first_step", int, none=True, default=None),
                   last_step=_typed(d, "last_step", int, none=True, default=None),
                   note=_typed(d, "note", str, default=""))


def _num(v: float | int | None) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultKey:
    """One fault's identity across analyses, windows and monitor restarts: its class, its subject and the attempt it
    happened in. Two incidents with one key while an alert about it is open are one episode of one fault."""

    klass: IncidentClass
    subject: Subject
    attempt: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Incident:
    """One incident. `confidence` is in [0, 1]: 1 = the evidence admits no other reading, 0.5 = as likely as not.
    `onset_step` is the first step the fault shows in; `detection_step` the step by which the detector had enough
    evidence to raise it (onset + the persistence it requires); `detection_wall_ns` that step's wall-clock end.
    `fields` names what disagreed or was abnormal (fingerprint fields, counters, signals). `hardware` is the direct
    hardware evidence found on the subject device (an `Evidence` item shows the rows); non-empty only for a DEVICE
    subject, and then the incident is a device fault. `last_good_step`, where the evidence is sampled (fingerprints
    every N steps), is the last step the subject's state was seen sound (the previous fingerprint its domain agreed
    on): the fault lies somewhere in (last_good_step, onset_step], so a recovery point saved after last_good_step may
    already hold it. None when the onset is exact (or nothing earlier was seen)."""

    klass: IncidentClass
    subject: Subject
    ranks: tuple[int, ...]
    onset_step: int | None
    detection_step: int | None
    confidence: float
    cause: Cause
    summary: str
    detection_wall_ns: int | None = None
    fields: tuple[str, ...] = ()
    evidence: tuple[Evidence, ...] = ()
    attempt: int | None = None
    hardware: tuple[HardwareSignal, ...] = ()
    last_good_step: int | None = None
    impact: Impact | None = None
    """What it cost the job (`analytics.impact` sets it on every incident of an analysis)."""
    id: str = field(default="")

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"incident {self.klass} {self.subject}: confidence {self.confidence} outside [0, 1]")
        if self.hardware and self.subject.kind is not SubjectKind.DEVICE:
            raise ValueError(f"incident {self.klass} {self.subject}: hardware evidence {[str(h) for h in self.hardware]} "
                             "names a device, but the subject is not one")
        object.__setattr__(self, "hardware", tuple(dict.fromkeys(HardwareSignal(h) for h in self.hardware)))
        if (self.last_good_step is not None and self.onset_step is not None
                and not self.last_good_step < self.onset_step):
            raise ValueError(f"incident {self.klass} {self.subject}: last good step {self.last_good_step} is not "
                             f"before the onset at step {self.onset_step}")
        object.__setattr__(self, "ranks", tuple(sorted({int(r) for r in self.ranks})))
        if not self.id:
            key = f"{self.klass}|{self.subject}|{self.onset_step}|{','.join(map(str, self.ranks))}"
            object.__setattr__(self, "id", f"{self.klass}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")

    @property
    def fault(self) -> FaultKey:
        """What stays the same while one fault goes on (`FaultKey`): the id also hashes the onset step and the ranks,
        which a sliding window moves (a fault that began before the window reads as beginning at its first step) and
        a spreading fault grows."""
        return FaultKey(klass=self.klass, subject=self.subject, attempt=self.attempt)

    @property
    def device_fault(self) -> bool:
        """True when direct hardware evidence implicates the subject device (`hardware` is non-empty)."""
        return bool(self.hardware)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "class": str(self.klass),
            "subject_kind": str(self.subject.kind),
            "subject": self.subject.id,
            "ranks": list(self.ranks),
            "onset_step": self.onset_step,
            "last_good_step": self.last_good_step,
            "detection_step": self.detection_step,
            "detection_wall_ns": self.detection_wall_ns,
            "confidence": round(self.confidence, 4),
            "cause": str(self.cause),
            "summary": self.summary,
            "fields": list(self.fields),
            "attempt": self.attempt,
            "device_fault": self.device_fault,
            "hardware": [str(h) for h in self.hardware],
            "impact": self.impact.to_dict() if self.impact is not None else None,
            "evidence": [
                {"source": e.source, "summary": e.summary, "columns": list(e.columns), "rows": [list(r) for r in e.rows]}
                for e in self.evidence
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Incident:
        """The incident `to_dict` wrote, every field type-checked (this is the incident's one schema: the analysis
        files and the alert wire format read it here). ValueError naming the incident and the first field that is
        missing or of another type: an incident document is evidence, so a value of the wrong shape is never taken
        for an answer."""
        where = f"incident record {d.get('id', '?')!r:.80}" if isinstance(d, Mapping) else "incident record"
        try:
            if not isinstance(d, Mapping):
                raise TypeError(f"is {type(d).__name__}, not an object")
            evidence = _typed(d, "evidence", list, default=[])
            return cls(
                id=_typed(d, "id", str),
                klass=IncidentClass(_typed(d, "class", str)),
                subject=Subject(kind=SubjectKind(_typed(d, "subject_kind", str)), id=_typed(d, "subject", str)),
                ranks=tuple(_each(_typed(d, "ranks", list), int, "ranks")),
                onset_step=_typed(d, "onset_step", int, none=True),
                last_good_step=_typed(d, "last_good_step", int, none=True, default=None),
                detection_step=_typed(d, "detection_step", int, none=True),
                detection_wall_ns=_typed(d, "detection_wall_ns", int, none=True, default=None),
                confidence=float(_typed(d, "confidence", (int, float))),
                cause=Cause(_typed(d, "cause", str)),
                summary=_typed(d, "summary", str),
                fields=tuple(_each(_typed(d, "fields", list, default=[]), str, "fields")),
                attempt=_typed(d, "attempt", int, none=True, default=None),
                hardware=tuple(HardwareSignal(h) for h in _each(_typed(d, "hardware", list, none=True, default=None)
                                                               or [], str, "hardware")),
                evidence=tuple(_evidence(e, n) for n, e in enumerate(evidence)),
                impact=(None if d.get("impact") is None else Impact.from_dict(d["impact"])),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from None


_MISSING = object()
_JSON_VALUES = (str, int, float, bool, type(None), list, dict)
"""What an evidence row holds: JSON values (scalars, and lists such as a rank's steps)."""


def _typed(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, none: bool = False,
           default: Any = _MISSING) -> Any:
    """`d[key]` of `kind` (a bool is never an int or a float), None when `none`; `default` when the key is absent."""
    if key not in d:
        if default is _MISSING:
            raise KeyError(key)
        return default
    value = d[key]
    if value is None and none:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds) + (" or null" if none else "")
        raise TypeError(f"{key!r} is {type(value).__name__}, not {want}")
    return value


def _each(values: list[Any], kind: type, what: str) -> list[Any]:
    for v in values:
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
            raise TypeError(f"{what!r} holds a {type(v).__name__}, not {kind.__name__}")
    return values


def _evidence(e: Any, n: int) -> Evidence:
    if not isinstance(e, Mapping):
        raise TypeError(f"evidence {n} is {type(e).__name__}, not an object")
    rows = _typed(e, "rows", list)
    for row in rows:
        if not isinstance(row, list) or not all(isinstance(v, _JSON_VALUES) for v in row):
            raise TypeError(f"evidence {n}: a row is not a list of JSON values")
    return Evidence(source=_typed(e, "source", str), summary=_typed(e, "summary", str),
                    columns=tuple(_each(_typed(e, "columns", list), str, f"evidence {n} columns")),
                    rows=tuple(tuple(r) for r in rows))


def sort_incidents(incidents: Iterable[Incident]) -> tuple[Incident, ...]:
    """Most consequential first: fail-stop and hang, corruption, divergence, failed checkpoint saves, straggler,
    imbalance, unclassified; then by onset."""
    order = {c: i for i, c in enumerate((IncidentClass.FAIL_STOP, IncidentClass.HANG, IncidentClass.CORRUPTION,
                                          IncidentClass.DIVERGENCE, IncidentClass.CHECKPOINT, IncidentClass.STRAGGLER,
                                          IncidentClass.IMBALANCE, IncidentClass.UNCLASSIFIED))}
    return tuple(sorted(incidents, key=lambda i: (order[i.klass], i.onset_step if i.onset_step is not None else -1, i.id)))


def to_json(incidents: Sequence[Incident]) -> str:
    return json.dumps({"version": INCIDENTS_VERSION, "incidents": [i.to_dict() for i in incidents]}, indent=2)


_TABLE_SCHEMA = pa.schema([
    ("id", pa.string()), ("class", pa.string()), ("subject_kind", pa.string()), ("subject", pa.string()),
    ("ranks", pa.list_(pa.int32())), ("onset_step", pa.int64()), ("detection_step", pa.int64()),
    ("detection_wall_ns", pa.int64()), ("confidence", pa.float64()), ("cause", pa.string()),
    ("summary", pa.string()), ("fields", pa.list_(pa.string())), ("attempt", pa.int32()), ("evidence", pa.string()),
    ("device_fault", pa.bool_()), ("hardware", pa.list_(pa.string())), ("last_good_step", pa.int64()),
    ("impact", pa.string()), ("impact_lost_s", pa.float64()), ("impact_gpu_hours", pa.float64()),
    ("impact_share", pa.float64()),
])
"""The impact is a JSON string (all of it) and, for queries, its three figures as columns."""


def incidents_table(incidents: Sequence[Incident]) -> pa.Table:
    rows = []
    for inc in incidents:
        d = inc.to_dict()
        d["evidence"] = json.dumps(d["evidence"])
        impact = d["impact"] or {}
        d["impact"] = json.dumps(d["impact"]) if d["impact"] is not None else None
        d["impact_lost_s"], d["impact_gpu_hours"], d["impact_share"] = (impact.get(k) for k in ("lost_s", "gpu_hours",
                                                                                                 "share"))
        rows.append(d)
    return pa.Table.from_pylist(rows, schema=_TABLE_SCHEMA)


def write_incidents(incidents: Sequence[Incident], out_dir: Path) -> tuple[Path, Path]:
    """Write `incidents.parquet` and `incidents.json` into `out_dir`, each published whole (`base.rundir.atomic_write`).
    A failed write (OSError: a full disk) leaves no temporary file, nor the folder where it made one."""
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    pq_path, js_path = out_dir / INCIDENTS_PARQUET, out_dir / INCIDENTS_JSON
    try:
        atomic_write(pq_path, lambda tmp: pq.write_table(incidents_table(incidents), tmp))
        atomic_write(js_path, to_json(incidents))
    except BaseException:
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    return pq_path, js_path


def read_incidents(path: Path) -> tuple[Incident, ...]:
    """Read incidents back from an `incidents.json` or `incidents.parquet` file."""
    try:
        if path.suffix == ".json":
            records = json.loads(path.read_text())["incidents"]
        else:
            records = pq.read_table(path).to_pylist()
            for r in records:
                r["evidence"] = json.loads(r["evidence"])
                if r.get("impact") is not None:
                    r["impact"] = json.loads(r["impact"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable incidents file ({type(exc).__name__}: {exc})") from None
    return tuple(Incident.from_dict(r) for r in records)
