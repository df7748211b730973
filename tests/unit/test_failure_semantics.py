"""Failure semantics of real launchers and NCCL, read post hoc (`analytics.failstop`) and live
(`analytics.liveness.classify`): the same culprit either way.

torchrun (torch/distributed/elastic/multiprocessing/api.py, `SubprocessContext._poll` and `_close`): the agent polls
its workers every `--monitor-interval` (0.1 s); once one has failed it sends SIGTERM to every worker still running,
waits `--shutdown-timeout` (30 s) and SIGKILLs those left. A worker's Python SIGTERM handler (the collector's: a
signal event, then an exit event with code 143) runs only when its main thread is back in Python: one blocked in a
C call (a gloo wait, a CUDA sync) writes nothing and ends, SIGKILLed, with the others left at the end of the grace.
A SIGKILLed rank loses the rows of its last flush interval (5 s). NCCL's survivors die with NCCL's own texts,
which name no peer (`analytics.transport.REACTION_TEXTS`).

Layout: `n` ranks of one data-parallel group "dp"; heartbeat 1 s; step s runs from s to s + 1 s.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

from rankwatch.analytics.failstop import detect_failstops
from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, SubjectKind
from rankwatch.analytics.liveness import (
    ExitRecord, LivenessMonitor, LivenessView, OpenCollective, RankRecord, classify,
)
from rankwatch.analytics.transport import is_reaction, peers_named
from rankwatch.base.schema import LIVE_VERSION, LiveField, LiveState
from rankwatch.collector.liveness import encode_frame, rank_record_path

pytestmark = pytest.mark.timeout(60)

S = 1_000_000_000
GRACE_S = 30.0
"""torchrun's --shutdown-timeout default: SIGTERM, then SIGKILL this long after."""
FLUSH_S = 5.0
"""The collector's flush interval: a SIGKILLed rank loses up to this much of its last rows."""

NCCL_TEXTS = (
    "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version "
    "2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.\n"
    "Last error:\nsocketProgress: Connection reset by peer",
    "[Rank {g}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3021, OpType=ALLREDUCE, "
    "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600031 milliseconds before timing out.",
    "[PG ID 0 PG GUID 0(default_pg) Rank {g}] Process group watchdog thread terminated with exception: [Rank {g}] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3021, OpType=ALLREDUCE, NumelIn=1048576, "
    "NumelOut=1048576, Timeout(ms)=600000) ran for 600031 milliseconds before timing out.",
    "NCCL error in: ProcessGroupNCCL.cpp:2027, internal error - please report this issue to the NCCL developers, "
    "NCCL version 2.21.5\nncclInternalError: Internal check failed.",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL "
    "version 2.21.5\nncclSystemError: System call (e.g. socket, malloc) or external library call failed or device "
    "error.\nLast error:\nsocketProgress: Connection reset by peer",
    "NCCL communicator was aborted on rank {g}.",
    "[PG ID 1 PG GUID 3(dp) Rank {g}] ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress "
    "in monitoring enqueued collectives.",
)
"""NCCL's and c10d's texts as a survivor prints them; {g} is the reporter's own rank in the group (not a peer)."""


# -- post-hoc frames ---------------------------------------------------------------------------------------------------

def _ev(rank: int, kind: str, t: float, **kw: object) -> dict[str, object]:
    return {"rank": rank, "attempt": 0, "wall_ns": int(t * S), "kind": kind, **kw}


def _sigterm(rank: int, t: float, step: int = 10, phase: str | None = None) -> list[dict[str, object]]:
    """The collector's SIGTERM handler: a signal event, then its close's exit event (code 128 + 15)."""
    return [_ev(rank, "signal", t, signal=15, step=step, phase=phase),
            _ev(rank, "exit", t + 0.05, exit_code=143, step=step)]


def _open(rank: int, n: int, t: float, step: int = 10, seq: int = 20) -> dict[str, object]:
    return {"rank": rank, "step": step, "op": "all_reduce", "group": "dp", "group_ranks": list(range(n)),
            "group_seq": seq, "enter_wall_ns": int(t * S)}


