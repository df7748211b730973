"""Liveness: the rank records the collector writes, the launcher's exit records, and `classify` / `LivenessMonitor` over
them — every state, the incidents they make, ids stable across polls, and files caught mid-write."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rankwatch.analytics.errors import RunDirError, SchemaVersionError
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.liveness import (
    ExitRecord, LivenessConfig, LivenessMonitor, LivenessView, OpenCollective, RankRecord, RankState, Seen, classify,
    decode_rank_record, same_fault,
)
from rankwatch.base.schema import LIVE_VERSION, CheckpointPhase, ExitField, GroupKind, LiveField, LiveState
from rankwatch.base.topology import GroupInfo
from rankwatch.collector import Collector, CollectorConfig, MemorySink
from rankwatch.collector.liveness import encode_frame, exit_record_path, rank_record_path, write_exit_record
from rankwatch.analytics.liveness.records import TornRecord

S = 1_000_000_000
HB = S  # heartbeat interval of the synthetic records
T0 = 1_800_000_000 * S  # the attempt's start (wall clock)
WORLD = 4
DP = OpenCollective(op="all_reduce", group="dp", seq=7, ranks=(0, 1, 2, 3))


def rec(rank: int, *, at: float, last_step: int | None = 9, progress: float | None = None, attempt: int = 0,
        state: LiveState = LiveState.RUNNING, **kw: object) -> RankRecord:
    """A rank record written `at` seconds into the attempt, its last step completed `progress` s in (default: `at`)."""
    p = at if progress is None else progress
    fields: dict[str, object] = dict(
        rank=rank, world_size=WORLD, attempt=attempt, pid=100 + rank, host=f"host{rank // 2}", state=state,
        seq=int(at * 10) + 1, wall_ns=T0 + int(at * S), heartbeat_ns=HB, started_wall_ns=T0, last_step=last_step,
        last_step_wall_ns=None if last_step is None else T0 + int(p * S), step_ns=S // 20,
    )
    fields.update(kw)
    return RankRecord(**fields)  # type: ignore[arg-type]


def exit_(rank: int, *, at: float, code: int | None = None, sig: int | None = None, attempt: int = 0) -> ExitRecord:
    return ExitRecord(rank=rank, world_size=WORLD, attempt=attempt, pid=100 + rank, host=f"host{rank // 2}",
                      wall_ns=T0 + int(at * S), exit_code=code, signal=sig)


def now(at: float) -> int:
    return T0 + int(at * S)


def states(view: LivenessView) -> list[RankState]:
    return [r.state for r in view.ranks]


def test_every_rank_progressing_is_running_and_makes_no_incident() -> None:
    view = classify([rec(r, at=10.0) for r in range(WORLD)], [], now(10.3))
    assert states(view) == [RankState.RUNNING] * WORLD
    assert view.incidents == () and view.attempt == 0 and view.world_size == WORLD
    assert "4 running" in view.line()


def test_a_killed_rank_is_a_fail_stop_naming_it_and_its_id_is_stable_across_polls() -> None:
    records = [rec(r, at=10.0) for r in (0, 1, 3)] + [rec(2, at=9.95)]
    exits = [exit_(2, at=10.05, sig=9)]
    first = classify(records, exits, now(10.1))
    assert first.rank(2).state is RankState.STOPPED  # type: ignore[union-attr]
    (inc,) = first.incidents
    assert inc.klass is IncidentClass.FAIL_STOP and inc.subject == Subject(kind=SubjectKind.RANK, id="2")
    assert inc.ranks == (2,) and inc.cause is Cause.SIGNAL and inc.onset_step == 10 and inc.attempt == 0
    assert "SIGKILL" in inc.summary and inc.detection_wall_ns == now(10.05)
    # later: the survivors are stuck waiting for it in their all-reduce, still beating
    later = classify([rec(r, at=15.0, progress=10.0, step=10, collective=DP) for r in (0, 1, 3)] + [rec(2, at=9.95)],
                     exits, now(15.1))
    assert later.in_state(RankState.STUCK) == (0, 1, 3)
    assert [i.id for i in later.incidents] == [inc.id]  # survivors waiting on it are not culprits


def test_survivors_that_die_of_the_victims_error_are_not_culprits() -> None:
    err = dict(state=LiveState.EXITING, exit_code=1, exc_type="RuntimeError", step=10, collective=DP,
               message="Read error [127.0.0.1]:6569: Connection reset by peer")
    records = [rec(r, at=10.02, progress=10.0, **err) for r in (0, 1, 3)] + [rec(2, at=9.99)]  # type: ignore[arg-type]
    exits = [exit_(2, at=10.05, sig=9), *(exit_(r, at=10.1, code=1) for r in (0, 1, 3))]
    view = classify(records, exits, now(10.2))
    assert states(view) == [RankState.STOPPED] * WORLD
    assert [r.reacting for r in view.ranks] == [True, True, False, True]
    (inc,) = view.incidents
    assert inc.subject.id == "2" and inc.klass is IncidentClass.FAIL_STOP


def test_before_the_victims_exit_is_seen_the_survivors_errors_name_it_with_the_same_id() -> None:
    err = dict(state=LiveState.EXITING, exit_code=1, exc_type="RuntimeError", step=10, collective=DP)
    survivors = [rec(r, at=10.02, progress=10.0, message="Connection closed by peer (rank 2)", **err)  # type: ignore[arg-type]
                 for r in (0, 1, 3)]
    early = classify([*survivors, rec(2, at=9.99)], [], now(10.03))
    assert early.rank(2).state is RankState.RUNNING  # type: ignore[union-attr]  # its record is fresh
    (named,) = early.incidents
    assert named.subject.id == "2" and named.klass is IncidentClass.FAIL_STOP
    late = classify([*survivors, rec(2, at=9.99)], [exit_(2, at=10.1, sig=9)], now(10.2))
    assert [i.id for i in late.incidents] == [named.id]


def test_survivors_reacting_to_an_unseen_fault_wait_for_the_culprit_to_show() -> None:
    err = dict(state=LiveState.EXITING, exit_code=1, exc_type="RuntimeError", step=10, collective=DP,
               message="Connection reset by peer")
    view = classify([rec(r, at=10.02, progress=10.0, **err) for r in (0, 1, 3)] + [rec(2, at=9.99)],  # type: ignore[arg-type]
                    [], now(10.03))
    assert view.incidents == ()


def test_a_silent_rank_without_exit_record_is_lost_and_a_fail_stop_that_vanished() -> None:
    records = [rec(r, at=12.0, progress=10.0, step=10, collective=DP) for r in (0, 1, 3)] + [rec(2, at=9.9)]
    view = classify(records, [], now(12.05))
    assert view.rank(2).state is RankState.LOST  # type: ignore[union-attr]
    (inc,) = view.incidents
    assert inc.klass is IncidentClass.FAIL_STOP and inc.cause is Cause.VANISHED and inc.subject.id == "2"
    assert inc.detection_wall_ns == now(9.9) + 2 * HB  # silent for lost_heartbeats
    # the same fault once its process is killed and its exit seen: the same incident
    beating = [rec(r, at=20.0, progress=10.0, step=10, collective=DP) for r in (0, 1, 3)]
    killed = classify([*beating, records[-1]], [exit_(2, at=20.0, sig=9)], now(20.1))
    assert killed.rank(2).state is RankState.STOPPED  # type: ignore[union-attr]
    assert [i.id for i in killed.incidents] == [inc.id]


def test_a_record_the_monitor_saw_change_recently_is_not_lost_whatever_the_writers_clock_says() -> None:
    records = [rec(r, at=10.0) for r in range(WORLD)]
    assert classify(records, [], now(13.0)).in_state(RankState.LOST) == (0, 1, 2, 3)
    beating = classify(records, [], now(13.0), seen={r: Seen(record_ns=S // 10, progress_ns=5 * S) for r in range(WORLD)})
    assert beating.in_state(RankState.STUCK) == (0, 1, 2, 3)  # beating, but no progress: alive
    view = classify(records, [], now(13.0), seen={r: Seen(record_ns=S // 10, progress_ns=S // 10) for r in range(WORLD)})
    assert view.in_state(RankState.RUNNING) == (0, 1, 2, 3) and view.incidents == ()


def test_a_rank_stuck_outside_collectives_while_its_peers_wait_for_it_is_a_hang() -> None:
    records = [rec(1, at=13.0, progress=10.0, last_step=14)]
    records += [rec(r, at=13.0, progress=10.0, last_step=14, step=15, phase="forward", collective=DP)
                for r in (0, 2, 3)]
    view = classify(records, [], now(13.1))
    assert states(view) == [RankState.STUCK] * WORLD
    (inc,) = view.incidents
    assert inc.klass is IncidentClass.HANG and inc.subject.id == "1" and inc.cause is Cause.STUCK_IN_STEP
    assert inc.onset_step == 15 and "3 peer(s) wait for it" in inc.summary
    assert inc.detection_wall_ns == now(10.0) + 2 * HB
    # it stays the same incident while the peers time out and die, and after it is terminated
    err = dict(state=LiveState.EXITING, exit_code=1, exc_type="DistBackendError", step=15, collective=DP)
    dead = [rec(r, at=18.0, progress=10.0, last_step=14, **err) for r in (0, 2, 3)]  # type: ignore[arg-type]
    assert [i.id for i in classify([records[0], *dead], [], now(18.5)).incidents] == [inc.id]
    term = rec(1, at=22.0, progress=10.0, last_step=14, state=LiveState.EXITING, exit_code=143, signal=15)
    after = classify([term, *dead], [exit_(r, at=22.5, code=1 if r else 1) for r in range(WORLD)], now(23.0))
    assert states(after) == [RankState.STOPPED] * WORLD
    assert [i.id for i in after.incidents] == [inc.id]


def test_the_hang_is_named_as_soon_as_the_culprit_is_stuck_even_before_its_peers_are() -> None:
    records = [rec(1, at=12.6, progress=10.0, last_step=14)] + [rec(r, at=12.6, progress=10.8) for r in (0, 2, 3)]
    (inc,) = classify(records, [], now(12.65)).incidents
    assert inc.klass is IncidentClass.HANG and inc.subject.id == "1"


def test_every_rank_stuck_in_the_same_collective_is_a_hang_of_the_job() -> None:
    records = [rec(r, at=13.0, progress=10.0, step=10, collective=DP) for r in range(WORLD)]
    (inc,) = classify(records, [], now(13.1)).incidents
    assert inc.klass is IncidentClass.HANG and inc.subject.kind is SubjectKind.JOB
    assert inc.ranks == (0, 1, 2, 3) and inc.cause is Cause.STUCK_IN_COLLECTIVE and "all_reduce on dp (#7)" in inc.summary


def test_a_partial_stall_still_spreading_is_judged_once_it_settles() -> None:
    records = [rec(r, at=13.0, progress=10.0, step=10, collective=replace(DP, ranks=(0, 1))) for r in (0, 1)]
    records += [rec(r, at=13.0) for r in (2, 3)]
    assert classify(records, [], now(13.1)).incidents == ()


def test_long_steps_checkpoints_and_startup_are_not_stuck() -> None:
    slow = rec(0, at=40.0, progress=10.0, step_ns=10 * S, step=10)  # steps of 10 s: stuck only after 50 s
    ckpt = rec(1, at=40.0, progress=10.0, phase=f"checkpoint.{CheckpointPhase.WRITE}", phase_start_wall_ns=now(10.5))
    starting = rec(2, at=40.0, last_step=None)
    view = classify([slow, ckpt, starting, rec(3, at=40.0)], [], now(40.1))
    assert states(view) == [RankState.RUNNING] * WORLD and view.incidents == ()
    view = classify([replace(slow, wall_ns=now(70.0)), replace(ckpt, wall_ns=now(70.0)),
                     replace(starting, wall_ns=now(70.0)), rec(3, at=70.0)], [], now(70.1))
    assert view.rank(0).state is RankState.STUCK  # type: ignore[union-attr]
    assert [r.state for r in view.ranks[1:]] == [RankState.RUNNING] * 3


def test_a_clean_finish_makes_no_incident_even_when_the_launcher_kills_a_closed_rank() -> None:
    done = [rec(r, at=20.0, state=LiveState.EXITED, exit_code=0) for r in range(WORLD)]
    exits = [exit_(r, at=20.1, code=0) for r in range(3)] + [exit_(3, at=25.0, sig=15)]
    view = classify(done, exits, now(60.0))
    assert states(view) == [RankState.FINISHED] * WORLD and view.incidents == () and view.finished
    # a close at interpreter exit (no code) is clean too, unless the process then ended otherwise
    atexit = [rec(r, at=20.0, state=LiveState.EXITED) for r in range(WORLD)]
    assert classify(atexit, [], now(60.0)).finished
    assert classify(atexit, [exit_(0, at=20.1, code=3)], now(60.0)).rank(0).state is RankState.STOPPED  # type: ignore[union-attr]
    # the process exiting 0 mid-training, its collector never closed, is a stop
    mid = classify([rec(r, at=10.0) for r in range(WORLD)], [exit_(1, at=10.05, code=0)], now(10.1))
    assert mid.rank(1).state is RankState.STOPPED  # type: ignore[union-attr]
    assert [i.subject.id for i in mid.incidents] == ["1"] and mid.incidents[0].cause is Cause.EXIT


def test_a_new_attempt_ignores_the_old_attempts_exit_records() -> None:
    old = [exit_(r, at=10.0, sig=9) for r in range(WORLD)]
    new = [rec(r, at=30.0, attempt=1) for r in (0, 1, 2)]
    view = classify([rec(3, at=9.0), *new], old, now(30.1))
    assert view.attempt == 1
    assert states(view) == [RankState.RUNNING] * 3 + [RankState.PENDING]
    assert view.incidents == ()
    # the attempt's first record long ago and still none from rank 3: it never came up
    late = classify([rec(r, at=200.0, attempt=1) for r in (0, 1, 2)], old, now(200.1))
    assert late.rank(3).state is RankState.LOST  # type: ignore[union-attr]
    assert [i.subject.id for i in late.incidents] == ["3"] and late.incidents[0].onset_step is None


def test_every_rank_killed_at_once_is_a_fail_stop_of_the_job() -> None:
    records = [rec(r, at=10.0) for r in range(WORLD)]
    exits = [exit_(r, at=10.05 + r / 100, sig=9) for r in range(WORLD)]
    (inc,) = classify(records, exits, now(10.2)).incidents
    assert inc.subject.kind is SubjectKind.JOB and inc.ranks == (0, 1, 2, 3) and inc.cause is Cause.SIGNAL
    assert inc.onset_step == 10


def test_ranks_a_host_loses_at_once_are_one_fail_stop_each() -> None:
    records = [rec(r, at=10.0) for r in (0, 1)] + [rec(r, at=12.5, progress=10.0, step=10, collective=DP)
                                                   for r in (2, 3)]
    view = classify(records, [], now(12.6))
    assert view.in_state(RankState.LOST) == (0, 1)
    assert sorted(i.subject.id for i in view.incidents) == ["0", "1"]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="lost_heartbeats"):
        LivenessConfig(lost_heartbeats=0)
    with pytest.raises(ValueError, match="hang_confidence"):
        LivenessConfig(hang_confidence=1.5)


# -- the files --------------------------------------------------------------------------------------------------------

def _doc(r: RankRecord) -> dict[str, object]:
    return {
        LiveField.VERSION: LIVE_VERSION, LiveField.RANK: r.rank, LiveField.WORLD_SIZE: r.world_size,
        LiveField.ATTEMPT: r.attempt, LiveField.PID: r.pid, LiveField.HOST: r.host, LiveField.STATE: str(r.state),
        LiveField.SEQ: r.seq, LiveField.WALL_NS: r.wall_ns, LiveField.HEARTBEAT_NS: r.heartbeat_ns,
        LiveField.STARTED_WALL_NS: r.started_wall_ns, LiveField.LAST_STEP: r.last_step,
        LiveField.LAST_STEP_WALL_NS: r.last_step_wall_ns, LiveField.STEP_NS: r.step_ns,
    }


def _put(run: Path, r: RankRecord, size: int = 0) -> Path:
    path = rank_record_path(run, r.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_frame(_doc(r), size))
    return path


def test_the_monitor_keeps_the_previous_record_when_a_file_is_caught_mid_write(tmp_path: Path) -> None:
    for r in range(WORLD):
        _put(tmp_path, rec(r, at=10.0))
    monitor = LivenessMonitor(tmp_path)
    assert states(monitor.poll(now(10.1))) == [RankState.RUNNING] * WORLD
    path = _put(tmp_path, rec(2, at=10.5), size=800)
    whole = path.read_bytes()
    path.write_bytes(whole[:40] + b"X" * 10 + whole[50:])  # torn: the CRC does not hold
    view = monitor.poll(now(10.6))
    assert view.rank(2).state is RankState.RUNNING and view.incidents == ()  # type: ignore[union-attr]
    assert any("mid-write" in w for w in view.warnings)
    path.write_bytes(b"")  # created, not yet written
    assert monitor.poll(now(10.7)).rank(2).state is RankState.RUNNING  # type: ignore[union-attr]
    path.write_bytes(whole[:100])  # cut short
    assert monitor.poll(now(10.8)).rank(2).state is RankState.RUNNING  # type: ignore[union-attr]
    bad_exit = exit_record_path(tmp_path, 1)
    bad_exit.write_text('{"version": 1, "ra')
    view = monitor.poll(now(10.9))
    assert view.rank(1).state is RankState.RUNNING and any("exit record" in w for w in view.warnings)  # type: ignore[union-attr]


def test_a_record_of_another_version_or_without_its_fields_fails_loudly(tmp_path: Path) -> None:
    doc = _doc(rec(0, at=1.0))
    with pytest.raises(SchemaVersionError, match="version 99"):
        decode_rank_record(encode_frame({**doc, LiveField.VERSION: 99}))
    del doc[LiveField.WALL_NS]
    with pytest.raises(RunDirError, match="without `wall_ns`"):
        decode_rank_record(encode_frame(doc), "rank-0.live")
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match="not a run directory"):
        LivenessMonitor(tmp_path / "f")


def test_the_monitor_before_the_run_starts_and_new_and_resolved_incidents(tmp_path: Path) -> None:
    monitor = LivenessMonitor(tmp_path / "run")
    view = monitor.poll(now(0.0))
    assert view.attempt is None and view.ranks == () and any("no liveness records" in w for w in view.warnings)
    run = tmp_path / "run"
    for at in (10.0, 13.0):  # the monitor sees their progress stop on its own clock too
        _put(run, rec(1, at=at, progress=10.0, last_step=14))
        for r in (0, 2, 3):
            _put(run, rec(r, at=at, progress=10.0, last_step=14, step=15, collective=DP))
        hang = monitor.poll(now(at + 0.1))
    assert [i.klass for i in hang.new] == [IncidentClass.HANG] and hang.resolved == ()
    assert monitor.poll(now(13.2)).new == ()  # the same incident: not new again
    for r in range(WORLD):  # it was a stall: everyone completes step 15
        _put(run, rec(r, at=13.3, last_step=15))
    back = monitor.poll(now(13.35))
    assert back.incidents == () and [i.id for i in back.resolved] == [hang.new[0].id]


def test_the_monitor_times_record_changes_on_its_own_clock(tmp_path: Path) -> None:
    """A writer clock 5 s behind: its records look 5 s old, but they keep changing, and so do their steps: running."""
    monitor = LivenessMonitor(tmp_path)
    for i in range(5):
        for r in range(WORLD):
            _put(tmp_path, replace(rec(r, at=float(i), last_step=i), seq=i + 1))
        view = monitor.poll(now(5.0 + i))
    assert view.in_state(RankState.RUNNING) == (0, 1, 2, 3)
    view = monitor.poll(now(12.0))  # no change for 3 s of its own clock: now they are
    assert view.in_state(RankState.LOST) == (0, 1, 2, 3)


# -- the writers --------------------------------------------------------------------------------------------------------

GROUP = object()
INFO = GroupInfo(name="dp", kind=GroupKind.DP, ranks=(0, 1), hosts=("host0", "host0"))


def _read(run: Path, rank: int) -> RankRecord:
    """The record as the monitor reads it: a frame caught mid-write (the heartbeat rewrites it in place) is read
    again, as `LivenessMonitor` does."""
    for _ in range(100):
        try:
            return decode_rank_record(rank_record_path(run, rank).read_bytes())
        except TornRecord:
            time.sleep(0.002)
    raise AssertionError("the rank record stayed torn for 100 reads")


def _wait(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_the_collector_keeps_its_record_current_and_says_how_it_ended(tmp_path: Path) -> None:
    config = CollectorConfig(run_dir=tmp_path, heartbeat_interval_s=0.2, liveness_poll_s=0.01, handle_sigterm=False,
                             inflight_after_s=0.05)
    c = Collector(config, rank=1, world_size=2, host="host0", attempt=3, sink=MemorySink())
    c.register_group(GROUP, INFO)
    c.start()
    first = _read(tmp_path, 1)
    assert (first.rank, first.attempt, first.pid, first.state) == (1, 3, os.getpid(), LiveState.RUNNING)
    assert first.last_step is None and first.heartbeat_ns == 200_000_000
    for i in range(3):
        with c.step(i):
            with c.phase("forward"):
                pass
    _wait(lambda: _read(tmp_path, 1).last_step == 2)
    assert _read(tmp_path, 1).step_ns is not None
    with c.step(3):
        with c.collective("all_reduce", GROUP, torch.zeros(2)):
            _wait(lambda: (r := _read(tmp_path, 1)).collective is not None and r.collective.ranks == (0, 1))
            inside = _read(tmp_path, 1)
            assert inside.step == 3 and inside.collective is not None
            assert (inside.collective.op, inside.collective.group, inside.collective.seq) == ("all_reduce", "dp", 0)
            seq = inside.seq
            _wait(lambda: _read(tmp_path, 1).seq > seq + 1)  # beats go on while the training thread is blocked
        with c.checkpoint_phase(3, "step-3", CheckpointPhase.WRITE):
            _wait(lambda: _read(tmp_path, 1).phase == "checkpoint.write")
            assert _read(tmp_path, 1).phase_start_wall_ns is not None
    rank_record_path(tmp_path, 1).unlink()  # a cleaned folder: written again
    _wait(lambda: rank_record_path(tmp_path, 1).exists())
    try:
        raise RuntimeError("Connection closed by peer (rank 0)")
    except RuntimeError as exc:
        c.exception(exc)
    c.close(exit_code=1)
    last = _read(tmp_path, 1)
    assert last.state is LiveState.EXITED and last.exit_code == 1 and last.exc_type == "RuntimeError"
    assert last.message == "Connection closed by peer (rank 0)" and last.last_step == 3
    assert c.errors == 0
    seq = last.seq
    time.sleep(0.3)
    assert _read(tmp_path, 1).seq == seq  # nothing is written after close


@pytest.mark.timeout(30)
def test_a_completed_step_is_in_the_record_when_the_step_ends_not_a_poll_later(tmp_path: Path) -> None:
    """The training thread writes the record at each step's end: a process killed at the next step's start has
    said it completed this one (its liveness thread looks only every `liveness_poll_s`, here an hour)."""
    config = CollectorConfig(run_dir=tmp_path, heartbeat_interval_s=7200.0, liveness_poll_s=3600.0,
                             handle_sigterm=False)
    c = Collector(config, rank=0, world_size=1, host="host0", sink=MemorySink())
    c.start()
    try:
        for i in range(3):
            with c.step(i):
                pass
            record = _read(tmp_path, 0)
            assert (record.last_step, record.step) == (i, None)
            assert record.last_step_wall_ns is not None and record.last_step_wall_ns <= time.time_ns()
    finally:
        c.close(exit_code=0)


def test_a_collector_that_cannot_write_its_record_counts_it_and_goes_on(tmp_path: Path) -> None:
    (tmp_path / "live").write_text("a file where the folder should be")
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False, liveness_poll_s=0.01), rank=0, world_size=1,
                  sink=MemorySink())
    c.start()
    with c.step(0):
        pass
    c.close(exit_code=0)
    assert c.errors >= 1


def test_liveness_off_writes_nothing(tmp_path: Path) -> None:
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False, liveness=False), rank=0, world_size=1,
                  sink=MemorySink())
    c.start()
    c.close(exit_code=0)
    assert not (tmp_path / "live").exists()


def test_exit_records_round_trip(tmp_path: Path) -> None:
    path = write_exit_record(tmp_path, rank=2, world_size=4, attempt=1, pid=77, host="host1", returncode=-9)
    doc = json.loads(path.read_text())
    assert doc[ExitField.SIGNAL] == 9 and doc[ExitField.EXIT_CODE] is None and doc[ExitField.ATTEMPT] == 1
    write_exit_record(tmp_path, rank=3, world_size=4, attempt=1, pid=78, host="host1", returncode=0)
    _put(tmp_path, rec(0, at=1.0, attempt=1))
    view = LivenessMonitor(tmp_path).poll(now(1.1))
    assert view.rank(2).state is RankState.STOPPED and view.rank(2).signal == 9  # type: ignore[union-attr]
    assert view.rank(3).state is RankState.FINISHED  # type: ignore[union-attr]
    assert [p.name for p in sorted((tmp_path / "live").iterdir())] == ["exit-2.json", "exit-3.json", "rank-0.live"]


def test_liveness_ids_are_distinct_from_the_part_file_detectors_and_same_fault_links_them() -> None:
    (live,) = classify([rec(r, at=10.0) for r in (0, 1, 3)] + [rec(2, at=9.95)], [exit_(2, at=10.05, sig=9)],
                       now(10.1)).incidents
    assert live.id.startswith("fail_stop-live-")
    part_file = Incident(klass=IncidentClass.FAIL_STOP, subject=Subject(kind=SubjectKind.RANK, id="2"), ranks=(2,),
                         onset_step=11, detection_step=11, confidence=0.9, cause=Cause.VANISHED, summary="", attempt=0)
    assert part_file.id != live.id and same_fault(live, part_file)
    assert not same_fault(live, replace(part_file, subject=Subject(kind=SubjectKind.RANK, id="3"), id=""))
    assert not same_fault(live, replace(part_file, attempt=1, id=""))
    hang = replace(part_file, klass=IncidentClass.HANG, id="")
    assert same_fault(live, hang)  # a frozen rank may read as either
    live_hang = replace(live, klass=IncidentClass.HANG)
    assert same_fault(live_hang, hang) and not same_fault(live_hang, replace(hang, onset_step=40, id=""))


def test_a_part_file_fail_stop_about_a_rank_still_beating_or_a_replaced_attempt_is_contradicted() -> None:
    # found under load (issue 31): the relaunch's rank 1 flushed nothing for 6 s while its peers did, and the part-file
    # reading named it "vanished" by silence while its liveness record said it was training
    view = classify([rec(r, at=20.0, attempt=1) for r in range(WORLD)], [], now(20.2))
    silent = Incident(klass=IncidentClass.FAIL_STOP, subject=Subject(kind=SubjectKind.RANK, id="1"), ranks=(1,),
                      onset_step=10, detection_step=10, confidence=0.7, cause=Cause.VANISHED, summary="", attempt=1)
    assert "rank 1 is running in attempt 1" in (view.contradicts(silent) or "")
    assert "ranks [0, 1, 2, 3] are running" in (view.contradicts(
        replace(silent, subject=Subject(kind=SubjectKind.JOB, id="job"), ranks=(0, 1, 2, 3), id="")) or "")
    assert "attempt 0, which attempt 1 replaced" in (view.contradicts(replace(silent, attempt=0, id="")) or "")
    assert view.contradicts(replace(silent, klass=IncidentClass.HANG, id="")) is not None
    # found at a relaunch's end (issue 31): its peers closed and flushed at once, rank 1 was still closing, its rows
    # a periodic flush old: read as gone by silence
    closing = classify([rec(r, at=20.0, attempt=1, state=LiveState.EXITED, exit_code=0) for r in (0, 2, 3)]
                       + [rec(1, at=20.0, attempt=1, state=LiveState.EXITING, exit_code=0)], [], now(20.2))
    assert closing.rank(1).state is RankState.FINISHED  # type: ignore[union-attr]
    assert "rank 1 is finished in attempt 1" in (closing.contradicts(silent) or "")
    failed = classify([rec(r, at=20.0, attempt=1) for r in (0, 2, 3)]
                      + [rec(1, at=20.0, attempt=1, state=LiveState.EXITING, exit_code=1)], [], now(20.2))
    assert failed.contradicts(silent) is None  # a rank closing on an error is not contradicted
    # what liveness cannot speak to, or does not contradict
    assert view.contradicts(replace(silent, klass=IncidentClass.STRAGGLER, id="")) is None
    assert view.contradicts(replace(silent, attempt=2, id="")) is None
    gone = classify([rec(r, at=20.0, attempt=1) for r in (0, 2, 3)] + [rec(1, at=15.0, attempt=1)], [], now(20.2))
    assert gone.rank(1).state is RankState.LOST and gone.contradicts(silent) is None  # type: ignore[union-attr]
    stuck = classify([rec(r, at=20.0, progress=10.0, attempt=1) for r in range(WORLD)], [], now(20.2))
    assert stuck.contradicts(replace(silent, klass=IncidentClass.HANG, id="")) is None
    # found in the hang drill (issue 31): ranks waiting in a collective for the hung rank 1 beat but wrote no rows
    # for a flush interval, and the part-file reading named them "vanished" beside the hang
    assert "rank 1 is still beating in attempt 1" in (stuck.contradicts(silent) or "")
    assert stuck.contradicts(replace(silent, cause=Cause.SIGNAL, id="")) is None  # a signal event is not silence
    assert classify([], [], now(1.0)).contradicts(silent) is None  # a run without liveness records


def test_docs_list_every_liveness_field() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "liveness.md").read_text()
    for name in [*LiveField, *ExitField, *LiveState]:
        assert f"`{name}`" in doc, name


def test_the_view_renders_one_line_per_rank() -> None:
    view = classify([rec(r, at=10.0) for r in (0, 1, 3)] + [rec(2, at=9.95)], [exit_(2, at=10.05, sig=9)], now(10.1))
    lines = view.table().splitlines()
    assert len(lines) == 1 + WORLD and lines[3].split()[:2] == ["2", "stopped"] and "SIGKILL" in lines[3]
    assert view.line() == "attempt 0, 4 ranks: 3 running, 1 stopped"


def test_peers_that_die_of_the_culprits_going_or_are_stopped_after_it_are_not_culprits() -> None:
    """The failing_device drill's attempt: rank 2's device error (its exception outside any collective) ends it;
    rank 0 dies of "Connection closed by peer" with its collective already closed in its record; ranks 1 and 3 are
    SIGTERMed by the manager's stop seconds later. One fail-stop: rank 2."""
    culprit = rec(2, at=10.0, state=LiveState.EXITING, exit_code=1, exc_type="RuntimeError",
                  message="CUDA error: unspecified launch failure (device slot 1 of host1)")
    closed = rec(0, at=10.2, progress=10.0, state=LiveState.EXITING, exit_code=1, exc_type="RuntimeError",
                 message="[pair.cc:553] Connection closed by peer [127.0.0.1]:8107. This is typically caused by a "
                         "remote worker crashing.")
    records = [culprit, closed, rec(1, at=13.0, progress=10.0), rec(3, at=13.0, progress=10.0)]
    exits = [exit_(2, at=10.05, code=1), exit_(0, at=10.25, code=1), exit_(1, at=13.5, sig=15), exit_(3, at=13.5, sig=15)]
    view = classify(records, exits, now(14.0))
    assert [r.reacting for r in view.ranks] == [True, False, False, False]
    assert [(i.subject.id, i.cause) for i in view.incidents] == [("2", Cause.EXCEPTION)]
    # killed together within the job window, they are still one fail-stop each (a host lost at once)
    together = classify([rec(r, at=10.0) for r in range(WORLD)], [exit_(r, at=10.05 + 0.01 * r, sig=9) for r in (0, 1)],
                        now(10.3))
    assert [i.subject.id for i in together.incidents] == ["0", "1"]


