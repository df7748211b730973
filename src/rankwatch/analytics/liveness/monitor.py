"""`LivenessMonitor`: polls `<run>/live/`, reads only the records that changed, times each record's changes on its own
clock (`Seen`), and classifies the current attempt at every poll."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.incidents import Incident, IncidentClass
from rankwatch.analytics.liveness.classify import LivenessConfig, LivenessView, Seen, classify
from rankwatch.analytics.liveness.records import ExitRecord, RankRecord, TornRecord, decode_rank_record, parse_exit_record
from rankwatch.base.rundir import LIVE_DIR
from rankwatch.base.schema import EXIT_RECORD_PREFIX, EXIT_RECORD_SUFFIX, RANK_RECORD_PREFIX, RANK_RECORD_SUFFIX


class LivenessMonitor:
    """Reads ``<run>/live/`` at each `poll` and classifies. Keeps the last whole record of each rank: a record caught
    mid-write (its CRC does not hold twice in a row), or an exit record that does not parse, leaves the previous one in
    use and a warning, never a dead rank. Times each record's changes on its own clock (see the module docstring)."""

    def __init__(self, run_dir: Path | str, config: LivenessConfig = LivenessConfig()) -> None:
        self.run_dir = Path(run_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"{self.run_dir}: not a run directory")
        self.config = config
        self._records: dict[int, RankRecord] = {}
        self._exits: dict[int, ExitRecord] = {}
        self._changed: dict[tuple[int, str], tuple[tuple[int | None, int, int | None], int]] = {}
        """(rank, what) -> ((pid, attempt, seq or last step), monitor time that value was first read)."""
        self._open: dict[str, Incident] = {}
        self._raw: dict[str, bytes] = {}
        """path -> the bytes last decoded from it (an unchanged file is not decoded again)."""
        self.polls = 0

    @property
    def live_dir(self) -> Path:
        return self.run_dir / LIVE_DIR

    def poll(self, now_ns: int | None = None) -> LivenessView:
        """Read the live folder and classify at `now_ns` (default: the wall clock now)."""
        warnings = self._read()
        now = time.time_ns() if now_ns is None else now_ns
        seen = {r: Seen(record_ns=self._since(r, "record", (rec.pid, rec.attempt, rec.seq), now),
                        progress_ns=self._since(r, "progress", (rec.pid, rec.attempt, rec.last_step), now))
                for r, rec in self._records.items()}
        if self.polls == 0 and not self.live_dir.is_dir():
            warnings.append(f"{self.live_dir}: no liveness records yet (the run has not started, or its collectors "
                            "write none: CollectorConfig.liveness)")
        self.polls += 1
        view = classify(self._records.values(), self._exits.values(), now, self.config, seen=seen,
                        warnings=tuple(warnings))
        current = {i.id: i for i in view.incidents}
        new = tuple(i for k, i in current.items() if k not in self._open)
        resolved = tuple(i for k, i in self._open.items() if k not in current)
        self._open.update({i.id: i for i in new})
        for i in resolved:
            del self._open[i.id]
        withdrawn = tuple(i for i in resolved if i.klass is IncidentClass.FAIL_STOP and i.attempt == view.attempt)
        return replace(view, new=new, resolved=resolved, withdrawn=withdrawn)

    def read(self) -> tuple[dict[int, RankRecord], dict[int, ExitRecord], tuple[str, ...]]:
        """Read the live folder without classifying: each rank's record and exit record held now (copies), and the
        reading's warnings."""
        warnings = self._read()
        return dict(self._records), dict(self._exits), tuple(warnings)

    def _since(self, rank: int, what: str, value: tuple[int | None, int, int | None], now: int) -> int:
        key = (rank, what)
        prev = self._changed.get(key)
        if prev is None or prev[0] != value:
            self._changed[key] = prev = (value, now)
        return now - prev[1]

    def _read(self) -> list[str]:
        warnings: list[str] = []
        try:
            entries = list(os.scandir(self.live_dir))
        except FileNotFoundError:
            return warnings
        except OSError as exc:
            raise RunDirError(f"{self.live_dir}: cannot list the liveness folder ({exc})") from None
        for entry in entries:
            name = entry.name
            if name.startswith(RANK_RECORD_PREFIX) and name.endswith(RANK_RECORD_SUFFIX):
                rank = _rank_of(name, RANK_RECORD_PREFIX, RANK_RECORD_SUFFIX)
                if rank is not None:
                    rec = self._read_rank(entry.path, warnings)
                    if rec is not None:
                        self._records[rank] = rec
            elif name.startswith(EXIT_RECORD_PREFIX) and name.endswith(EXIT_RECORD_SUFFIX):
                rank = _rank_of(name, EXIT_RECORD_PREFIX, EXIT_RECORD_SUFFIX)
                if rank is not None:
                    ex = self._read_exit(entry.path, warnings)
                    if ex is not None:
                        self._exits[rank] = ex
        return warnings

    def _bytes(self, path: str, warnings: list[str]) -> bytes | None:
        """The file's bytes, or None when they are what this monitor read last time (nothing to decode), or when the
        file is gone, empty (created, not yet written) or unreadable (a warning)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None  # replaced or removed between listing and reading: keep the one held
        except OSError as exc:
            warnings.append(f"{path}: unreadable ({exc}); the previous record is kept")
            return None
        if not data or self._raw.get(path) == data:
            return None
        return data

    def _read_rank(self, path: str, warnings: list[str]) -> RankRecord | None:
        for _ in range(2):
            data = self._bytes(path, warnings)
            if data is None:
                return None
            try:
                rec = decode_rank_record(data, path)
            except TornRecord:
                continue
            self._raw[path] = data
            return rec
        warnings.append(f"{path}: caught mid-write twice (length or CRC does not hold); the previous record is kept")
        return None

    def _read_exit(self, path: str, warnings: list[str]) -> ExitRecord | None:
        data = self._bytes(path, warnings)
        if data is None:
            return None
        try:
            d = json.loads(data)
        except ValueError as exc:
            warnings.append(f"{path}: not a whole exit record ({type(exc).__name__}); left out for now")
            return None
        if not isinstance(d, dict):
            raise RunDirError(f"{path}: exit record is not a JSON object")
        ex = parse_exit_record(d, path)
        self._raw[path] = data
        return ex


def _rank_of(name: str, prefix: str, suffix: str) -> int | None:
    middle = name[len(prefix):-len(suffix)]
    return int(middle) if middle.isdigit() else None