def _frames(n: int, *, last: dict[int, int], seen: dict[int, float], beat: dict[int, float] | None = None,
            events: list[dict[str, object]] | None = None, opened: list[dict[str, object]] | None = None,
            clock: Clock = Clock.CPU) -> Frames:
    """Rank r completed steps 0..last[r] (step s ends at s + 1 s) and was last heard from at seen[r] s (its last
    heartbeat at beat[r], default the same)."""
    beat = beat if beat is not None else seen
    steps = pl.DataFrame([{"rank": r, "step": s, "start_wall_ns": s * S, "end_wall_ns": (s + 1) * S,
                           "duration_ns": S} for r in range(n) for s in range(last[r] + 1)])
    live = pl.DataFrame([{"rank": r, "attempt": 0, "last_step": last[r], "last_step_end_wall_ns": (last[r] + 1) * S,
                          "last_heartbeat_wall_ns": int(beat[r] * S), "last_seen_wall_ns": int(seen[r] * S),
                          "heartbeat_step": last[r] + 1} for r in range(n)])
    topo = pl.DataFrame([{"rank": r, "attempt": 0, "world_size": n, "host": f"host{r // 8}", "start_wall_ns": 0}
                         for r in range(n)])
    kw: dict[str, pl.DataFrame] = {}
    if events:
        kw["events"] = pl.DataFrame(events)
    if opened:
        kw["open_collectives"] = pl.DataFrame(opened)
    end = max(seen.values())
    return Frames.build(steps=steps, liveness=live, topology=topo, end_wall_ns=int(end * S), clock=clock, **kw)


def _culprits(incidents: tuple[Incident, ...]) -> list[tuple[IncidentClass, SubjectKind, str]]:
    return [(i.klass, i.subject.kind, i.subject.id) for i in incidents]


def _sigkilled_then_wave(n: int, *, delay: float, lost: bool, deferred: bool, killed: int = 2,
                         t_kill: float = 10.4) -> tuple[dict[int, int], dict[int, float], dict[int, float],
                                                        list[dict[str, object]], list[dict[str, object]]]:
    """Rank `killed` SIGKILLed at `t_kill`, inside step 10 (with `lost`, the rows of its last flush interval lost:
    its telemetry ends at its flush of 7.2 s, after step 6). torchrun SIGTERMs the others `delay` s later; with
    `deferred`, every other survivor is blocked in a C call in the step-10 all-reduce: it writes no signal event and
    beats on until the SIGKILL at the end of the grace, losing its last rows then."""
    t_wave = t_kill + delay
    last = {r: 9 for r in range(n)}
    seen = {r: t_wave + 0.05 for r in range(n)}
    beat = {r: t_wave - 0.3 for r in range(n)}
    events: list[dict[str, object]] = []
    opened: list[dict[str, object]] = []
    for r in range(n):
        if r == killed:
            continue
        if delay >= 1.0:  # in the all-reduce long enough for its in-flight row
            opened.append(_open(r, n, 10.3))
        if deferred and r % 2:
            seen[r] = beat[r] = t_wave + GRACE_S - FLUSH_S * ((r % 5) / 5)
        else:
            events += _sigterm(r, t_wave + 0.001 * r)
    if lost:
        last[killed], seen[killed], beat[killed] = 6, 7.2, 7.2
    else:
        seen[killed], beat[killed] = t_kill - 0.05, t_kill - 0.4
    return last, seen, beat, events, opened


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("delay", [0.1, 1.0, 5.0])
@pytest.mark.parametrize("lost", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
def test_a_sigkilled_rank_then_torchruns_sigterm_wave_names_only_the_killed_rank(
    n: int, delay: float, lost: bool, deferred: bool
) -> None:
    """(a) Rank 2 SIGKILLed, the others SIGTERMed by torchrun 0.1..5 s later: the SIGTERMs are reactions."""
    last, seen, beat, events, opened = _sigkilled_then_wave(n, delay=delay, lost=lost, deferred=deferred)
    frames = _frames(n, last=last, seen=seen, beat=beat, events=events, opened=opened)
    incs = detect_failstops(frames)
    assert _culprits(incs) == [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "2")]
    assert incs[0].cause is Cause.VANISHED


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("sigterm_too", [False, True])
def test_survivors_nccl_and_gloo_errors_before_the_wave_are_reactions(n: int, sigterm_too: bool) -> None:
    """(b) Rank 2 SIGKILLed at 10.4 s; the survivors' own errors (NCCL's and gloo's texts for a peer gone) beat
    torchrun's SIGTERM; with `sigterm_too`, half of them are then SIGTERMed while unwinding (signal + exit 143), the
    others exit 1 on their error."""
    texts = [NCCL_TEXTS[0], "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.3]:29500: "
             "Connection reset by peer", NCCL_TEXTS[1], NCCL_TEXTS[4]]
    last = {r: 9 for r in range(n)}
    seen = {r: 10.7 for r in range(n)}
    last[2], seen[2] = 9, 10.35
    events: list[dict[str, object]] = []
    for r in range(n):
        if r == 2:
            continue
        t = 10.42 + 0.01 * r
        events.append(_ev(r, "exception", t, exc_type="DistBackendError", step=10,
                          message=texts[r % len(texts)].format(g=r)))
        if sigterm_too and r % 2:
            events += _sigterm(r, 10.55)
        else:
            events.append(_ev(r, "exit", t + 0.1, exit_code=1, step=10))
    incs = detect_failstops(_frames(n, last=last, seen=seen, events=events))
    assert _culprits(incs) == [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "2")]


