"""Fail-stop and hang culprits from hand-built frames shaped like the canary's real behaviour.

Layout dp=2, tp=2: groups tp0=[0,1], tp1=[2,3], dp0=[0,2], dp1=[1,3]; heartbeat 1 s; steps 1 s long.
"""

from __future__ import annotations

import polars as pl
import pytest

from rankwatch.analytics.analyze import detect_all
from rankwatch.analytics.failstop import FailStopConfig, detect_failstops
from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.incidents import Cause, IncidentClass, SubjectKind

S = 1_000_000_000
GROUPS = {"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]}


def _steps(last: dict[int, int]) -> pl.DataFrame:
    rows = [{"rank": r, "step": s, "start_wall_ns": s * S, "end_wall_ns": (s + 1) * S, "duration_ns": S}
            for r, n in last.items() for s in range(n + 1)]
    return pl.DataFrame(rows)


def _liveness(last: dict[int, int], seen: dict[int, float], beat: dict[int, float] | None = None) -> pl.DataFrame:
    beat = beat if beat is not None else seen
    return pl.DataFrame([
        {"rank": r, "attempt": 0, "last_step": n, "last_step_end_wall_ns": (n + 1) * S,
         "last_heartbeat_wall_ns": int(beat[r] * S), "last_seen_wall_ns": int(seen[r] * S)}
        for r, n in last.items()
    ])


def _coll(rank: int, group: str, seq: int, t: float, step: int = 10, op: str = "all_reduce") -> dict[str, object]:
    return {"rank": rank, "step": step, "op": op, "group": group, "group_ranks": GROUPS[group], "group_seq": seq,
            "enter_wall_ns": int(t * S), "exit_wall_ns": int(t * S), "error": "timeout"}


def _ev(rank: int, kind: str, t: float, **kw: object) -> dict[str, object]:
    return {"rank": rank, "attempt": 0, "wall_ns": int(t * S), "kind": kind, **kw}


LAST = {0: 9, 1: 9, 2: 9, 3: 9}  # everyone completed step 9 (ends at 10 s); step 10 never completes


def _peer_errors(culprit: int, t: float) -> tuple[pl.DataFrame, list[dict[str, object]]]:
    """Survivors time out in their step-10 collective with the culprit (or with a survivor waiting on it)."""
    blocked = {  # rank -> (group, group_seq) it timed out in; the diagonal rank waits on a waiting survivor
        2: {0: ("dp0", 20), 3: ("tp1", 40), 1: ("dp1", 20)},
        1: {0: ("tp0", 40), 3: ("dp1", 20), 2: ("dp0", 20)},
    }[culprit]
    rows, events = [], []
    for r, (g, seq) in blocked.items():
        rows.append(_coll(r, g, seq, t))
        events.append(_ev(r, "exception", t + 0.01, exc_type="DistBackendError", collective_op="all_reduce",
                          collective_group=g, collective_seq=seq))
        events.append(_ev(r, "exit", t + 0.02, exit_code=1))
    return pl.DataFrame(rows), events


def test_exit_with_own_exception_event_blames_only_that_rank() -> None:
    errors, events = _peer_errors(culprit=2, t=70)
    events += [_ev(2, "exception", 10.2, exc_type="RuntimeError", message="boom"), _ev(2, "exit", 10.3, exit_code=1)]
    frames = Frames.build(
        steps=_steps(LAST), liveness=_liveness(LAST, {0: 70, 1: 70, 2: 10.3, 3: 70}),
        collective_errors=errors, events=pl.DataFrame(events), end_wall_ns=71 * S,
    )
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.kind, inc.subject.id, inc.cause) == (IncidentClass.FAIL_STOP, SubjectKind.RANK, "2", Cause.EXCEPTION)
    assert inc.onset_step == inc.detection_step == 10
    assert {e.source for e in inc.evidence} >= {"liveness", "events"}


def test_exit_code_event_gives_exit_cause() -> None:
    events = [_ev(1, "exit", 10.1, exit_code=3)]
    frames = Frames.build(
        steps=_steps(LAST), liveness=_liveness(LAST, {0: 30, 1: 10.1, 2: 30, 3: 30}),
        open_collectives=pl.DataFrame([_coll(0, "tp0", 40, 10.05), _coll(3, "dp1", 20, 10.05)]),
        events=pl.DataFrame(events), end_wall_ns=30 * S,
    )
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.FAIL_STOP, "1", Cause.EXIT)


