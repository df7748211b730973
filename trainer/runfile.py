"""``<run>/run.json``: one record per launch of the job into a run directory, appended by the launcher.

Read with loud one-line errors: a run file of the wrong shape names itself and what is wrong, never a KeyError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rankwatch.trainer.determinism import DeterminismInputs

__all__ = ["DETERMINISM_KEY", "RUN_FILE", "determinism_of", "read_launches"]

RUN_FILE = "run.json"
DETERMINISM_KEY = "determinism"
"""Key of a launch record's `DeterminismInputs`."""

_TYPES = {"attempt": int, "started_wall_ns": int, "world_size": int, "layout": str, "steps": int}
"""Types of the keys every reader relies on, checked where present (what a consumer needs and lacks, it names)."""


def read_launches(run_dir: Path, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Every launch record, oldest first. A missing file is [] with `missing_ok`, else a ValueError; a file that is
    not a run file (not JSON, not an object with a `launches` list of objects, a key of the wrong type, attempts out
    of order) is a ValueError naming it and the problem."""
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        if missing_ok:
            return []
        raise ValueError(f"{path}: no run file — not a canary run directory")
    if not path.is_file():
        raise ValueError(f"{path}: not a file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable run file ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("launches"), list):
        raise ValueError(f"{path}: not a run file (expected an object with a 'launches' list)")
    launches: list[dict[str, Any]] = doc["launches"]
    for n, rec in enumerate(launches):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: launch {n} is not an object")
        for key, kind in _TYPES.items():
            if key in rec and (not isinstance(rec[key], kind) or isinstance(rec[key], bool)):
                raise ValueError(f"{path}: launch {n}: {key!r} is {rec[key]!r}, not {kind.__name__}")
        if rec.get("attempt", n) != n:
            raise ValueError(f"{path}: launch {n} says attempt {rec['attempt']}: records edited or reordered")
    return launches


def determinism_of(run_dir: Path, launch: dict[str, Any]) -> DeterminismInputs | None:
    """A launch record's determinism inputs; None when it has none (written by an older rankwatch)."""
    doc = launch.get(DETERMINISM_KEY)
    if doc is None:
        return None
    return DeterminismInputs.from_dict(doc, where=f"{Path(run_dir) / RUN_FILE} launch {launch.get('attempt')}")