@pytest.mark.parametrize("subgroups", [False, True])
def test_32_ranks_whose_31_survivors_carry_only_nccl_watchdog_texts_blame_only_the_silent_rank(subgroups: bool) -> None:
    """(c) Rank 2's host is lost at 10.4 s (no launcher of its own left to see it): the 31 survivors wait in NCCL,
    beating, until their watchdogs time out 600 s later, and die with NCCL's texts only (no collective error row:
    on CUDA the host thread enqueued the collective and moved on). With `subgroups`, each text names the reporter's
    rank *within its group* (ProcessGroupNCCL's log prefix), which is another global rank: still the reporter."""
    n = 32
    last = {r: 9 for r in range(n)}
    seen = {r: 611.0 for r in range(n)}
    beat = {r: 610.5 for r in range(n)}
    last[2], seen[2], beat[2] = 9, 10.3, 10.0
    events: list[dict[str, object]] = []
    for r in range(n):
        if r == 2:
            continue
        g = r % 8 if subgroups else r
        t = 610.0 + 0.002 * r
        events.append(_ev(r, "exception", t, exc_type="DistBackendError", step=10,
                          message=NCCL_TEXTS[1 + r % (len(NCCL_TEXTS) - 1)].format(g=g)))
        events.append(_ev(r, "exit", t + 0.5, exit_code=1, step=10))
    incs = detect_failstops(_frames(n, last=last, seen=seen, beat=beat, events=events, clock=Clock.DEVICE))
    assert _culprits(incs) == [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "2")]  # precision 1.0: no survivor


def _delayed_kill(n: int, *, how: str, same_step: bool, device: bool) -> Frames:
    """(d) Rank 5 stops making progress in step 10 (a hang: it beats on). With `same_step` it stops before the
    step's all-reduce, which the others enter and wait in; else after it (in its optimizer), and the others complete
    step 10 and wait in step 11's. 120 s after its last progress the whole job is killed: `how` = "sigterm" (every
    rank's handler writes its signal), "deferred" (only those not blocked in a C call do; the rest are SIGKILLed
    30 s later), "sigkill" (no event anywhere; each rank loses up to a flush interval of rows). On the device clock
    no host thread is blocked inside a collective (no open collective row)."""
    kill = 130.0
    last = {r: (9 if same_step or r == 5 else 10) for r in range(n)}
    seen = {r: kill + 0.05 for r in range(n)}
    events: list[dict[str, object]] = []
    opened: list[dict[str, object]] = []
    wait_step = 10 if same_step else 11
    for r in range(n):
        if r != 5 and not device:
            opened.append(_open(r, n, wait_step + 0.6, step=wait_step))
        phase = "optimizer" if r == 5 else "backward"
        if how == "sigterm" or (how == "deferred" and (r == 5 or device)):
            events += _sigterm(r, kill + 0.001 * r, step=wait_step if r != 5 else 10, phase=phase)
        elif how == "deferred":
            seen[r] = kill + GRACE_S - 0.3 * (r % 7)
        else:
            seen[r] = kill - FLUSH_S * ((r * 37 % 11) / 11)
    return _frames(n, last=last, seen=seen, events=events, opened=opened, clock=Clock.DEVICE if device else Clock.CPU)


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("how", ["sigterm", "deferred", "sigkill"])
@pytest.mark.parametrize(("same_step", "device"), [(False, False), (False, True), (True, False)])
def test_a_delayed_kill_of_everyone_names_the_rank_whose_progress_stopped_first(
    n: int, how: str, same_step: bool, device: bool
) -> None:
    incs = detect_failstops(_delayed_kill(n, how=how, same_step=same_step, device=device))
    assert _culprits(incs) == [(IncidentClass.HANG, SubjectKind.RANK, "5")]