def test_a_rank_that_ended_after_finishing_a_save_stopped_in_the_next_step() -> None:
    """Rank 2 saved its checkpoint of step 10 (fsync ok) and ended abruptly at the start of step 11, losing its
    step-10 row (last recorded: step 9): the save holds step 10's update, so it stopped in step 11. A save of step 10
    from before its last recorded step's end (an earlier incarnation's) says nothing."""
    last = {0: 10, 1: 10, 2: 9, 3: 10}
    errors, events = _peer_errors(culprit=2, t=70)
    saved = pl.DataFrame([{"rank": 2, "step": 10, "checkpoint_id": "step-10", "phase": "fsync",
                           "start_wall_ns": int(10.8 * S), "end_wall_ns": int(10.9 * S), "ok": True}])
    frames = Frames.build(
        steps=_steps(last), liveness=_liveness(last, {0: 70, 1: 70, 2: 10.95, 3: 70}), collective_errors=errors,
        events=pl.DataFrame(events), checkpoints=saved, end_wall_ns=71 * S,
    )
    (inc,) = detect_failstops(frames)
    assert (inc.subject.id, inc.onset_step) == ("2", 11)
    early = saved.with_columns(pl.lit(int(9.5 * S)).alias("end_wall_ns"))
    (inc,) = detect_failstops(Frames.build(
        steps=_steps(last), liveness=_liveness(last, {0: 70, 1: 70, 2: 10.95, 3: 70}), collective_errors=errors,
        events=pl.DataFrame(events), checkpoints=early, end_wall_ns=71 * S))
    assert inc.onset_step == 10


def test_sigkill_vanished_survivors_signals_are_not_culprits() -> None:
    errors, events = _peer_errors(culprit=2, t=70)
    events += [_ev(r, "signal", 82, signal=15) for r in (0, 1, 3)] + [_ev(r, "exit", 82.1, exit_code=143) for r in (0, 1, 3)]
    frames = Frames.build(
        steps=_steps(LAST), liveness=_liveness(LAST, {0: 82.1, 1: 82.1, 2: 10.4, 3: 82.1}),
        collective_errors=errors, events=pl.DataFrame(events), end_wall_ns=83 * S,
    )
    incs = detect_failstops(frames)
    assert [(i.klass, i.subject.id, i.cause) for i in incs] == [(IncidentClass.FAIL_STOP, "2", Cause.VANISHED)]


@pytest.mark.parametrize("culprit_seen, klass, cause", [
    (40.0, IncidentClass.HANG, Cause.STUCK_IN_STEP),       # heartbeats went on until everyone was killed
    (10.3, IncidentClass.FAIL_STOP, Cause.VANISHED),       # it died long before the kill
])
def test_killed_all_at_once_culprit_from_open_collectives(culprit_seen: float, klass: IncidentClass, cause: Cause) -> None:
    opened = pl.DataFrame([_coll(0, "dp0", 20, 10.1), _coll(3, "tp1", 40, 10.2), _coll(1, "dp1", 20, 10.3)])
    frames = Frames.build(
        steps=_steps(LAST), liveness=_liveness(LAST, {0: 40, 1: 40, 2: culprit_seen, 3: 40}),
        open_collectives=opened, end_wall_ns=40 * S,
    )
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (klass, "2", cause)
    assert inc.onset_step == 10


def test_hang_heartbeats_continue_peers_time_out_then_everyone_sigtermed() -> None:
    errors, events = _peer_errors(culprit=1, t=70)
    events += [_ev(r, "signal", 82, signal=15) for r in range(4)] + [_ev(r, "exit", 82.1, exit_code=143) for r in range(4)]
    frames = Frames.build(
        steps=_steps(LAST), liveness=_liveness(LAST, {0: 82.1, 1: 82.1, 2: 82.1, 3: 82.1}),
        collective_errors=errors, events=pl.DataFrame(events), end_wall_ns=83 * S,
    )
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.HANG, "1", Cause.STUCK_IN_STEP)


