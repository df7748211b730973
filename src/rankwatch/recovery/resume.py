"""Which checkpoint a run resumes from, and what the run directory must hold before a resume is attempted.

    plan(run, layout=..., checkpoint_id=None)   the newest committed, SHA-256-verified checkpoint this layout can
                                                load (or the one asked for), and every newer candidate passed over
    last_completed_step(run, before_attempt=n)  the highest step an earlier attempt completed (the replay range)
    record_resume(run, ...)                     the lineage of a resume: RESTART, or ROLLBACK + REPLAYED_DATA_RANGE,
                                                and the world-size / layout change
    preflight(run)                              what a resume checks before anything is launched

A job's resume (`recovery.Checkpointer.resume`, the canary's too) loads the chosen checkpoint on every rank, passes
the consistency gate (`recovery.gate`) and records the lineage; `GateRefused` is what it raises when the gate does
not AGREE.
Layouts: the same layout loads, and so does another data-parallel degree (same tp and pp): every dp replica of a
(pp, tp) shard holds the full replicated state. A tp or pp change is refused (`loadable`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rankwatch.base.rundir import RunDir, read_launches
from rankwatch.base.schema import EventKind, Events, Steps, Table
from rankwatch.base.topology import Layout
from rankwatch.collector.sink import partition_dir
from rankwatch.recovery.catalog import Candidate, Verdict, list_checkpoints
from rankwatch.recovery.lineage import (
    Details, EntryKind, Lineage, NewEntry, Verdict as Comparability, check_lineage, lineage_path,
)

log = logging.getLogger("rankwatch.recovery")

__all__ = ["GateRefused", "Plan", "last_completed_step", "loadable", "plan", "preflight", "record_resume"]


class GateRefused(RuntimeError):
    """The consistency gate did not AGREE: training must not resume."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    chosen: Candidate
    """Newest committed, SHA-256-verified checkpoint this layout can load."""
    rejected: tuple[Candidate, ...]
    """Newer candidates passed over, newest first, each with its reason."""
    requested: bool = False
    """The checkpoint was named by the caller (a rollback target), not the newest usable one."""

    def describe(self) -> str:
        m = self.chosen.manifest
        saved = f" (saved by {m.layout})" if m is not None else ""
        which = "the requested" if self.requested else "newest"
        text = f"resume from {self.chosen.checkpoint_id}{saved}: {which} committed, verified, loadable checkpoint"
        if self.rejected:
            text += "; rejected newer: " + "; ".join(f"{c.path.name}: {c.verdict} ({c.reason})" for c in self.rejected)
        return text


def loadable(saved: Layout, job: Layout) -> str | None:
    """None when a job with layout `job` can load a checkpoint saved by `saved`; else why not (one line)."""
    if (saved.tp, saved.pp) != (job.tp, job.pp):
        return f"layout incompatible: saved by {saved}, job is {job}; only the dp degree may change on resume"
    return None


def plan(run_dir: Path, *, layout: Layout, checkpoint_id: str | None = None) -> Plan:
    """Choose like `catalog.choose`, but also accept a changed dp degree; ValueError naming every rejection when
    nothing is usable. With `checkpoint_id`, that checkpoint or a ValueError saying why it cannot be used (newer
    candidates are then passed over as "not the requested checkpoint")."""
    chosen: Candidate | None = None
    rejected: list[Candidate] = []
    candidates = list_checkpoints(run_dir, verify=True)
    if checkpoint_id is not None:
        wanted = [c for c in candidates if c.path.name == checkpoint_id]
        if not wanted:
            raise ValueError(f"{RunDir(Path(run_dir)).checkpoints}: no checkpoint {checkpoint_id} to resume from")
        candidates = tuple(wanted)
    for c in candidates:
        if c.usable and c.manifest is not None and (why := loadable(c.manifest.layout, layout)) is not None:
            c = dataclasses.replace(c, verdict=Verdict.INCOMPATIBLE, reason=why)
        if c.usable:
            chosen = c
            break
        rejected.append(c)
    if chosen is None:
        if not rejected:
            raise ValueError(f"{RunDir(Path(run_dir)).checkpoints}: no checkpoint to resume from")
        raise ValueError(f"{RunDir(Path(run_dir)).checkpoints}: no usable checkpoint: "
                         + "; ".join(f"{c.path.name}: {c.verdict} ({c.reason})" for c in rejected))
    return Plan(chosen=chosen, rejected=tuple(rejected), requested=checkpoint_id is not None)


