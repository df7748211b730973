"""Evidence preservation: before a recovery action, copy what a post-mortem of the incident needs into the run.

``preserve_evidence`` gathers, into ``<run>/evidence/<incident_id>/`` and with the run's own relative layout:

- every telemetry part file of the affected ranks (all tables, optionally only parts modified at or after
  ``since_wall_ns``), plus every rank's ``events`` and ``topology`` parts (small, and needed to read the others);
- ``manifest.json`` of each named checkpoint, committed (``step-XXXXXXXX``) or unpublished (``.step-XXXXXXXX.tmp``),
  with the candidate's full directory listing and sizes (a half-written save is itself evidence);
- ``run.json``, ``lineage.jsonl`` and ``analysis/incidents.json`` when present;
- every rank's liveness record and exit record (``live/``: where each rank was, in which collective, and how it
  ended, at the moment of preserving).

Part files are immutable once renamed into place, so they are hard-linked where the filesystem allows (a later
rollback or retention that deletes the original leaves the link intact) and copied otherwise. Everything else can
still change (lineage appends, run.json gains launches), so it is copied; when a second call finds it changed, the
new content is kept beside the old one as ``<stem>.v<k><suffix>`` rather than overwriting it.

``evidence.json`` is written last, under a temporary name then renamed: a bundle without it is incomplete. It lists
every preserved file with its size and SHA-256 (``verify_evidence`` checks them) and, under ``missing``, each file
that vanished or could not be read while copying: the run may be live, so one bad file never aborts the bundle.
Preserving the same incident again only adds files and rewrites ``evidence.json``; nothing is ever deleted.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.base.rundir import (
    ANALYSIS_DIR, CHECKPOINT_DIR, EVIDENCE_DIR, INCIDENTS_JSON as INCIDENTS_FILE, LINEAGE_FILE, LIVE_DIR, RUN_FILE,
    TELEMETRY_DIR, atomic_write,
)
from rankwatch.base.schema import PARTITION_KEY, Table
from rankwatch.recovery.catalog import MANIFEST, sha256_file

EVIDENCE_FILE = "evidence.json"
EVIDENCE_FORMAT = 1
ALL_RANK_TABLES = (Table.EVENTS, Table.TOPOLOGY)
"""Tables preserved for every rank, whatever the affected ranks and ``since_wall_ns``."""

_PART_RE = re.compile(r"^part-\d+\.parquet$")
_RANK_DIR_RE = re.compile(rf"^{PARTITION_KEY}=(\d+)$")
_CHECKPOINT_ID_RE = re.compile(r"^step-\d{8}$")
_TMP_PREFIX = ".rankwatch-evidence-"
# Errors of os.link that mean "this filesystem cannot link here", not "the source is gone".
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES}


class Method(StrEnum):
    LINK = "link"
    """Hard link to the run's file (only for immutable part files)."""
    COPY = "copy"
    """Byte copy, taken at preservation time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvidenceFile:
    path: str
    """Path inside the bundle (``/``-separated); mirrors `source` except for later versions of a changed file."""
    source: str
    """Path of the original, relative to the run directory (``/``-separated)."""
    size: int
    """Bytes."""
    sha256: str
    """Hex SHA-256 of the preserved bytes."""
    method: Method
    """How it was preserved."""
    wall_ns: int
    """Wall-clock time (ns since the epoch) it was preserved."""

    def __post_init__(self) -> None:
        if not self.path or self.path.startswith("/") or ".." in self.path.split("/"):
            raise ValueError(f"evidence path {self.path!r} must be relative and stay inside the bundle")
        if self.size < 0:
            raise ValueError(f"evidence file {self.path}: size must be >= 0, got {self.size}")
        if len(self.sha256) != 64:
            raise ValueError(f"evidence file {self.path}: sha256 must be 64 hex digits, got {self.sha256!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MissingFile:
    source: str
    """Path relative to the run directory of what could not be preserved."""
    reason: str
    """One line: why (vanished, unreadable, no manifest, ...)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ListedFile:
    path: str
    """Path relative to the checkpoint candidate directory (``/``-separated)."""
    size: int | None
    """Bytes, or None when the file vanished between listing and stat."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointEvidence:
    checkpoint_id: str
    """``step-XXXXXXXX``."""
    directory: str
    """The candidate directory, relative to the run (``checkpoints/step-…`` or ``checkpoints/.step-….tmp``)."""
    partial: bool
    """True for an unpublished ``.tmp`` candidate."""
    manifest: str | None
    """Bundle path of its preserved ``manifest.json``; None when it had none or it could not be read."""
    listing: tuple[ListedFile, ...]
    """Every file in the candidate directory at preservation time, with sizes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvidenceBundle:
    path: Path
    """The bundle directory, ``<run>/evidence/<incident_id>``."""
    incident_id: str
    """The incident this bundle belongs to."""
    files: tuple[EvidenceFile, ...]
    """Every file in the bundle, from this and earlier calls, sorted by path."""
    copied: int
    """Files newly added to the bundle by this call (0 on a repeat with nothing new)."""
    bytes: int
    """Total bytes of `files`."""
    manifests: tuple[str, ...]
    """Bundle paths of the checkpoint manifests preserved by this call."""
    checkpoints: tuple[CheckpointEvidence, ...]
    """What this call found of each named checkpoint."""
    missing: tuple[MissingFile, ...]
    """What could not be preserved (this call, plus earlier calls' misses still not preserved)."""