def test_stuck_inside_a_collective_the_group_moved_past() -> None:
    opened = pl.DataFrame([_coll(1, "tp0", 5, 9.5, step=9), _coll(0, "tp0", 6, 10.1), _coll(2, "dp0", 20, 10.1),
                           _coll(3, "tp1", 40, 10.1)])
    last = {0: 9, 1: 8, 2: 9, 3: 9}
    frames = Frames.build(steps=_steps(last), liveness=_liveness(last, {r: 40 for r in range(4)}),
                          open_collectives=opened, end_wall_ns=40 * S)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause, inc.onset_step) == (IncidentClass.HANG, "1", Cause.STUCK_IN_COLLECTIVE, 9)


def test_clean_finished_run_gives_nothing() -> None:
    last = {r: 99 for r in range(4)}
    events = [_ev(r, "exit", 100.5, exit_code=0) for r in range(4)]
    frames = Frames.build(steps=_steps(last), liveness=_liveness(last, {r: 100.5 for r in range(4)}),
                          events=pl.DataFrame(events), end_wall_ns=int(100.5 * S))
    assert detect_failstops(frames) == ()
    # the same run analyzed long after, without exit events: all ranks at the same last step, nothing open
    frames = Frames.build(steps=_steps(last), liveness=_liveness(last, {r: 100.5 for r in range(4)}),
                          end_wall_ns=1000 * S)
    assert detect_failstops(frames) == ()


def test_live_window_gives_nothing_and_the_same_run_over_is_a_killed_job() -> None:
    last = {0: 49, 1: 49, 2: 48, 3: 49}  # rank 2 a step behind and inside a collective right now
    frames = Frames.build(steps=_steps(last), liveness=_liveness(last, {r: 50 for r in range(4)}),
                          open_collectives=pl.DataFrame([_coll(2, "dp0", 98, 49.8, step=49)]), end_wall_ns=50 * S)
    assert detect_failstops(frames, FailStopConfig(run_over=False)) == ()
    # a post-mortem of the same telemetry: every rank's telemetry ends at once mid-step, nothing wrote an exit
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.kind, inc.ranks, inc.onset_step) == (
        IncidentClass.FAIL_STOP, SubjectKind.JOB, (0, 1, 2, 3), 50)
    # what the live monitor runs (`detect_all(live=True)`, as `LiveRun.analyze` calls it) reads the window as live
    assert [i for i in detect_all(frames, anomaly=False, live=True) if i.klass is IncidentClass.FAIL_STOP] == []
    assert [i.subject.kind for i in detect_all(frames, anomaly=False) if i.klass is IncidentClass.FAIL_STOP] == [
        SubjectKind.JOB]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="stall_heartbeats"):
        FailStopConfig(stall_heartbeats=0)


def test_survivors_errors_name_the_culprit_whose_own_exit_was_logged_after_them() -> None:
    # host clocks differ: rank 2's exit event reads 0.4 s after the first survivor's error, which names it
    events = [_ev(2, "exit", 10.9, exit_code=2)]
    rows = []
    for r, g in ((0, "dp0"), (3, "tp1"), (1, "dp1")):
        rows.append(_coll(r, g, 20, 10.5))
        events.append(_ev(r, "exception", 10.5, exc_type="RuntimeError",
                          message="Connection closed by peer [gn001]:29503 (rank 2)"))
        events.append(_ev(r, "exit", 10.6, exit_code=1))
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {0: 10.6, 1: 10.6, 2: 10.9, 3: 10.6}),
                          collective_errors=pl.DataFrame(rows), events=pl.DataFrame(events), end_wall_ns=11 * S)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.FAIL_STOP, "2", Cause.EXIT)


def test_vanished_rank_without_collective_rows_not_the_survivors_that_exited_first() -> None:
    # rank 2 went silent at 10.3 s; the survivors time out one after another ~30 s later, naming no one
    events = []
    for r, t in ((0, 40.0), (1, 40.6), (3, 41.2)):
        events.append(_ev(r, "exception", t, exc_type="RuntimeError", message="Timed out waiting 30000ms for recv"))
        events.append(_ev(r, "exit", t + 0.1, exit_code=1))
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {0: 40.1, 1: 40.7, 2: 10.3, 3: 41.3}),
                          events=pl.DataFrame(events), end_wall_ns=int(41.3 * S))
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.FAIL_STOP, "2", Cause.VANISHED)