@pytest.mark.parametrize("how", ["sigterm", "deferred", "sigkill"])
def test_an_outside_kill_of_a_job_progressing_everywhere_is_the_jobs(how: str) -> None:
    """(e) Every rank progressing until the kill at 50.3 s. With SIGKILL each rank's rows end at its last flush, up
    to 5 s (5 steps) earlier: their last steps differ, which says nothing about progress stopping."""
    n = 16
    last = {r: 49 for r in range(n)}
    seen = {r: 50.35 for r in range(n)}
    events: list[dict[str, object]] = []
    for r in range(n):
        if how == "sigterm" or (how == "deferred" and r % 3):
            events += _sigterm(r, 50.3 + 0.001 * r, step=50)
        elif how == "deferred":
            seen[r] = 50.3 + GRACE_S - 0.2 * (r % 4)
            last[r] = 49  # it stayed in the C call (a step's all-reduce) until the SIGKILL
        else:
            flushed = 50.3 - FLUSH_S * ((r * 37 % 11) / 11)
            last[r], seen[r] = int(flushed) - 1, flushed
    incs = detect_failstops(_frames(n, last=last, seen=seen, events=events))
    assert _culprits(incs) == [(IncidentClass.FAIL_STOP, SubjectKind.JOB, "job")]
    assert incs[0].ranks == tuple(range(n))


@pytest.mark.parametrize("peers", ["wave", "nccl", "deferred"])
def test_a_rank_that_exits_with_its_own_exception_first_is_the_culprit(peers: str) -> None:
    """(f) Rank 3 raises its own error (not a peer's going) at 10.4 s; torchrun SIGTERMs the rest ("wave"), or they
    die of NCCL's texts first ("nccl"), or half of them sit in C calls until the SIGKILL after the grace
    ("deferred")."""
    n = 8
    last = {r: 9 for r in range(n)}
    seen = {r: 10.6 for r in range(n)}
    events = [_ev(3, "exception", 10.4, exc_type="torch.OutOfMemoryError", step=10,
                  message="CUDA out of memory. Tried to allocate 2.00 GiB"), _ev(3, "exit", 10.45, exit_code=1)]
    for r in range(n):
        if r == 3:
            continue
        if peers == "nccl":
            events.append(_ev(r, "exception", 10.5, exc_type="DistBackendError", message=NCCL_TEXTS[0]))
            events.append(_ev(r, "exit", 10.55, exit_code=1))
        elif peers == "deferred" and r % 2:
            seen[r] = 10.5 + GRACE_S
        else:
            events += _sigterm(r, 10.5 + 0.001 * r)
    incs = detect_failstops(_frames(n, last=last, seen=seen, events=events))
    assert [(i.klass, i.subject.id, i.cause) for i in incs] == [(IncidentClass.FAIL_STOP, "3", Cause.EXCEPTION)]


def test_a_rank_whose_own_error_is_an_nccl_reaction_text_is_not_the_culprit_the_silent_rank_is() -> None:
    """The first exception is rank 0's, but it is NCCL's text for a peer gone: rank 6, silent since 10.2 s, is."""
    n = 8
    last = {r: 9 for r in range(n)}
    seen = {r: 40.0 for r in range(n)}
    seen[6] = 10.2
    events = [_ev(0, "exception", 10.5, exc_type="DistBackendError", message=NCCL_TEXTS[0]),
              _ev(0, "exit", 10.6, exit_code=1)]
    for r in range(1, n):
        if r != 6:
            events += _sigterm(r, 10.7)
    incs = detect_failstops(_frames(n, last=last, seen=seen, events=events))
    assert _culprits(incs) == [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "6")]


