"""The collectives table against torch's count (`analytics.coverage`): a whole table says nothing, a short one names
the rank, attempt and group with both counts, and a multi-rank job with steps and no collective at all is said."""

from __future__ import annotations

import duckdb
import polars as pl
import pytest

from rankwatch.analytics.coverage import collective_coverage
from rankwatch.base.schema import Table

pytestmark = pytest.mark.timeout(30)

ALL = frozenset({Table.EVENTS, Table.COLLECTIVES, Table.STEPS})


def _con(events: list[dict[str, object]], collectives: list[dict[str, object]], steps: int = 5) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    ev = pl.DataFrame(events, schema={"rank": pl.Int32, "attempt": pl.Int32, "wall_ns": pl.Int64, "kind": pl.String,
                                      "message": pl.String})
    co = pl.DataFrame(collectives, schema={"rank": pl.Int32, "group": pl.String, "group_seq": pl.Int64,
                                           "op": pl.String, "enter_wall_ns": pl.Int64, "status": pl.String})
    st = pl.DataFrame({"rank": [0] * steps, "step": list(range(steps))}, schema={"rank": pl.Int32, "step": pl.Int64})
    con.register("events_df", ev.to_arrow())
    con.register("collectives_df", co.to_arrow())
    con.register("steps_df", st.to_arrow())
    con.execute("CREATE TABLE events AS SELECT * FROM events_df")
    con.execute("CREATE TABLE collectives AS SELECT * FROM collectives_df")
    con.execute("CREATE TABLE steps AS SELECT * FROM steps_df")
    return con


def _starts(ranks: int, attempt: int = 0, t: int = 0) -> list[dict[str, object]]:
    return [{"rank": r, "attempt": attempt, "wall_ns": t, "kind": "start", "message": None} for r in range(ranks)]


def _counts(rank: int, counts: str, attempt: int = 0, t: int = 10_000) -> dict[str, object]:
    return {"rank": rank, "attempt": attempt, "wall_ns": t, "kind": "collective_counts", "message": counts}


def _ops(rank: int, group: str, n: int, *, t0: int = 100, op: str = "all_reduce") -> list[dict[str, object]]:
    return [{"rank": rank, "group": group, "group_seq": s, "op": op, "enter_wall_ns": t0 + s, "status": "ok"}
            for s in range(n)]


def test_a_whole_table_says_nothing() -> None:
    con = _con(_starts(2) + [_counts(0, '{"world":3,"dp.tp0":2}'), _counts(1, '{"world":3}')],
               _ops(0, "world", 3) + _ops(0, "dp.tp0", 2, op="all_gather") + _ops(1, "world", 3)
               + _ops(1, "world", 2, op="send"))
    assert collective_coverage(con, ALL, world_size=2) == ()


def test_a_short_table_names_rank_attempt_group_and_both_counts() -> None:
    in_flight_then_final = [{"rank": 1, "group": "world", "group_seq": 2, "op": "all_reduce", "enter_wall_ns": 103,
                             "status": "in_flight"}]
    con = _con(_starts(2) + [_counts(0, '{"world":3}'), _counts(1, '{"world":5,"tp.dp0":1}')],
               _ops(0, "world", 3) + _ops(1, "world", 3) + in_flight_then_final)
    (warning,) = collective_coverage(con, ALL, world_size=2)
    assert warning == ("collectives: rank 1 attempt 0: recorded fewer than torch's Flight Recorder counted "
                       "(tp.dp0 0/1, world 3/5): waits in the missing ones count as compute")


def test_each_attempt_is_compared_with_its_own_rows() -> None:
    events = _starts(1, 0, 0) + [_counts(0, '{"world":2}', 0, 1_000)] + _starts(1, 1, 5_000) + [
        _counts(0, '{"world":2}', 1, 9_000)]
    ok = _con(events, _ops(0, "world", 2, t0=100) + [
        {"rank": 0, "group": "world", "group_seq": s, "op": "all_reduce", "enter_wall_ns": 6_000 + s, "status": "ok"}
        for s in (10, 11)])
    assert collective_coverage(ok, ALL, world_size=1) == ()
    short = _con(events, _ops(0, "world", 2, t0=100))  # the second attempt recorded nothing
    assert collective_coverage(short, ALL, world_size=1) == (
        "collectives: rank 0 attempt 1: recorded fewer than torch's Flight Recorder counted (world 0/2): waits in "
        "the missing ones count as compute",)


def test_a_multi_rank_job_with_steps_and_no_collective_is_said() -> None:
    con = _con(_starts(4), [])
    (warning,) = collective_coverage(con, ALL, world_size=4)
    assert warning.startswith("collectives: none recorded in a job of 4 ranks")
    assert collective_coverage(con, ALL, world_size=1) == ()  # one rank has nothing to wait for


def test_damaged_counts_are_said_never_read_as_whole() -> None:
    con = _con(_starts(1) + [_counts(0, "{not json")], _ops(0, "world", 1))
    (warning,) = collective_coverage(con, ALL, world_size=1)
    assert "rank 0 attempt 0: collective counts not JSON" in warning and "not checked" in warning
