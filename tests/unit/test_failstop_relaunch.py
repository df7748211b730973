"""Fail-stop and hang around a relaunch: a job still starting its new attempt is not hung, and a job stop names the
attempt its terminal events belong to. Layout dp=4 (one group), heartbeat 1 s, steps 1 s long."""

from __future__ import annotations

import polars as pl
import pytest

from rankwatch.analytics.failstop import FailStopConfig, detect_failstops
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import IncidentClass, SubjectKind

S = 1_000_000_000
WORLD = [0, 1, 2, 3]

pytestmark = pytest.mark.timeout(60)


def _relaunch(*, started: float, now: float, rank1_in: bool, rank1_topo: bool = True, no_topo: bool = False,
              stepped: bool = False) -> Frames:
    """Attempt 0 trained steps 0..24 and was stopped at 25.5 s; attempt 1 began at `started` (resuming from step 19)
    and completed no step by `now`: ranks 0, 2, 3 wait in the resume's broadcast for rank 1, which is still loading
    (its heartbeats on; with `rank1_in` it also waits in the broadcast; without `rank1_topo` it has not written its
    attempt-1 topology row yet: only its previous incarnation's is in)."""
    steps = pl.DataFrame([{"rank": r, "attempt": 0, "step": s, "start_wall_ns": s * S, "end_wall_ns": (s + 1) * S,
                           "duration_ns": S} for r in WORLD for s in range(25)]
                         + [{"rank": r, "attempt": 1, "step": 19 + i, "start_wall_ns": int((started + 40 + i) * S),
                             "end_wall_ns": int((started + 41 + i) * S), "duration_ns": S}
                            for r in WORLD for i in range(3) if stepped])
    topo = pl.DataFrame([{"rank": r, "attempt": a, "world_size": 4, "host": f"host{r // 2}",
                          "start_wall_ns": int(t * S)} for r in WORLD for a, t in ((0, 0.0), (1, started))
                         if (rank1_topo or (r, a) != (1, 1)) and not (no_topo and a == 1)])
    live = pl.DataFrame([{"rank": r, "attempt": 1, "last_step": 24, "last_step_end_wall_ns": 25 * S,
                          "last_heartbeat_wall_ns": int(now * S), "last_seen_wall_ns": int(now * S)} for r in WORLD])
    waiting = [r for r in WORLD if r != 1 or rank1_in]
    opened = pl.DataFrame([{"rank": r, "step": 19, "op": "broadcast", "group": "world", "group_ranks": WORLD,
                            "group_seq": 0, "peer": None, "enter_wall_ns": int((started + 3) * S)} for r in waiting])
    events = pl.DataFrame([{"rank": r, "attempt": a, "wall_ns": int(t * S), "kind": "start"}
                           for r in WORLD for a, t in ((0, 0.0), (1, started))])
    return Frames.build(steps=steps, topology=topo, liveness=live, open_collectives=opened, events=events,
                        end_wall_ns=int(now * S))


def test_a_relaunch_still_starting_is_not_a_hang_until_its_startup_grace() -> None:
    # 34 s into the new attempt on a loaded machine: peers blocked on rank 1 for 31 s, nobody stepped yet
    assert detect_failstops(_relaunch(started=30.0, now=64.0, rank1_in=False)) == ()
    assert detect_failstops(_relaunch(started=30.0, now=64.0, rank1_in=True)) == ()
    assert detect_failstops(_relaunch(started=30.0, now=64.0, rank1_in=False, rank1_topo=False)) == ()
    # ... also when rank 1's previous incarnation left a collective error behind (its own new start not written yet)
    errored = _relaunch(started=30.0, now=64.0, rank1_in=False, rank1_topo=False)
    errors = pl.DataFrame([{"rank": r, "step": 24, "op": "all_reduce", "group": "world", "group_ranks": WORLD,
                            "group_seq": 24, "exit_wall_ns": int(25.2 * S), "error": "Connection reset by peer"}
                           for r in (1,)])
    assert detect_failstops(Frames.build(steps=errored.steps, topology=errored.topology, liveness=errored.liveness,
                                         open_collectives=errored.open_collectives, events=errored.events,
                                         collective_errors=errors, end_wall_ns=64 * S)) == ()
    # no topology row of the new attempt at all yet (a collector's start comes after spawn and imports); its start
    # events and heartbeats say it began
    assert detect_failstops(_relaunch(started=30.0, now=64.0, rank1_in=False, no_topo=True)) == ()
    # past the grace the waits count again
    late = detect_failstops(_relaunch(started=30.0, now=64.0, rank1_in=False), FailStopConfig(startup_grace_s=20.0))
    assert late  # the detector speaks again (what it makes of this bare fixture is not the point)
    # and a job that stepped in its new attempt is not starting
    assert detect_failstops(_relaunch(started=10.0, now=64.0, rank1_in=False, stepped=True)) != ()


