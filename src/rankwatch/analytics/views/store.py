"""Stored views: `write_views` stores an analysis' views as small parquet files under `<run>/analysis/views/` (or the
user's cache when the run's folder cannot be written) with a manifest naming the telemetry they were computed from;
`ViewStore` opens them in milliseconds where opening the telemetry of a 2,048-rank run takes tens of seconds, and
tells when the telemetry grew since (`stale`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.incidents import Incident, read_incidents, write_incidents
from rankwatch.base.rundir import INCIDENTS_JSON, RunDir, atomic_write

_R, _S = "rank", "step"


VIEWS_VERSION = 1


MANIFEST = "manifest.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class ViewSummary:
    """The run at a glance, from the analysis the views were built by."""

    run_dir: str
    ranks: int
    first_step: int
    last_step: int
    clock: str
    start_wall_ns: int
    end_wall_ns: int
    wall_s: float
    """From the first rank's start to the newest record."""
    effective_s: float
    """Training time the final trajectory kept: per step the slowest rank's duration, each step once (replayed and
    lost steps, restarts, stalls outside steps are not counted)."""
    steps_per_s: float
    """Steps of the final trajectory per wall second over the run."""
    incidents: int
    warnings: tuple[str, ...]
    since_step: int | None
    """The window the analysis read (None = the whole run)."""
    layout: dict[str, int]
    hosts: int
    signature: tuple[int, int, int]
    """`telemetry_signature` of the telemetry the views were computed from."""
    built_wall_ns: int
    ended: bool = False
    """Every rank recorded its exit (an `exit` event) in its latest attempt: no rank was running when the views
    were built (False for views stored before the field)."""

    @property
    def goodput(self) -> float:
        return self.effective_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in
                ((f, getattr(self, f)) for f in self.__slots__)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViewSummary:
        d = dict(d)
        d["warnings"] = tuple(d.get("warnings", ()))
        d["signature"] = tuple(d["signature"])
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunViews:
    """Every view of one analysis, in memory (what `write_views` stores)."""

    summary: ViewSummary
    incidents: tuple[Incident, ...]
    frames: dict[str, pl.DataFrame] = field(default_factory=dict)


def telemetry_signature(run_dir: Path | str) -> tuple[int, int, int]:
    """(folders, checksum of their modification times, newest of them, ns) under the run's telemetry: changes
    whenever a rank or a rollup publishes a part (parts are immutable files renamed into their folder, which changes
    the folder's time). Only folders are looked at: a 2,048-rank run has ~16,000 part files but a folder per rank and
    table, read in well under a second."""
    folders = total = newest = 0
    stack = [RunDir(Path(run_dir)).telemetry]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
            mtime = os.stat(d).st_mtime_ns
        except OSError:
            continue
        folders += 1
        total = (total + mtime) % (1 << 62)
        newest = max(newest, mtime)
        with it:
            stack.extend(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
    return folders, total, newest


def views_dir(run_dir: Path | str) -> Path:
    return RunDir(Path(run_dir)).views


def _fallback_dir(run_dir: Path | str) -> Path:
    """Where views of a run whose folder cannot be written go (a read-only copy): the user's cache."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rankwatch" / "views" / key


def _parquet_writer(df: pl.DataFrame) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        df.write_parquet(tmp, row_group_size=65_536)
    return write


def write_views(views: RunViews, out: Path | None = None) -> Path:
    """Store the views (parquet per frame, the incidents, the manifest last: a reader sees a complete set or the
    previous one). Into `<run>/analysis/views/`, or the user's cache when the run's folder cannot be written.
    Returns the folder."""
    targets = [out] if out is not None else [views_dir(views.summary.run_dir), _fallback_dir(views.summary.run_dir)]
    last: OSError | None = None
    for d in targets:
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / MANIFEST).unlink(missing_ok=True)
            for name, df in views.frames.items():  # derived: rebuilt from the telemetry when missing, so not fsynced
                atomic_write(d / f"{name}.parquet", _parquet_writer(df), durable=False)
            write_incidents(views.incidents, d)
            atomic_write(d / MANIFEST, json.dumps({"version": VIEWS_VERSION, "summary": views.summary.to_dict(),
                                                   "frames": sorted(views.frames)}, indent=1), durable=False)
            return d
        except OSError as exc:
            last = exc
    raise RunDirError(f"{targets[0]}: cannot store the run's views ({last})")


class ViewStore:
    """Stored views of one run, each frame read when first asked for. `run_dir` is the run folder they were opened
    for (a run copied or moved elsewhere keeps views that name the folder they were built in)."""

    def __init__(self, folder: Path, run_dir: Path | str | None = None):
        self.folder = folder
        path = folder / MANIFEST
        try:
            doc = json.loads(path.read_text())
            if doc.get("version") != VIEWS_VERSION:
                raise ValueError(f"views version {doc.get('version')!r}, this rankwatch reads {VIEWS_VERSION}")
            self.summary = ViewSummary.from_dict(doc["summary"])
            self.names = tuple(doc["frames"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RunDirError(f"{path}: unreadable views manifest ({type(exc).__name__}: {exc})") from None
        self._frames: dict[str, pl.DataFrame] = {}
        self._incidents: tuple[Incident, ...] | None = None
        self._run_dir = Path(run_dir if run_dir is not None else self.summary.run_dir)

    @property
    def run_dir(self) -> Path:
        return self._run_dir

    def frame(self, name: str) -> pl.DataFrame:
        if name not in self.names:
            raise KeyError(f"view {name!r}: not stored; stored: {', '.join(self.names)}")
        if name not in self._frames:
            path = self.folder / f"{name}.parquet"
            try:
                self._frames[name] = pl.read_parquet(path)
            except (OSError, pl.exceptions.PolarsError) as exc:
                raise RunDirError(f"{path}: unreadable view ({type(exc).__name__}: {exc})") from None
        return self._frames[name]

    def rank(self, rank: int) -> pl.DataFrame:
        """One rank's rows of the rank x step matrix, read with the filter pushed into the file."""
        path = self.folder / "rank_steps.parquet"
        try:
            return pl.scan_parquet(path).filter(pl.col(_R) == rank).collect()
        except (OSError, pl.exceptions.PolarsError) as exc:
            raise RunDirError(f"{path}: unreadable view ({type(exc).__name__}: {exc})") from None

    @property
    def incidents(self) -> tuple[Incident, ...]:
        if self._incidents is None:
            try:
                self._incidents = read_incidents(self.folder / INCIDENTS_JSON)
            except ValueError as exc:
                raise RunDirError(str(exc)) from None
        return self._incidents

    def stale(self) -> bool:
        """The telemetry changed since the views were built (a run still being written)."""
        return telemetry_signature(self.run_dir) != self.summary.signature


def stored_views(run_dir: Path | str) -> ViewStore | None:
    """The run's stored views (in the run, else in the user's cache), or None when none were stored."""
    for d in (views_dir(run_dir), _fallback_dir(run_dir)):
        if (d / MANIFEST).exists():
            return ViewStore(d, run_dir)
    return None
