"""Failed checkpoint saves as an incident of their own.

A save that commits nothing (recovery/checkpoint.py: a rank failed to write, the manifest was not published) is
recorded by rank 0 as a `checkpoint_failed` event: "checkpoint <id> not committed: <reason>; partial ... removed: ...;
<n> bytes free". The job goes on training, so no other detector sees anything; but every step trained after the last
committed checkpoint has no recovery point, and a failure then loses all of it. One CHECKPOINT incident per run names
how many saves failed, why (the first failure's reason; the cause STORAGE_FULL where a reason says the disk was full),
the last committed checkpoint and the steps at risk.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.schema import CheckpointPhase, EventKind

__all__ = ["detect_failed_saves", "failed_saves"]

_FAILED = re.compile(r"^checkpoint (?P<id>\S+) not committed: (?P<reason>.*?)(?:; partial |$)")
_FULL = ("no space left on device", "enospc", "errno 28", "disk quota exceeded", "edquot")


def detect_failed_saves(frames: Frames) -> tuple[Incident, ...]:
    """One CHECKPOINT incident when any save committed nothing (see the module docstring); none otherwise."""
    ev = frames.events
    if ev.height == 0:
        return ()
    failed = ev.filter(pl.col("kind") == str(EventKind.CHECKPOINT_FAILED)).sort("wall_ns")
    saves: dict[str, tuple[int | None, str, int]] = {}  # id -> (step, reason, wall_ns): every rank records it
    for row in failed.iter_rows(named=True):
        m = _FAILED.match(str(row["message"] or ""))
        if m is None:
            continue
        step = row["step"]
        saves.setdefault(m.group("id"), (None if step is None else int(step), m.group("reason"), int(row["wall_ns"])))
    if not saves:
        return ()
    ck = frames.checkpoints
    committed = ck.filter((pl.col("phase") == str(CheckpointPhase.PUBLISH)) & pl.col("ok")) if ck.height else ck
    steps = [s for s, *_ in saves.values() if s is not None]
    first_fail = min(steps) if steps else None
    last_ok = int(committed["step"].max()) if committed.height else None  # type: ignore[arg-type]
    reasons = [r for _, r, _ in saves.values()]
    full = [r for r in reasons if any(k in r.lower() for k in _FULL)]
    cause = Cause.STORAGE_FULL if full else Cause.CHECKPOINT_IO
    why = full[0] if full else reasons[0]
    trained = frames.last_step
    since = (f"the last committed checkpoint is at step {last_ok}" if last_ok is not None
             else "no checkpoint was ever committed")
    at_risk = (trained - last_ok) if last_ok is not None else trained + 1
    summary = (f"{len(saves)} checkpoint save(s) committed nothing"
               + (" (the disk was full)" if full else "") + f": {why}; {since}, "
               f"{max(0, at_risk)} step(s) trained since have no recovery point")
    rows = tuple((cid, s, r[:200]) for cid, (s, r, _) in sorted(saves.items(), key=lambda kv: kv[1][2]))
    return (Incident(
        klass=IncidentClass.CHECKPOINT, subject=Subject(kind=SubjectKind.JOB, id="checkpoints"), ranks=(),
        onset_step=first_fail, detection_step=first_fail, confidence=1.0, cause=cause, summary=summary,
        detection_wall_ns=min(w for _, _, w in saves.values()),
        evidence=(Evidence(source="events", summary="checkpoint saves that committed nothing, and why",
                           columns=("checkpoint_id", "step", "reason"), rows=rows),),
    ),)


def failed_saves(run_dir: Path | str) -> Incident | None:
    """The run's CHECKPOINT incident straight from its events and checkpoint phases (what `train` prints at its end,
    without a whole analysis); None when every save committed."""
    from rankwatch.analytics import queries
    from rankwatch.analytics.store import connect

    con = connect(run_dir, check=False)
    try:
        frames = Frames.build(events=queries.events(con), checkpoints=queries.checkpoints(con),
                              steps=queries.steps(con))
    finally:
        con.close()
    found = detect_failed_saves(frames)
    return found[0] if found else None