# -- the texts ---------------------------------------------------------------------------------------------------------

def test_nccl_texts_are_reactions_that_name_no_peer_and_gloos_peer_names_still_count() -> None:
    for text in NCCL_TEXTS:
        assert is_reaction(text.format(g=3)), text
        assert peers_named(text.format(g=3), reporter=12, world=16) == set(), text  # 3: the reporter's group rank
    assert is_reaction("Timed out waiting 30000ms for recv operation to complete")
    assert not is_reaction("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_reaction("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
                           "ncclUnhandledCudaError: Call to CUDA function failed.")  # its own device
    assert peers_named("Connection closed by peer [gn001]:29503 (rank 11)", reporter=4, world=16) == {11}
    assert peers_named("Rank 3 failed to pass monitoredBarrier in 30000 ms", reporter=0, world=8) == {3}
    assert peers_named("(rank 11)", reporter=11, world=16) == set()
    assert peers_named("(rank 40)", reporter=1, world=16) == set()


# -- live --------------------------------------------------------------------------------------------------------------

T0 = 1_800_000_000 * S


def _rec(rank: int, n: int, *, at: float, last_step: int | None = 9, progress: float | None = None,
         state: LiveState = LiveState.RUNNING, step_s: float = 1.0, **kw: object) -> RankRecord:
    p = at if progress is None else progress
    fields: dict[str, object] = dict(
        rank=rank, world_size=n, attempt=0, pid=100 + rank, host=f"host{rank // 8}", state=state, seq=int(at * 10) + 1,
        wall_ns=T0 + int(at * S), heartbeat_ns=S, started_wall_ns=T0, last_step=last_step,
        last_step_wall_ns=None if last_step is None else T0 + int(p * S), step_ns=int(step_s * S), **kw,
    )
    return RankRecord(**fields)  # type: ignore[arg-type]


def _exit(rank: int, n: int, *, at: float, code: int | None = None, sig: int | None = None) -> ExitRecord:
    return ExitRecord(rank=rank, world_size=n, attempt=0, pid=100 + rank, host=f"host{rank // 8}",
                      wall_ns=T0 + int(at * S), exit_code=code, signal=sig)


def _at(t: float) -> int:
    return T0 + int(t * S)


