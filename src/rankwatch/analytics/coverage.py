"""Is the collectives table whole? Recorded collectives against torch's own count, and a job that records none.

A straggler's peers wait in collectives; a wait the collector did not see is counted as compute, and then the ranks
waiting look slow. So an analysis says when the table cannot be trusted to hold the waits:

- against torch's count: a rank whose collector ran with the Flight Recorder on wrote, at close, how many
  collectives each of its groups issued while it recorded (`EventKind.COLLECTIVE_COUNTS`, collector/flight.py).
  Fewer distinct operations in the table for that rank, attempt and group is a partial table, named with both
  counts. Point-to-point operations are not in torch's collective count and not compared.
- without it: a job of several ranks whose steps completed with no collective recorded at all.

Each finding is a one-line warning; the detectors still run (what was recorded is true, only incomplete).
"""

from __future__ import annotations

import json

import duckdb

from rankwatch.base.schema import Collectives, EventKind, Events, Table

__all__ = ["collective_coverage"]

_P2P = ("send", "recv")


def _counts(con: duckdb.DuckDBPyConnection) -> list[tuple[int, int, str]]:
    """(rank, attempt, message) of every COLLECTIVE_COUNTS event."""
    return [(int(r), int(a), str(m)) for r, a, m in con.execute(
        f"SELECT {Events.RANK}, {Events.ATTEMPT}, {Events.MESSAGE} FROM {Table.EVENTS} "
        f"WHERE {Events.KIND} = ? AND {Events.MESSAGE} IS NOT NULL ORDER BY 1, 2",
        [str(EventKind.COLLECTIVE_COUNTS)]).fetchall()]


def _recorded(con: duckdb.DuckDBPyConnection) -> dict[tuple[int, int, str], int]:
    """Distinct operations per (rank, attempt, group), point-to-point left out (an operation open at a flush has an
    in-flight row and later its final row: one operation). A row's attempt is that of the rank's latest start event
    before it."""
    ph = ", ".join("?" for _ in _P2P)
    rows = con.execute(
        f"SELECT c.{Collectives.RANK}, coalesce(s.{Events.ATTEMPT}, 0), c.\"{Collectives.GROUP}\", "
        f"count(DISTINCT c.{Collectives.GROUP_SEQ}) FROM {Table.COLLECTIVES} c ASOF LEFT JOIN "
        f"(SELECT {Events.RANK}, {Events.ATTEMPT}, {Events.WALL_NS} FROM {Table.EVENTS} WHERE {Events.KIND} = ?) s "
        f"ON c.{Collectives.RANK} = s.{Events.RANK} AND c.{Collectives.ENTER_WALL_NS} >= s.{Events.WALL_NS} "
        f"WHERE c.{Collectives.OP} NOT IN ({ph}) GROUP BY ALL", [str(EventKind.START), *_P2P]).fetchall()
    return {(int(r), int(a) if a is not None else 0, str(g)): int(n) for r, a, g, n in rows}


def collective_coverage(con: duckdb.DuckDBPyConnection, tables: set[Table] | frozenset[Table], *,
                        world_size: int) -> tuple[str, ...]:
    """One warning per (rank, attempt) whose collectives table is partial against torch's count (the groups short,
    with both counts), and one when a multi-rank job with steps recorded no collective at all."""
    if Table.EVENTS not in tables:
        return ()
    has_collectives = Table.COLLECTIVES in tables and bool(
        con.execute(f"SELECT 1 FROM {Table.COLLECTIVES} LIMIT 1").fetchall())
    has_steps = Table.STEPS in tables and bool(con.execute(f"SELECT 1 FROM {Table.STEPS} LIMIT 1").fetchall())
    out: list[str] = []
    if world_size > 1 and has_steps and not has_collectives:
        out.append(f"collectives: none recorded in a job of {world_size} ranks — the waits in collectives count as "
                   "compute, so a straggler's peers look slow (collector.attach() records them)")
    counts = _counts(con)
    if not counts:
        return tuple(out)
    recorded = _recorded(con) if has_collectives else {}
    for rank, attempt, message in counts:
        try:
            issued = json.loads(message)
        except ValueError:
            out.append(f"events: rank {rank} attempt {attempt}: collective counts not JSON ({message[:60]!r}); "
                       "collectives table not checked")
            continue
        if not isinstance(issued, dict):
            out.append(f"events: rank {rank} attempt {attempt}: collective counts not an object; not checked")
            continue
        short = []
        for group, n in sorted(issued.items()):
            if not isinstance(n, int):
                continue
            got = recorded.get((rank, attempt, str(group)), 0)
            if got < n:
                short.append(f"{group} {got}/{n}")
        if short:
            out.append(f"collectives: rank {rank} attempt {attempt}: recorded fewer than torch's Flight Recorder "
                       f"counted ({', '.join(short)}): waits in the missing ones count as compute")
    return tuple(out)