def validate_incident_id(incident_id: str) -> None:
    """Raise ValueError unless `incident_id` is usable as one directory name inside ``<run>/evidence``."""
    if not incident_id:
        raise ValueError("incident_id must not be empty")
    if "/" in incident_id or "\\" in incident_id:
        raise ValueError(f"incident_id {incident_id!r} must be a single path component (no '/' or '\\')")
    if incident_id.startswith(".") or ".." in incident_id:
        raise ValueError(f"incident_id {incident_id!r} must not start with '.' or contain '..'")
    if not incident_id.isprintable():
        raise ValueError(f"incident_id {incident_id!r} must not contain control characters")


def evidence_dir(run_dir: Path, incident_id: str) -> Path:
    validate_incident_id(incident_id)
    return Path(run_dir) / EVIDENCE_DIR / incident_id


def preserve_evidence(
    run_dir: Path,
    *,
    incident_id: str,
    ranks: Sequence[int],
    since_wall_ns: int | None = None,
    checkpoint_ids: Sequence[str] = (),
    note: str = "",
) -> EvidenceBundle:
    """Copy the incident's evidence into ``<run>/evidence/<incident_id>/`` and describe it in ``evidence.json``.

    Raises ValueError only for a missing run directory or a malformed argument; a file that vanishes or cannot be
    read is recorded under ``missing`` instead. Safe to call again for the same incident: adds, never deletes.
    """
    validate_incident_id(incident_id)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: run directory does not exist")
    for r in ranks:
        if r < 0:
            raise ValueError(f"rank {r} must be >= 0")
    for cid in checkpoint_ids:
        if not _CHECKPOINT_ID_RE.match(cid):
            raise ValueError(f"checkpoint id {cid!r} must look like 'step-XXXXXXXX'")
    bundle = evidence_dir(run_dir, incident_id)
    bundle.mkdir(parents=True, exist_ok=True)

    copier = _Copier(run_dir=run_dir, bundle=bundle, previous=_read_previous(bundle))
    copier.telemetry(frozenset(ranks), since_wall_ns)
    checkpoints = tuple(c for cid in dict.fromkeys(checkpoint_ids) for c in copier.checkpoint(cid))
    copier.mutable(RUN_FILE)
    copier.mutable(LINEAGE_FILE)
    copier.mutable(f"{ANALYSIS_DIR}/{INCIDENTS_FILE}")
    live = run_dir / LIVE_DIR
    if live.is_dir():
        for name in sorted(os.listdir(live)):
            if not name.startswith("."):
                copier.mutable(f"{LIVE_DIR}/{name}")

    files = tuple(sorted(copier.entries.values(), key=lambda f: f.path))
    preserved_sources = {f.source for f in files}
    missing = {m.source: m for m in copier.previous_missing if m.source not in preserved_sources}
    missing.update({m.source: m for m in copier.missing})
    now = time.time_ns()
    call = {
        "wall_ns": now,
        "ranks": sorted(set(ranks)),
        "since_wall_ns": since_wall_ns,
        "checkpoint_ids": list(dict.fromkeys(checkpoint_ids)),
        "note": note,
        "copied": copier.copied,
        "checkpoints": [_checkpoint_json(c) for c in checkpoints],
        "missing": [{"source": m.source, "reason": m.reason} for m in copier.missing],
    }
    doc = {
        "format": EVIDENCE_FORMAT,
        "incident_id": incident_id,
        "created_wall_ns": copier.previous.get("created_wall_ns", now),
        "wall_ns": now,
        "ranks": call["ranks"],
        "since_wall_ns": since_wall_ns,
        "note": note,
        "calls": [*copier.previous.get("calls", []), call],
        "files": [_file_json(f) for f in files],
        "missing": [{"source": m.source, "reason": m.reason} for m in sorted(missing.values(), key=lambda m: m.source)],
    }
    _write_json_atomic(bundle / EVIDENCE_FILE, doc)
    return EvidenceBundle(
        path=bundle,
        incident_id=incident_id,
        files=files,
        copied=copier.copied,
        bytes=sum(f.size for f in files),
        manifests=tuple(c.manifest for c in checkpoints if c.manifest is not None),
        checkpoints=checkpoints,
        missing=tuple(sorted(missing.values(), key=lambda m: m.source)),
    )