def _live_culprits(view: LivenessView) -> list[tuple[IncidentClass, SubjectKind, str]]:
    return _culprits(view.incidents)


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("exit_records", [True, False])
@pytest.mark.parametrize("delay", [0.1, 1.0, 5.0])
def test_live_a_sigkilled_rank_then_the_sigterm_wave_names_only_the_killed_rank_at_every_poll(
    n: int, exit_records: bool, delay: float
) -> None:
    """(a) live: rank 2 SIGKILLed at 10.4 s (its record last written at 10.35 s); torchrun's SIGTERM reaches the
    others `delay` s later; their collectors record the signal and close (code 143), and with `exit_records` the
    launcher's side writes each end (rank 2: signal 9; the others: signal 15, the collector re-raises it). At no poll
    is a SIGTERMed survivor named; rank 2 is, once its end is known (its exit record, or silence past 2 heartbeats),
    always with the same incident id."""
    t_wave = 10.4 + delay
    running = [_rec(r, n, at=10.44, progress=10.0, step=10) for r in range(n) if r != 2]
    stopped = [_rec(r, n, at=t_wave + 0.05, progress=10.0, step=10, state=LiveState.EXITED, exit_code=143, signal=15)
               for r in range(n) if r != 2]
    victim = _rec(2, n, at=10.35, progress=10.0, step=10)
    exits = [_exit(2, n, at=10.4, sig=9)] if exit_records else []
    waved = exits + ([_exit(r, n, at=t_wave + 0.07, sig=15) for r in range(n) if r != 2] if exit_records else [])
    ids = set()
    for t, records, ex in ((10.45, running, exits), (t_wave + 0.06, stopped, exits), (t_wave + 0.1, stopped, waved),
                           (12.5, stopped, waved), (t_wave + 3.0, stopped, waved), (60.0, stopped, waved)):
        if t < t_wave and records is stopped:
            continue
        view = classify([*records, victim], ex, _at(t))
        named = _live_culprits(view)
        assert named in ([], [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "2")]), (t, named)
        ids.update(i.id for i in view.incidents)
        if exit_records or t >= 10.35 + 2.0 + 1e-3:
            assert named, t  # its end is known: named at once
    assert len(ids) == 1


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("device", [False, True])
def test_live_a_delayed_kill_of_everyone_keeps_naming_the_rank_whose_progress_stopped_first(
    n: int, device: bool
) -> None:
    """(d) live: rank 5 hangs in step 10's optimizer (beating); the others complete step 10 and wait in step 11 (in
    its all-reduce on CPU; on CUDA their host threads wait at a sync point, outside any collective); 120 s later
    every rank is SIGTERMed. Rank 5 is the hang while they wait and after they are all stopped, under one id."""
    dp = OpenCollective(op="all_reduce", group="dp", seq=44, ranks=tuple(range(n)))

    def waiting(at: float) -> list[RankRecord]:
        return [_rec(5, n, at=at, last_step=9, progress=10.0, step=10, phase="optimizer")] + [
            _rec(r, n, at=at, last_step=10, progress=11.0, step=11, phase="backward",
                 collective=None if device else dp) for r in range(n) if r != 5]

    stuck = classify(waiting(20.0), [], _at(20.05))
    (inc,) = stuck.incidents
    assert (inc.klass, inc.subject.id) == (IncidentClass.HANG, "5")
    killed = [replace(r, state=LiveState.EXITED, exit_code=143, signal=15, wall_ns=_at(130.05)) for r in waiting(130.0)]
    after = classify(killed, [_exit(r, n, at=130.1, sig=15) for r in range(n)], _at(131.0))
    assert [i.id for i in after.incidents] == [inc.id]


def test_live_an_outside_sigterm_of_every_rank_progressing_is_the_jobs() -> None:
    """(e) live: every rank progressing, then SIGTERMed at once: the job's, nobody blamed."""
    n = 8
    records = [_rec(r, n, at=50.35, last_step=49, progress=50.0, state=LiveState.EXITED, exit_code=143, signal=15)
               for r in range(n)]
    (inc,) = classify(records, [_exit(r, n, at=50.4, sig=15) for r in range(n)], _at(50.5)).incidents
    assert (inc.klass, inc.subject.kind) == (IncidentClass.FAIL_STOP, SubjectKind.JOB)


def test_live_survivors_with_only_nccl_texts_are_reactions() -> None:
    """(c) live: rank 2 silent since 10.3 s; the 31 others die 600 s later of NCCL's watchdog texts (no collective
    in their records: CUDA). Only rank 2."""
    n = 32
    dead = [_rec(r, n, at=610.0, progress=10.0, step=10, state=LiveState.EXITED, exit_code=1,
                 exc_type="DistBackendError", message=NCCL_TEXTS[1 + r % (len(NCCL_TEXTS) - 1)].format(g=r % 8))
            for r in range(n) if r != 2]
    view = classify([*dead, _rec(2, n, at=10.3, progress=10.0)], [], _at(611.0))
    assert _live_culprits(view) == [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "2")]


@pytest.mark.parametrize("exit_records", [True, False])
def test_live_one_hosts_sigterm_wave_waits_for_the_rank_it_did_not_reach(exit_records: bool) -> None:
    """16 ranks on two hosts; rank 2 (host 0) SIGKILLed at 10.4 s; host 0's agent SIGTERMs its 7 other workers at
    10.5 s (fewer than half the job); host 1's ranks beat on, waiting. Until rank 2's end is known the 7 are not
    named (they may be the launcher's reaction to a rank not heard from since); then rank 2 alone is."""
    n = 16
    termed = [_rec(r, n, at=10.55, progress=10.0, step=10, state=LiveState.EXITED, exit_code=143, signal=15)
              for r in range(8) if r != 2]
    exits = [_exit(2, n, at=10.4, sig=9)] if exit_records else []
    for t in (10.6, 11.0, 12.0, 12.5, 20.0):
        beating = [_rec(r, n, at=t - 0.05, progress=10.0, step=10) for r in range(8, n)]
        view = classify([*termed, *beating, _rec(2, n, at=10.35, progress=10.0, step=10)], exits, _at(t))
        named = _live_culprits(view)
        assert named in ([], [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "2")]), (t, named)
        assert bool(named) == (exit_records or t > 12.35), t