# -- the records in a post-mortem (analytics/liveness/posthoc.py) ----------------------------------------------------

def test_a_record_beyond_the_rows_gives_the_progress_and_says_the_steps_lost_exactly() -> None:
    import polars as pl

    from rankwatch.analytics.frames import Frames
    from rankwatch.analytics.liveness.posthoc import merge_records

    live = pl.DataFrame({  # rows: rank 2's end at step 100 (its last flush); the others' at 245 (closed on SIGTERM)
        "rank": [0, 1, 2, 3], "attempt": [0, 0, 0, 0], "last_step": [245, 245, 100, 245],
        "last_step_end_wall_ns": [T0 + 30 * S, T0 + 30 * S, T0 + 25 * S, T0 + 30 * S],
        "last_heartbeat_wall_ns": [T0 + 31 * S, T0 + 31 * S, T0 + 25 * S, T0 + 31 * S],
        "last_seen_wall_ns": [T0 + 33 * S, T0 + 33 * S, T0 + 25 * S, T0 + 33 * S],
    })
    frames = Frames.build(liveness=live, end_wall_ns=T0 + 33 * S)
    records = {0: rec(0, at=33, last_step=245, progress=30), 2: rec(2, at=30.2, last_step=245, progress=30, step=246),
               3: rec(3, at=33, last_step=245, progress=30, attempt=1)}  # rank 3's record is of another attempt
    merged, warnings = merge_records(frames, records)
    by_rank = {r["rank"]: r for r in merged.liveness.iter_rows(named=True)}
    assert by_rank[2]["last_step"] == 245 and by_rank[2]["last_step_end_wall_ns"] == T0 + 30 * S
    assert by_rank[2]["last_seen_wall_ns"] == T0 + int(30.2 * S) and by_rank[2]["heartbeat_step"] == 246
    assert by_rank[3] == {**by_rank[3], "last_seen_wall_ns": T0 + 33 * S, "last_heartbeat_wall_ns": T0 + 31 * S}
    assert merged.end_wall_ns == T0 + 33 * S
    assert len(warnings) == 1 and warnings[0].startswith(
        "telemetry: rank 2 attempt 0: its rows end at step 100, its liveness record at step 245"), warnings
    assert "steps 101..245 were trained and their rows never written" in warnings[0]
    assert merge_records(frames, {}) == (frames, ())