def verify_evidence(path: Path) -> tuple[str, ...]:
    """Problems with the bundle at `path`, one line each: no or unreadable ``evidence.json`` (an incomplete bundle),
    a listed file missing or differing in size or SHA-256, a file in the bundle that is not listed. Empty = intact."""
    path = Path(path)
    doc_path = path / EVIDENCE_FILE
    try:
        doc = json.loads(doc_path.read_text())
        files = [_file_from_json(d) for d in doc["files"]]
    except FileNotFoundError:
        return (f"{doc_path}: missing; the bundle is incomplete",)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return (f"{doc_path}: unreadable ({exc})",)
    problems: list[str] = []
    for f in files:
        p = path / f.path
        try:
            size = p.stat().st_size
            if size != f.size:
                problems.append(f"{f.path}: size {size} != recorded {f.size}")
            elif sha256_file(p) != f.sha256:
                problems.append(f"{f.path}: SHA-256 differs from the recorded one")
        except FileNotFoundError:
            problems.append(f"{f.path}: missing from the bundle")
        except OSError as exc:
            problems.append(f"{f.path}: unreadable ({exc.strerror or exc})")
    listed = {f.path for f in files} | {EVIDENCE_FILE}
    for root, _dirs, names in os.walk(path):
        for name in names:
            rel = (Path(root) / name).relative_to(path).as_posix()
            if rel not in listed:
                problems.append(f"{rel}: in the bundle but not listed in {EVIDENCE_FILE}")
    return tuple(problems)