def test_live_a_rank_sigkilled_at_the_end_of_the_grace_is_stopped_not_failed() -> None:
    """Rank 2 SIGKILLed at 10.4 s (nobody signalled it); the launcher's SIGTERM at 10.5 s reaches the others' process
    groups; ranks 5 and 7 sit in a C call, write nothing, and are SIGKILLed 30 s later. Only rank 2, whether the exit
    records say the outside signal (`rankwatch torchrun`'s host agent), only the signal that ended each process (an
    older launcher side), or there are none (their records just stop: silent ends after the first SIGTERM). Steps
    take 10 s here, so 30 s in a collective is not yet stuck: only their ends tell them from a failure."""
    n = 8
    for records_say in ("outside signal", "exit signal", "nothing"):
        outside = records_say == "outside signal"
        records, exits = [], [_exit(2, n, at=10.4, sig=9)]
        for r in range(n):
            if r == 2:
                records.append(_rec(2, n, at=10.35, progress=10.0, step=10, step_s=10.0))
            elif r in (5, 7):
                records.append(_rec(r, n, at=40.4, progress=10.0, step=10, step_s=10.0))
                exits.append(replace(_exit(r, n, at=40.5, sig=9), outside_signal=15 if outside else None,
                                     outside_signal_wall_ns=_at(10.5) if outside else None))
            else:
                records.append(_rec(r, n, at=10.55, progress=10.0, step=10, state=LiveState.EXITED, exit_code=143,
                                    signal=15, step_s=10.0))
                exits.append(replace(_exit(r, n, at=10.6, sig=15), outside_signal=15 if outside else None,
                                     outside_signal_wall_ns=_at(10.5) if outside else None))
        view = classify(records, exits if records_say != "nothing" else [], _at(43.0))
        assert _live_culprits(view) == [(IncidentClass.FAIL_STOP, SubjectKind.RANK, "2")], records_say


def test_the_monitor_withdraws_a_fail_stop_a_later_poll_contradicts(tmp_path: Path) -> None:
    """Rank 3 frozen for 3 s (SIGSTOP, then SIGCONT): LOST, a fail-stop; then it beats and steps again: the
    fail-stop is withdrawn (resolved, and marked wrong)."""
    n = 4
    monitor = LivenessMonitor(tmp_path)

    def put(r: RankRecord) -> None:
        doc = {LiveField.VERSION: LIVE_VERSION, LiveField.RANK: r.rank, LiveField.WORLD_SIZE: r.world_size,
               LiveField.ATTEMPT: r.attempt, LiveField.PID: r.pid, LiveField.HOST: r.host,
               LiveField.STATE: str(r.state), LiveField.SEQ: r.seq, LiveField.WALL_NS: r.wall_ns,
               LiveField.HEARTBEAT_NS: r.heartbeat_ns, LiveField.STARTED_WALL_NS: r.started_wall_ns,
               LiveField.LAST_STEP: r.last_step, LiveField.LAST_STEP_WALL_NS: r.last_step_wall_ns,
               LiveField.STEP_NS: r.step_ns}
        path = rank_record_path(tmp_path, r.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_frame(doc))

    for r in range(n):
        put(_rec(r, n, at=10.0, progress=10.0))
    monitor.poll(_at(10.1))
    for r in (0, 1, 2):
        put(_rec(r, n, at=12.9, progress=10.0, step=10))
    frozen = monitor.poll(_at(13.0))
    assert [(i.klass, i.subject.id) for i in frozen.new] == [(IncidentClass.FAIL_STOP, "3")]
    for r in range(n):
        put(_rec(r, n, at=13.4, last_step=10, progress=13.4))
    back = monitor.poll(_at(13.5))
    assert back.incidents == () and [i.id for i in back.withdrawn] == [i.id for i in frozen.new]
    assert back.resolved == back.withdrawn
