"""The liveness records in a post-mortem: the last word of each rank's collector, beside its part files.

A rank's rows reach its part files every `CollectorConfig.flush_interval_s` (5 s by default); its liveness record
(``<run>/live/rank-<r>.live``) at the end of every completed step and at least twice per heartbeat interval. A
process that ends without closing its collector (SIGKILL, the OOM killer, a lost host) takes the rows of its last few
seconds with it, but not its record: the record says exactly how far it got (its last completed
step and when) and when it was last alive. `merge_records` takes that into the run's liveness frame, and says the loss
exactly: which steps the rank trained whose rows were never written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

from rankwatch.analytics.frames import Frames, conform
from rankwatch.analytics.liveness.monitor import LivenessMonitor
from rankwatch.analytics.liveness.records import ExitRecord, RankRecord

__all__ = ["final_records", "merge_records"]


def final_records(run_dir: Path | str) -> tuple[dict[int, RankRecord], dict[int, ExitRecord], tuple[str, ...]]:
    """Each rank's liveness record and exit record as they stand (none when the run has no ``live/`` folder), and
    the reading's warnings (a record caught mid-write twice is left out, with a warning)."""
    return LivenessMonitor(run_dir).read()


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3] + " UTC"


def merge_records(frames: Frames, records: Mapping[int, RankRecord],
                  exits: Mapping[int, ExitRecord] | None = None) -> tuple[Frames, tuple[str, ...]]:
    """`frames` with each rank's progress and last sign of life taken from its liveness record where the record is of
    the rank's latest attempt and goes further than its rows; one warning per rank whose rows stop short of its record
    (the steps lost, exactly). A record is a sign of life like a heartbeat (written at least twice per heartbeat
    interval), so it counts as one. The collective a record says its rank was inside (`RankRecord.collective`) is
    an open collective where the rows have none of that operation (a rank stopped mid-step loses the rows of the
    step in progress with its collector's flush); the exit records of the ranks' latest attempts are `exits`."""
    live = frames.liveness
    if exits:
        latest = {int(r): a for r, a in live.select("rank", "attempt").iter_rows()} if live.height else {}
        frames = replace(frames, exits=conform("exits", pl.DataFrame(
            [{"rank": e.rank, "attempt": e.attempt, "wall_ns": e.wall_ns, "exit_code": e.exit_code, "signal": e.signal,
              "outside_signal": e.outside_signal, "outside_signal_wall_ns": e.outside_signal_wall_ns}
             for e in exits.values() if latest.get(e.rank, e.attempt) == e.attempt],
            schema={"rank": pl.Int32, "attempt": pl.Int32, "wall_ns": pl.Int64, "exit_code": pl.Int32,
                    "signal": pl.Int32, "outside_signal": pl.Int32, "outside_signal_wall_ns": pl.Int64})))
    if not records or not live.height:
        return frames, ()
    frames = _merge_open(frames, records)
    warnings: list[str] = []
    rows = []
    newest = frames.end_wall_ns
    for row in live.iter_rows(named=True):
        rec = records.get(int(row["rank"]))
        if rec is None or rec.attempt != row["attempt"]:
            rows.append(row)
            continue
        row = dict(row)
        last = int(row["last_step"]) if row["last_step"] is not None else -1
        rec_last = rec.last_step if rec.last_step is not None else -1
        if rec_last > last:
            warnings.append(
                f"telemetry: rank {rec.rank} attempt {rec.attempt}: its rows end at step {last}, its liveness record "
                f"at step {rec_last} ({_clock(rec.last_step_wall_ns or rec.wall_ns)}): steps {last + 1}..{rec_last} "
                "were trained and their rows never written (the process ended before its collector's next flush); "
                "its progress is read from the record")
            row["last_step"] = rec_last
            row["last_step_end_wall_ns"] = rec.last_step_wall_ns
        beat = row["last_heartbeat_wall_ns"]
        if beat is None or rec.wall_ns > beat:
            row["last_heartbeat_wall_ns"] = rec.wall_ns
            row["heartbeat_step"] = rec.step if rec.step is not None else rec_last
        seen = row["last_seen_wall_ns"]
        row["last_seen_wall_ns"] = rec.wall_ns if seen is None else max(int(seen), rec.wall_ns)
        newest = max(newest, rec.wall_ns)
        rows.append(row)
    merged = conform("liveness", pl.DataFrame(rows, schema=live.schema))
    return replace(frames, liveness=merged, end_wall_ns=newest), tuple(warnings)


def _merge_open(frames: Frames, records: Mapping[int, RankRecord]) -> Frames:
    """`frames.open_collectives` with the collective each latest-attempt record says its rank was inside, where no
    row of that operation (rank, group, sequence number) is open or ended in an error. Its sequence number may be
    unknown (`CollectiveTracker.enter_call`: a call issuing collectives from C++, DDP's buffer broadcast): the rank
    was waiting in its group all the same."""
    latest = {int(r): a for r, a in frames.liveness.select("rank", "attempt").iter_rows()}
    known = {(int(r), g, s) for r, g, s in pl.concat([
        frames.open_collectives.select("rank", "group", "group_seq"),
        frames.collective_errors.select("rank", "group", "group_seq")]).iter_rows()}
    members = {g: tuple(int(x) for x in rs) for g, rs in frames.groups.select("group", "ranks").iter_rows()} \
        if frames.groups.height else {}
    rows = []
    for rec in records.values():
        c = rec.collective
        if (c is None or c.wall_ns is None or latest.get(rec.rank) != rec.attempt
                or (c.seq is not None and (rec.rank, c.group, c.seq) in known)):
            continue
        rows.append({"rank": rec.rank, "step": rec.step if rec.step is not None else (
            rec.last_step + 1 if rec.last_step is not None else 0), "op": c.op, "group": c.group,
            "group_ranks": list(c.ranks if c.ranks is not None else members.get(c.group, ())) or None,
            "group_seq": c.seq, "peer": c.peer, "enter_wall_ns": c.wall_ns})
    if not rows:
        return frames
    return replace(frames, open_collectives=pl.concat([frames.open_collectives, conform("open_collectives",
                                                                                         pl.DataFrame(rows))]))