class _Copier:
    """One preservation call: what was in the bundle before, what it adds, what it could not get."""

    def __init__(self, *, run_dir: Path, bundle: Path, previous: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.bundle = bundle
        self.previous = previous
        self.entries: dict[str, EvidenceFile] = {}
        self.previous_missing: list[MissingFile] = []
        for d in previous.get("files", []):
            try:
                f = _file_from_json(d)
            except (ValueError, KeyError, TypeError):
                continue
            self.entries[f.path] = f
        for d in previous.get("missing", []):
            if isinstance(d, dict) and isinstance(d.get("source"), str):
                self.previous_missing.append(MissingFile(source=d["source"], reason=str(d.get("reason", ""))))
        self.missing: list[MissingFile] = []
        self.copied = 0

    def _miss(self, source: str, reason: str) -> None:
        self.missing.append(MissingFile(source=source, reason=reason))

    def telemetry(self, ranks: frozenset[int], since_wall_ns: int | None) -> None:
        root = self.run_dir / TELEMETRY_DIR
        for table_dir in _subdirs(root):
            every_rank = table_dir.name in {str(t) for t in ALL_RANK_TABLES}
            for rank_dir in _subdirs(table_dir):
                m = _RANK_DIR_RE.match(rank_dir.name)
                if m is None or not (every_rank or int(m.group(1)) in ranks):
                    continue
                for part in _part_files(rank_dir):
                    source = part.relative_to(self.run_dir).as_posix()
                    if not every_rank and since_wall_ns is not None:
                        try:
                            if part.stat().st_mtime_ns < since_wall_ns:
                                continue
                        except OSError as exc:
                            self._miss(source, _reason(exc))
                            continue
                    self.immutable(source)

    def immutable(self, source: str) -> None:
        """Preserve an immutable file under its own relative path: link if possible, else copy; skip if held."""
        dest = self.bundle / source
        if dest.exists():
            if source not in self.entries:  # left by an earlier call that stopped before writing evidence.json
                self._record(source, source, Method.LINK if dest.stat().st_nlink > 1 else Method.COPY, new=False)
            return
        src = self.run_dir / source
        dest.parent.mkdir(parents=True, exist_ok=True)
        method = Method.LINK
        try:
            try:
                os.link(src, dest)
            except FileNotFoundError:
                raise
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
                method = Method.COPY
                _copy_atomic(src, dest)
        except OSError as exc:
            self._miss(source, _reason(exc))
            return
        self._record(source, source, method, new=True)

    def mutable(self, source: str) -> str | None:
        """Preserve a file that may still change: copy it; a changed content becomes a new version beside the old.

        Returns its bundle path, or None when absent (not recorded as missing: these files are optional) or
        unreadable (recorded)."""
        src = self.run_dir / source
        if not src.is_file():
            return None
        dest = self.bundle / source
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{_TMP_PREFIX}{dest.name}.{os.getpid()}.tmp"
        try:
            shutil.copyfile(src, tmp)
            sha = sha256_file(tmp)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._miss(source, _reason(exc))
            return None
        for f in self.entries.values():
            if f.source == source and f.sha256 == sha and (self.bundle / f.path).exists():
                tmp.unlink()
                return f.path
        target, k = dest, 1
        while target.exists():
            k += 1
            target = dest.with_name(f"{Path(source).stem}.v{k}{Path(source).suffix}")
        os.replace(tmp, target)
        rel = target.relative_to(self.bundle).as_posix()
        self.entries[rel] = EvidenceFile(
            path=rel, source=source, size=target.stat().st_size, sha256=sha, method=Method.COPY, wall_ns=time.time_ns()
        )
        self.copied += 1
        return rel

    def checkpoint(self, cid: str) -> list[CheckpointEvidence]:
        found: list[CheckpointEvidence] = []
        for name, partial in ((cid, False), (f".{cid}.tmp", True)):
            directory = self.run_dir / CHECKPOINT_DIR / name
            if not directory.is_dir():
                continue
            rel_dir = f"{CHECKPOINT_DIR}/{name}"
            manifest = self.mutable(f"{rel_dir}/{MANIFEST}")
            if manifest is None and not partial and not any(m.source == f"{rel_dir}/{MANIFEST}" for m in self.missing):
                self._miss(f"{rel_dir}/{MANIFEST}", "committed checkpoint has no manifest.json")
            found.append(
                CheckpointEvidence(
                    checkpoint_id=cid,
                    directory=rel_dir,
                    partial=partial,
                    manifest=manifest,
                    listing=_listing(directory),
                )
            )
        if not found:
            self._miss(f"{CHECKPOINT_DIR}/{cid}", "no such checkpoint (neither committed nor partial)")
        return found

    def _record(self, path: str, source: str, method: Method, *, new: bool) -> None:
        p = self.bundle / path
        try:
            size, sha = p.stat().st_size, sha256_file(p)
        except OSError as exc:
            self._miss(source, _reason(exc))
            return
        self.entries[path] = EvidenceFile(
            path=path, source=source, size=size, sha256=sha, method=method, wall_ns=time.time_ns()
        )
        self.copied += int(new)


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except OSError:
        return []


def _part_files(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if _PART_RE.match(p.name))
    except OSError:
        return []


def _listing(directory: Path) -> tuple[ListedFile, ...]:
    out: list[ListedFile] = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            p = Path(root) / name
            try:
                size: int | None = p.stat().st_size
            except OSError:
                size = None
            out.append(ListedFile(path=p.relative_to(directory).as_posix(), size=size))
    return tuple(sorted(out, key=lambda f: f.path))


def _copy_atomic(src: Path, dest: Path) -> None:
    # not fsynced: the bundle's evidence.json (durable) holds every copy's SHA-256, so a copy torn by a host crash
    # fails `verify_evidence` instead of passing for evidence
    atomic_write(dest, lambda tmp: shutil.copyfile(src, tmp), durable=False,
                 tmp=dest.parent / f"{_TMP_PREFIX}{dest.name}.{os.getpid()}.tmp")


def _reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "vanished before it could be copied"
    return f"unreadable ({exc.strerror or type(exc).__name__})"


def _read_previous(bundle: Path) -> dict[str, Any]:
    """The bundle's existing evidence.json, or {} when there is none or it cannot be read (then it is rebuilt)."""
    try:
        doc = json.loads((bundle / EVIDENCE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(doc, indent=1, sort_keys=True) + "\n",
                 tmp=path.parent / f"{_TMP_PREFIX}{path.name}.{os.getpid()}.tmp")


def _file_json(f: EvidenceFile) -> dict[str, Any]:
    return {"path": f.path, "source": f.source, "size": f.size, "sha256": f.sha256, "method": str(f.method),
            "wall_ns": f.wall_ns}


def _file_from_json(d: dict[str, Any]) -> EvidenceFile:
    return EvidenceFile(path=str(d["path"]), source=str(d["source"]), size=int(d["size"]), sha256=str(d["sha256"]),
                        method=Method(d["method"]), wall_ns=int(d["wall_ns"]))


def _checkpoint_json(c: CheckpointEvidence) -> dict[str, Any]:
    return {"checkpoint_id": c.checkpoint_id, "directory": c.directory, "partial": c.partial, "manifest": c.manifest,
            "listing": [{"path": f.path, "size": f.size} for f in c.listing]}