def test_launcher_sigterm_on_every_rank_at_once_is_the_jobs_fail_stop() -> None:
    events = [_ev(r, "signal", 10.5 + 0.01 * r, signal=15) for r in range(4)]
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {r: 10.5 + 0.01 * r for r in range(4)}),
                          events=pl.DataFrame(events), end_wall_ns=int(10.6 * S))
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.kind, inc.ranks, inc.cause, inc.onset_step) == (
        IncidentClass.FAIL_STOP, SubjectKind.JOB, (0, 1, 2, 3), Cause.SIGNAL, 10)


def test_killed_at_once_after_a_hang_flush_jitter_is_not_silence() -> None:
    # rank 1 stuck inside tp0 seq 40 of step 10 (rank 0 left it: it is blocked in dp0 of step 10, entered later);
    # the job is killed at 100 s and each rank lost up to 5 s of rows: their last signs range over 95..100 s
    opened = pl.DataFrame([_coll(1, "tp0", 40, 10.2), _coll(0, "dp0", 20, 10.5), _coll(2, "dp0", 20, 10.5),
                           _coll(3, "dp1", 20, 10.5)])
    seen = {0: 95.0, 1: 99.0, 2: 100.0, 3: 97.0}
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, seen), open_collectives=opened,
                          end_wall_ns=100 * S)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.HANG, "1", Cause.STUCK_IN_COLLECTIVE)


def test_cuda_job_stalled_everywhere_culprit_is_where_no_other_rank_is() -> None:
    # device clock: host threads wait at a sync point ("metrics"), no collective blocked on the host; rank 3's
    # thread is still in backward when every rank writes an event, 30 s into the stall
    events = [_ev(r, "warning", 40.0, step=10, phase="backward" if r == 3 else "metrics", message="device marks")
              for r in range(4)]
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {r: 60 for r in range(4)}),
                          events=pl.DataFrame(events), end_wall_ns=60 * S, clock=Clock.DEVICE)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.HANG, "3", Cause.STUCK_IN_STEP)
    # the same with rank 3 a step behind the rest of its stage
    last = {0: 9, 1: 9, 2: 9, 3: 8}
    frames = Frames.build(steps=_steps(last), liveness=_liveness(last, {r: 60 for r in range(4)}),
                          end_wall_ns=60 * S, clock=Clock.DEVICE)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id) == (IncidentClass.HANG, "3")


def test_a_rank_stuck_in_a_pipeline_stage_is_the_one_hang_not_the_stages_waiting_on_it() -> None:
    """Stage A = ranks 0, 1 (tensor group tA), stage B = ranks 2, 3 (tB); pipeline pairs 0-2 and 1-3. Rank 0 is stuck
    inside tA (rank 1 left it and waits to receive from 3); rank 2 waits to receive 0's activations, rank 3 in tB
    waits for 2. Every rank is blocked and each waits on another: the order of blocking says who is stuck (2 was
    blocked before 3 entered tB, so 3 waits on it for certain; 1 only since after 0 entered tA: it may be past it,
    and it waits, through certain waits, on 0). Once, a rule by entry time alone blamed 0 and 2."""
    groups = {"tA": [0, 1], "tB": [2, 3], "p0": [0, 2], "p1": [1, 3]}

    def op(rank: int, group: str, seq: int, t: float, kind: str = "all_reduce", peer: int | None = None
           ) -> dict[str, object]:
        return {"rank": rank, "step": 10, "op": kind, "group": group, "group_ranks": groups[group], "group_seq": seq,
                "peer": peer, "enter_wall_ns": int(t * S)}

    opened = pl.DataFrame([op(0, "tA", 5, 10.0), op(1, "p1", 8, 10.3, "recv", 3), op(2, "p0", 4, 9.8, "recv", 0),
                           op(3, "tB", 5, 10.2)])
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {r: 60.0 for r in range(4)}),
                          open_collectives=opened, end_wall_ns=60 * S)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.HANG, "0", Cause.STUCK_IN_COLLECTIVE)


def test_a_launchers_sigterm_reaching_the_hosts_one_after_another_is_still_the_jobs_fail_stop() -> None:
    """Hosts 0 (ranks 0, 1) and 1 (ranks 2, 3) get the launcher's SIGTERM 0.4 s apart (less than a heartbeat): the
    first host's pair is no culprit. Once, they were blamed as two fail-stops (their events came first)."""
    at = {0: 10.5, 1: 10.51, 2: 10.9, 3: 10.91}
    events = [_ev(r, "signal", t, signal=15) for r, t in at.items()]
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, at), events=pl.DataFrame(events),
                          end_wall_ns=int(11.0 * S))
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.kind, inc.cause) == (IncidentClass.FAIL_STOP, SubjectKind.JOB, Cause.SIGNAL)


