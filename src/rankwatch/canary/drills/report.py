"""A drill's report: what was detected, decided and recovered, how fast, and the verdict; the table and `report.json`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rankwatch.base.rundir import atomic_write


REPORT_FILE = "report.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillReport:
    """One drill's chain, timed. Times are seconds after the fault; None where the step did not happen."""

    name: str
    fault: str
    """What was injected."""
    passed: bool
    reason: str
    """PASS: what held; FAIL: the first link of the chain that broke."""
    detected: str | None = None
    """"<class> <subject>" of the monitor's first incident naming the subject."""
    detect_s: float | None = None
    decision: str | None = None
    """"<action> (<scope>)" of the decision the service accepted."""
    decision_s: float | None = None
    recovery: str | None = None
    """"<recovery id>: <outcome>" of the recovery record; None for a drill that must not restart."""
    gate: str | None = None
    """The gate on the decision's path (e.g. "gate=none")."""
    resume_from: str | None = None
    """The checkpoint the new attempt resumed from."""
    stopped_s: float | None = None
    """Until the fault's attempt was over (every rank gone; the service stops it on the decision), as polled."""
    training_again_s: float | None = None
    steps_lost: int | None = None
    """Steps the fault's attempt completed that the new attempt trained again."""
    attempts: int = 0
    bitwise: bool | None = None
    """The final fingerprints equal the reference run's (None: not compared)."""
    run_dir: str = ""
    job: str = "canary"
    """What was drilled: "canary", or "example:<name>" (a job the manager owns by its command line)."""

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> DrillReport:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in names})


def seconds_text(v: float | None) -> str:
    """Seconds as the report prints them: two decimals, "-" when not measured."""
    return "-" if v is None else f"{v:.2f}"


_COLUMNS = ("drill", "detected", "detect_s", "decision", "decision_s", "stopped_s", "training_again_s", "steps_lost",
            "verdict")


def _row(r: DrillReport) -> tuple[str, ...]:
    return (r.name, r.detected or "-", seconds_text(r.detect_s), r.decision or "-", seconds_text(r.decision_s), seconds_text(r.stopped_s),
            seconds_text(r.training_again_s), "-" if r.steps_lost is None else str(r.steps_lost),
            f"{r.verdict}: {r.reason}")


def report_table(reports: Sequence[DrillReport]) -> str:
    """One fixed-width row per drill under a header; the verdict column (last) carries the reason."""
    rows = [_COLUMNS, *(_row(r) for r in reports)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_COLUMNS) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows)


def report_json(reports: Sequence[DrillReport]) -> dict[str, Any]:
    return {"schema": 1, "passed": all(r.passed for r in reports) and bool(reports),
            "drills": [r.to_dict() for r in reports]}


def write_report(path: Path, reports: Sequence[DrillReport]) -> Path:
    return atomic_write(path, json.dumps(report_json(reports), indent=2) + "\n")


def read_report(path: Path) -> tuple[DrillReport, ...]:
    """A report.json back. ValueError naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
        return tuple(DrillReport.from_dict(d) for d in doc["drills"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a drill report ({type(exc).__name__}: {exc})") from None