def test_a_job_stop_names_the_attempt_its_terminal_events_belong_to() -> None:
    # attempt 0 stopped by SIGTERM on every rank at 25.5 s; rank 0's attempt-1 start event has already arrived
    frames = _relaunch(started=30.0, now=30.5, rank1_in=False)
    events = pl.concat([
        frames.events.filter((pl.col("attempt") == 0) | (pl.col("rank") == 0)),
        pl.DataFrame([{"rank": r, "attempt": 0, "wall_ns": int(25.5 * S) + r, "kind": "signal", "signal": 15}
                      for r in WORLD]),
    ], how="diagonal_relaxed")
    live = frames.liveness.with_columns(pl.when(pl.col("rank") == 0).then(1).otherwise(0).alias("attempt")
                                        .cast(pl.Int32))
    stopped = Frames.build(steps=frames.steps, topology=frames.topology.filter(
        (pl.col("attempt") == 0) | (pl.col("rank") == 0)), liveness=live, events=events, end_wall_ns=int(30.5 * S))
    (inc,) = detect_failstops(stopped)
    assert (inc.klass, inc.subject.kind, inc.attempt) == (IncidentClass.FAIL_STOP, SubjectKind.JOB, 0)


def test_a_relaunched_rank_that_only_beats_so_far_makes_its_attempt_starting() -> None:
    """The failing_device drill's moment: attempt 0 ended with rank 1's device error and its peers' collective
    errors; 23 s into attempt 1 only rank 1's new heartbeats are in — no topology row, no other event of attempt 1,
    the other ranks' liveness still attempt 0's. Not a hang of rank 1 blamed on its peers' old errors."""
    started, now = 30.0, 53.0
    steps = pl.DataFrame([{"rank": r, "attempt": 0, "step": s, "start_wall_ns": s * S, "end_wall_ns": (s + 1) * S,
                           "duration_ns": S} for r in WORLD for s in range(23)])
    topo = pl.DataFrame([{"rank": r, "attempt": 0, "world_size": 4, "host": f"host{r // 2}", "start_wall_ns": 0}
                         for r in WORLD])
    live = pl.DataFrame([{"rank": r, "attempt": 1 if r == 1 else 0, "last_step": 22, "last_step_end_wall_ns": 23 * S,
                          "last_heartbeat_wall_ns": int((now if r == 1 else 23.3) * S),
                          "last_seen_wall_ns": int((now if r == 1 else 23.4) * S),
                          "first_seen_wall_ns": int((started + 20 if r == 1 else 0.0) * S)} for r in WORLD])
    errors = pl.DataFrame([{"rank": r, "step": 23, "op": "all_reduce", "group": "world", "group_ranks": WORLD,
                            "group_seq": 23, "exit_wall_ns": int(23.3 * S), "error": "Connection reset by peer"}
                           for r in (0, 2, 3)])
    events = pl.DataFrame([{"rank": r, "attempt": 0, "wall_ns": int(23.3 * S), "kind": "exception",
                            "exc_type": "RuntimeError", "collective_op": "all_reduce", "collective_group": "world"}
                           for r in (0, 2, 3)]
                          + [{"rank": r, "attempt": 0, "wall_ns": int(23.4 * S), "kind": "exit", "exit_code": 1}
                             for r in (0, 2, 3)])
    frames = Frames.build(steps=steps, topology=topo, liveness=live, collective_errors=errors, events=events,
                          end_wall_ns=int(now * S))
    # nothing about attempt 1 (what remains of attempt 0's stop is labelled attempt 0: the service passes over it)
    assert [(i.attempt, i.subject.kind) for i in detect_failstops(frames)] == [(0, SubjectKind.JOB)]
    # the same without the heartbeat's first sight (nothing says attempt 1 began) is read as before the fix
    blind = Frames.build(steps=steps, topology=topo, liveness=live.drop("first_seen_wall_ns"), collective_errors=errors,
                         events=events, end_wall_ns=int(now * S))
    assert [(i.klass, i.subject.id, i.attempt) for i in detect_failstops(blind)] == [(IncidentClass.HANG, "1", 1)]
