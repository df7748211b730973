"""A partition of one rank: its own connections fail locally while its peers see it go. The message rule
(analytics.transport) and both fail-stop readers that use it — the live records (analytics.liveness) and the part
files (analytics.failstop) — name that rank, cause NETWORK, instead of blaming the whole job."""

from __future__ import annotations

import polars as pl
import pytest

from rankwatch.analytics.failstop import detect_failstops
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, IncidentClass, SubjectKind
from rankwatch.analytics.liveness import classify
from rankwatch.analytics.transport import TransportSide, partitioned, transport_side
from rankwatch.base.schema import LiveState
from test_failstop import LAST, S, _coll, _ev, _liveness, _steps
from test_liveness import DP, WORLD, exit_, now, rec

# gloo's texts, as the partition drill's ranks wrote them (pair.cc)
_GLOO = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:{port}: {err}. "
         "This is typically caused by a remote worker hanging or bugs in the application.")
ABORT = _GLOO.format(port=8324, err="Software caused connection abort")
RESET = _GLOO.format(port=62860, err="Connection reset by peer")
CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16613. "
          "This is typically caused by a remote worker crashing.")


@pytest.mark.parametrize("message, side", [
    (ABORT, TransportSide.LOCAL), ("connect: Network is unreachable", TransportSide.LOCAL),
    ("send failed: ENETDOWN", TransportSide.LOCAL), (RESET, TransportSide.REMOTE), (CLOSED, TransportSide.REMOTE),
    ("Broken pipe", TransportSide.REMOTE), ("Connection refused", TransportSide.REMOTE),
    ("Timed out waiting 30000ms for recv operation to complete", None), (None, None), ("", None),
    ("Software caused connection abort after Connection reset by peer", None),  # both sides: none taken
])
def test_each_message_takes_the_side_its_errno_says(message: str | None, side: TransportSide | None) -> None:
    assert transport_side(message) is side


def test_partitioned_is_the_local_minority_against_remote_peers() -> None:
    assert partitioned({0: [RESET], 1: [ABORT], 2: [RESET], 3: [CLOSED]}) == {1}
    assert partitioned({0: [RESET, None], 1: [ABORT, "Timed out"], 2: ["Timed out"], 3: [CLOSED]}) == {1}
    # no peer saw it go: nothing says it was this rank's network
    assert partitioned({0: ["Timed out"], 1: [ABORT], 2: ["Timed out"]}) == set()
    # most of the job lost its network: the job's, not a rank's
    assert partitioned({0: [ABORT], 1: [ABORT], 2: [RESET], 3: [ABORT]}) == set()
    assert partitioned({0: [ABORT], 1: [RESET]}) == set()  # one against one: no majority to stand on
    assert partitioned({0: [ABORT, RESET], 1: [RESET], 2: [RESET], 3: [RESET]}) == set()  # mixed: not only local
    assert partitioned({}) == set()


def _died(rank: int, message: str, at: float) -> object:
    return rec(rank, at=at, progress=10.0, state=LiveState.EXITING, exit_code=1, exc_type="RuntimeError", step=10,
               message=message)


def test_liveness_names_the_partitioned_rank_not_the_job_when_every_rank_dies_at_once() -> None:
    messages = {0: RESET, 1: ABORT, 2: RESET, 3: CLOSED}
    records = [_died(r, m, 10.02 + 0.01 * r) for r, m in messages.items()]
    exits = [exit_(r, at=10.1, code=1) for r in range(WORLD)]
    (inc,) = classify(records, exits, now(10.2)).incidents  # type: ignore[arg-type]
    assert (inc.klass, inc.subject.kind, inc.subject.id, inc.cause) == (
        IncidentClass.FAIL_STOP, SubjectKind.RANK, "1", Cause.NETWORK)
    assert "network" in inc.summary
    # the same deaths with messages that say no side are still the job's
    plain = [_died(r, "Timed out waiting 30000ms", 10.02 + 0.01 * r) for r in range(WORLD)]
    (job,) = classify(plain, exits, now(10.2)).incidents  # type: ignore[arg-type]
    assert job.subject.kind is SubjectKind.JOB


def test_liveness_keeps_the_same_id_from_the_partitioned_ranks_first_death_on() -> None:
    """Its own record may close first (it stopped first) or last: the incident names it either way, with one id."""
    early = classify([_died(1, ABORT, 10.02), *(rec(r, at=10.05, progress=10.0, step=10, collective=DP)
                                                 for r in (0, 2, 3))], [], now(10.1))
    late = classify([_died(r, m, 10.02) for r, m in {0: RESET, 1: ABORT, 2: RESET, 3: CLOSED}.items()],
                    [exit_(r, at=10.1, code=1) for r in range(WORLD)], now(10.3))
    assert [i.subject.id for i in early.incidents] == ["1"] == [i.subject.id for i in late.incidents]
    assert early.incidents[0].id == late.incidents[0].id


def test_failstop_on_part_files_names_the_partitioned_rank() -> None:
    t = 10.05
    rows = [{**_coll(r, g, 20, t), "error": m} for r, g, m in ((0, "dp0", RESET), (1, "dp1", ABORT),
                                                               (2, "dp0", RESET), (3, "dp1", CLOSED))]
    events = [e for r in range(4) for e in (
        _ev(r, "exception", t + 0.01, exc_type="RuntimeError", message=rows[r]["error"], collective_op="all_reduce",
            collective_group=rows[r]["group"], collective_seq=20),
        _ev(r, "exit", t + 0.02, exit_code=1))]
    frames = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {r: t + 0.02 for r in range(4)}),
                          collective_errors=pl.DataFrame(rows), events=pl.DataFrame(events), end_wall_ns=12 * S)
    (inc,) = detect_failstops(frames)
    assert (inc.klass, inc.subject.id, inc.cause) == (IncidentClass.FAIL_STOP, "1", Cause.NETWORK)
    assert "own transport" in inc.summary
    # without the sides, every rank failing at once is the job's
    plain = frames.collective_errors.with_columns(pl.lit("timeout").alias("error"))
    ev = pl.DataFrame(events).with_columns(pl.lit("timeout").alias("message"))
    frames2 = Frames.build(steps=_steps(LAST), liveness=_liveness(LAST, {r: t + 0.02 for r in range(4)}),
                           collective_errors=plain, events=ev, end_wall_ns=12 * S)
    assert [i.subject.kind for i in detect_failstops(frames2)] == [SubjectKind.JOB]