def test_a_post_mortem_takes_the_collective_a_record_was_inside_and_the_exit_records_of_the_latest_attempt() -> None:
    # found in the hang drill (issue 31): ranks SIGTERMed while waiting in an all_reduce closed without its rows (their
    # step in progress never completed); their records said where they were
    import polars as pl

    from rankwatch.analytics.frames import Frames
    from rankwatch.analytics.liveness.posthoc import merge_records

    live = pl.DataFrame({"rank": [0, 1, 2], "attempt": [1, 1, 1], "last_step": [9, 9, 9]})
    errors = pl.DataFrame({"rank": [2], "step": [10], "op": ["all_reduce"], "group": ["world"], "group_seq": [90]})
    groups = pl.DataFrame([{"group": "world", "kind": "dp", "ranks": [0, 1, 2]}])
    frames = Frames.build(liveness=live, collective_errors=errors, groups=groups, end_wall_ns=T0 + 30 * S)
    inside = OpenCollective(op="all_reduce", group="world", seq=90, wall_ns=T0 + 10 * S)
    records = {0: rec(0, at=20, attempt=1, step=10, collective=inside),
               1: rec(1, at=20, attempt=1, step=10),  # inside nothing
               2: rec(2, at=20, attempt=1, step=10, collective=inside)}  # its error row says it already
    exits = {0: replace(exit_(0, at=21, sig=15, attempt=1), outside_signal=15, outside_signal_wall_ns=T0 + 20 * S),
             1: exit_(1, at=21, code=0, attempt=0)}  # of an attempt the rank's rows are not of: left out
    merged, _ = merge_records(frames, records, exits)
    assert merged.open_collectives.select("rank", "step", "op", "group", "group_ranks", "group_seq",
                                          "enter_wall_ns").rows() == [(0, 10, "all_reduce", "world", [0, 1, 2], 90,
                                                                       T0 + 10 * S)]
    assert merged.exits.select("rank", "signal", "outside_signal").rows() == [(0, 15, 15)]
    # an older attempt's record says nothing of this one
    stale, _ = merge_records(frames, {0: rec(0, at=20, attempt=0, step=10, collective=inside)})
    assert stale.open_collectives.height == 0