def test_a_relaunched_job_still_starting_up_is_no_hang() -> None:
    """Attempt 1 started at 50 s (every rank's topology row); 4 s later its ranks beat and write events but have
    completed no step yet (loading the checkpoint; rank 1 a phase behind): their last completed step is attempt 0's,
    which ended at 10 s. Time since then is no stall; once, rank 1 was a hang (not where the others are)."""
    topo = pl.DataFrame([{"rank": r, "attempt": 1, "world_size": 4, "start_wall_ns": 50 * S} for r in range(4)])
    events = [_ev(r, "warning", 53.5, step=10, phase="load" if r == 1 else "gate", message="starting")
              for r in range(4)]
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {r: 54.0 for r in range(4)}), topology=topo,
                          events=pl.DataFrame(events), end_wall_ns=54 * S)
    assert detect_failstops(frames) == ()


def test_a_group_that_completed_later_steps_proves_its_members_got_past_a_wait_seen_before() -> None:
    """The checkpoint of step 10 is slow: rank 0 was seen 6 s in its world barrier (more than a stall), rank 1 still
    writing it; then every rank got on (the data-parallel groups, holding all four ranks, completed operations up to
    step 12) until the job was SIGKILLed at 20 s, and ranks 0 and 1 lost their rows since 16 s and 15.5 s. Once,
    rank 0's barrier row made rank 1 its missing member, as in a run of 128 ranks where it made 39 hangs."""
    last = {0: 9, 1: 9, 2: 18, 3: 18}
    opened = pl.DataFrame([{"rank": 0, "step": 10, "op": "barrier", "group": "world", "group_ranks": [0, 1, 2, 3],
                            "group_seq": 1, "enter_wall_ns": 10 * S}])
    groups = pl.DataFrame([{"group": g, "kind": g[:2], "ranks": r} for g, r in GROUPS.items()]
                          + [{"group": "world", "kind": "world", "ranks": [0, 1, 2, 3]}])
    done = pl.DataFrame([{"group": g, "kind": g[:2], "step": s, "ops": 1} for g in ("dp0", "dp1") for s in range(13)])
    seen = {0: 16.0, 1: 15.5, 2: 20.0, 3: 19.9}
    frames = Frames.build(steps=_steps(last), liveness=_liveness(last, seen), open_collectives=opened, groups=groups,
                          group_transfer=done, end_wall_ns=20 * S)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.kind, inc.cause, inc.onset_step) == (
        IncidentClass.FAIL_STOP, SubjectKind.JOB, Cause.VANISHED, 19)
    # without the groups' later operations nothing says rank 0 got past the barrier: rank 1 is who it waited for
    frames = Frames.build(steps=_steps(last), liveness=_liveness(last, seen), open_collectives=opened, groups=groups,
                          group_transfer=done.filter(pl.col("step") <= 10), end_wall_ns=20 * S)
    assert [(i.subject.kind, i.subject.id) for i in detect_failstops(frames)] == [(SubjectKind.RANK, "1")]


def _world_op(rank: int, t: float, *, error_at: float | None = None) -> dict[str, object]:
    return {"rank": rank, "step": 10, "op": "all_reduce", "group": "world", "group_ranks": [0, 1, 2, 3],
            "group_seq": 90, "enter_wall_ns": int(t * S),
            **({"exit_wall_ns": int(error_at * S), "error": "Connection closed by peer"} if error_at else {})}


def _stopped_by_launcher(stop: float, *, killed: int | None = None) -> pl.DataFrame:
    """Exit records as `rankwatch torchrun`'s agent writes them: every rank got the launcher's SIGTERM at `stop`
    (but `killed`, SIGKILLed from elsewhere before it: no outside signal)."""
    return pl.DataFrame([
        {"rank": r, "attempt": 0, "wall_ns": int((stop + 0.1) * S), "exit_code": 0, "signal": None,
         "outside_signal": 15, "outside_signal_wall_ns": int((stop + 0.001 * r) * S)} if r != killed else
        {"rank": r, "attempt": 0, "wall_ns": int((stop - 0.5) * S), "exit_code": None, "signal": 9,
         "outside_signal": None, "outside_signal_wall_ns": None}
        for r in range(4)])