def _parts(run_dir: Path, table: Table, columns: Sequence[str], *, integers: Sequence[str] = ()
           ) -> Iterator[tuple[Path, dict[str, list[Any]]]]:
    """Each part file of `table` in the run, as its `columns`. A part that cannot be read (cut short, not parquet,
    a column missing) or whose `integers` columns are not integers is skipped with a warning naming it: it is
    evidence of what was trained, not something a resume from an intact checkpoint must stop on."""
    root = partition_dir(run_dir, table, 0).parent
    for part in sorted(root.glob("*/part-*.parquet")):
        try:
            t = pq.read_table(part, columns=list(columns))
        except Exception as exc:
            log.warning("rankwatch resume: %s: unreadable %s part left out (%s)", part, table,
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        if not all(pa.types.is_integer(t.schema.field(c).type) for c in integers):
            log.warning("rankwatch resume: %s: %s part with non-integer %s left out", part, table, "/".join(integers))
            continue
        yield part, t.to_pydict()


def last_completed_step(run_dir: Path, *, before_attempt: int) -> int | None:
    """The highest step any rank completed in attempts before `before_attempt`, from the steps part files (damaged
    parts skipped with a warning: `_parts`)."""
    cols = (str(Steps.STEP), str(Steps.ATTEMPT))
    best: int | None = None
    for _, d in _parts(run_dir, Table.STEPS, cols, integers=cols):
        steps = [s for s, a in zip(d[cols[0]], d[cols[1]]) if s is not None and a is not None and a < before_attempt]
        if steps:
            best = max(steps) if best is None else max(best, *steps)
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """What an attempt trained with, as its Checkpointer's rank 0 said (`EventKind.GLOBAL_BATCH`)."""

    attempt: int
    global_batch: int
    world_size: int


def previous_batch_plan(run_dir: Path, *, before_attempt: int) -> BatchPlan | None:
    """The latest attempt before `before_attempt` whose events say its global batch, from the events part files;
    None when none does (no Checkpointer was given one, or its events never reached disk). Damaged parts and
    malformed messages are skipped with a warning naming them, as in `last_completed_step`."""
    best: BatchPlan | None = None
    cols = (str(Events.KIND), str(Events.ATTEMPT), str(Events.MESSAGE))
    for part, d in _parts(run_dir, Table.EVENTS, cols):
        for kind, attempt, message in zip(*(d[c] for c in cols)):
            if kind != EventKind.GLOBAL_BATCH or not isinstance(attempt, int) or attempt >= before_attempt:
                continue
            try:
                doc = json.loads(message)
                plan = BatchPlan(attempt=attempt, global_batch=int(doc["global_batch"]),
                                 world_size=int(doc["world_size"]))
            except (TypeError, ValueError, KeyError):
                log.warning("rankwatch resume: %s: a global_batch event with a malformed message left out", part)
                continue
            if best is None or plan.attempt > best.attempt:
                best = plan
    return best


def record_batch_change(run_dir: Path, *, before: BatchPlan, after: BatchPlan, verdict: Comparability) -> bool:
    """Append a BATCH_CHANGE saying the global batch and world `after`'s attempt trains with, when they differ from
    `before`'s (a restart from step 0 on another world: the recovery manager's lineage has the world change, the job
    alone knows its batch). False, appending nothing, when nothing changed."""
    if (before.global_batch, before.world_size) == (after.global_batch, after.world_size):
        return False
    kept = " (kept: re-split over the ranks)" if before.global_batch == after.global_batch else ""
    Lineage(lineage_path(Path(run_dir))).append(NewEntry(kind=EntryKind.BATCH_CHANGE, verdict=verdict, details=Details(
        old_world_size=before.world_size,
        new_world_size=after.world_size, old_global_batch=before.global_batch, new_global_batch=after.global_batch,
        attempt=after.attempt,
        text=(f"attempt {after.attempt} trains from step 0 on {after.world_size} ranks (attempt {before.attempt}: "
              f"{before.world_size}); global batch {before.global_batch} -> {after.global_batch} samples a "
              f"step{kept}"))))
    return True


def preflight(run_dir: Path) -> None:
    """What `train --resume` checks before it launches anything (so a bad run directory gets a one-line
    ValueError and nothing is created or appended): the run directory exists and is a directory, its run file is
    well formed, its lineage verifies (a tampered lineage is never appended to), and it has a checkpoints folder."""
    run = Path(run_dir)
    if not run.exists():
        raise ValueError(f"{run}: no such run directory (--resume never creates a run)")
    if not run.is_dir():
        raise ValueError(f"{run}: not a directory")
    if not read_launches(run):
        raise ValueError(f"{RunDir(run).run_file}: records no launch")
    check_lineage(lineage_path(run), consequence="refusing to resume a run whose lineage was tampered with")
    if not RunDir(run).checkpoints.is_dir():
        raise ValueError(f"{RunDir(run).checkpoints}: no checkpoints folder — nothing to resume from")




FROM_INITIALIZATION = "initialization"
"""The `checkpoint_id` a lineage entry names when an attempt starts again from the job's initial state (no
checkpoint was ever committed)."""


def record_resume(run_dir: Path, *, attempt: int, resume_at: int, checkpoint_id: str, verdict: Comparability,
                  old_world_size: int, new_world_size: int, old_layout: Layout, new_layout: Layout,
                  determinism: str | None = None, old_global_batch: int | None = None,
                  new_global_batch: int | None = None) -> None:
    """Append a resume's lineage (rank 0, after the gate agreed): ROLLBACK plus REPLAYED_DATA_RANGE when an earlier
    attempt had completed steps at or past `resume_at` (they are trained again), else RESTART; then
    WORLD_SIZE_CHANGE and LAYOUT_CHANGE where those changed. `checkpoint_id` is the checkpoint loaded, or
    `FROM_INITIALIZATION`."""
    previous = last_completed_step(run_dir, before_attempt=attempt)
    book = Lineage(lineage_path(Path(run_dir)))
    if previous is not None and previous >= resume_at:
        book.append(NewEntry(kind=EntryKind.ROLLBACK, verdict=verdict, details=Details(
            from_step=previous, to_step=resume_at, checkpoint_id=checkpoint_id, determinism=determinism,
            attempt=attempt, text=f"attempt {attempt} rolls back from step {previous} to {checkpoint_id}")))
        book.append(NewEntry(kind=EntryKind.REPLAYED_DATA_RANGE, verdict=verdict, details=Details(
            from_step=resume_at, to_step=previous + 1, checkpoint_id=checkpoint_id, attempt=attempt,
            text=f"attempt {attempt} trains steps {resume_at}..{previous} again")))
    else:
        book.append(NewEntry(kind=EntryKind.RESTART, verdict=verdict, details=Details(
            from_step=previous, to_step=resume_at, checkpoint_id=checkpoint_id, determinism=determinism,
            attempt=attempt, text=f"attempt {attempt} restarts from {checkpoint_id}")))
    if old_world_size != new_world_size:
        batch = ""
        if old_global_batch is not None and new_global_batch is not None:
            batch = (f"; global batch {old_global_batch} -> {new_global_batch} samples a step" +
                     (" (kept: re-split over the ranks)" if old_global_batch == new_global_batch else ""))
        book.append(NewEntry(kind=EntryKind.WORLD_SIZE_CHANGE, verdict=verdict, details=Details(
            old_world_size=old_world_size, new_world_size=new_world_size, checkpoint_id=checkpoint_id,
            attempt=attempt, old_global_batch=old_global_batch, new_global_batch=new_global_batch,
            text=f"attempt {attempt}: world {old_world_size} -> {new_world_size}{batch}")))
    if old_layout != new_layout:
        book.append(NewEntry(kind=EntryKind.LAYOUT_CHANGE, verdict=verdict, details=Details(
            old_layout=str(old_layout), new_layout=str(new_layout), checkpoint_id=checkpoint_id, attempt=attempt)))