def _manager_stops_a_hang(stop: float) -> dict[str, object]:
    """Found in the hang drill on the DDP example (issue 31): rank 1 hung at the start of step 10 and ranks 0, 2 and
    3 waited in the step's all_reduce for it; the recovery manager stopped the job at `stop` (rank 1's SIGTERM handler
    ran at once, its peers' only when its exit broke their all_reduce); rank 2's all_reduce failed after the stop,
    and only its rows say so: ranks 0 and 3 were inside the all_reduce by their liveness records alone."""
    events = [_ev(1, "signal", stop, signal=15), _ev(1, "exit", stop + 0.002, exit_code=143),
              *[_ev(r, "signal", stop + 0.04, signal=15) for r in (0, 3)],
              *[_ev(r, "exit", stop + 0.045, exit_code=143) for r in (0, 3)],
              _ev(2, "exception", stop + 0.075, exc_type="RuntimeError", collective_op="all_reduce",
                  collective_group="world", collective_seq=90, message="Connection closed by peer [127.0.0.1]:1234"),
              _ev(2, "signal", stop + 0.076, signal=15), _ev(2, "exit", stop + 0.078, exit_code=143)]
    return dict(steps=_steps(LAST), liveness=_liveness(LAST, {r: stop + 0.08 for r in range(4)}),
                groups=pl.DataFrame([{"group": "world", "kind": "dp", "ranks": [0, 1, 2, 3]}]),
                collective_errors=pl.DataFrame([_world_op(2, 10.1, error_at=stop + 0.075)]),
                open_collectives=pl.DataFrame([_world_op(r, 10.1) for r in (0, 3)]),
                events=pl.DataFrame(events), end_wall_ns=int((stop + 0.1) * S))


def test_what_follows_the_launchers_stop_of_every_rank_is_its_consequence_not_evidence() -> None:
    # stopped 2 s into the hang (less than a stall): nothing before the stop shows a culprit; the job was stopped
    (inc,) = detect_failstops(Frames.build(**_manager_stops_a_hang(12.0), exits=_stopped_by_launcher(12.0)))
    assert (inc.klass, inc.subject.kind, inc.cause) == (IncidentClass.FAIL_STOP, SubjectKind.JOB, Cause.SIGNAL)
    # stopped 20 s into it: every other rank was waiting on rank 1 when the stop came
    (inc,) = detect_failstops(Frames.build(**_manager_stops_a_hang(30.0), exits=_stopped_by_launcher(30.0)))
    assert (inc.klass, inc.subject.id) == (IncidentClass.HANG, "1")
    # a rank that ended without the launcher's signal is what the launcher reacted to: no launcher's stop
    frames = Frames.build(**_manager_stops_a_hang(30.0), exits=_stopped_by_launcher(30.0, killed=1))
    assert "1" in {i.subject.id for i in detect_failstops(frames)}


def test_a_rank_that_exits_inside_a_collective_its_group_entered_is_the_fail_stop_not_its_waiting_peers() -> None:
    """Rank 2 exits (code 1) inside the step-10 all-reduce on dp0, which rank 0 entered too: rank 0 waits there
    for it until it times out (60 s), as do the others, behind it. Rank 2 waited for nobody (every member of dp0
    was inside): its exit is how the job failed, not a reaction, though it was blocked when it came."""
    opened = pl.DataFrame([_coll(2, "dp0", 20, 10.05)])
    errors = pl.DataFrame([_coll(0, "dp0", 20, 70.0), _coll(1, "tp0", 40, 70.0), _coll(3, "tp1", 40, 70.0)])
    events = [_ev(2, "exit", 10.1, exit_code=1)]
    events += [_ev(r, "exception", 70.01, exc_type="DistBackendError", message="Timed out") for r in (0, 1, 3)]
    frames = Frames.build(
        steps=_steps(LAST), liveness=_liveness(LAST, {0: 70.02, 1: 70.02, 2: 10.1, 3: 70.02}),
        open_collectives=opened, collective_errors=errors, events=pl.DataFrame(events), end_wall_ns=71 * S,
    )
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause, inc.onset_step) == (IncidentClass.FAIL_STOP, "2", Cause.EXIT, 10)
