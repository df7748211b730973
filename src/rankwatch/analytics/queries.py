"""Named DuckDB queries over a run: one question per function, each returning a polars frame.

The first group builds the frames detectors read (`load_frames`, shapes in analytics/frames.py). The second
answers the standard questions an operator asks of a run (arrival order in collectives, where step time goes,
link bandwidth, a GPU against its peers, checkpoints against slow steps, fingerprint agreement); the dashboard
and the post-mortem notebooks show them.

Every query takes an open connection from `store.connect` and an optional `since_step` (inclusive) that limits it
to the latest window of the run. A table the run never wrote gives an empty frame of the documented shape.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path

import duckdb
import polars as pl

from rankwatch.analytics.frames import Clock, Frames, conform
from rankwatch.analytics.store import connect
from rankwatch.base.schema import CollectiveStatus, EventKind, Table

# Operations every member of the group joins, so (group, group_seq, step) names one operation on all of them.
# Point-to-point send/recv pairs are excluded: their group_seq does not line up across the pair.
_MEMBER_OPS = "('all_reduce', 'all_gather', 'reduce_scatter', 'broadcast', 'barrier', 'all_to_all')"


_KNOWN_TABLES: ContextVar[tuple[duckdb.DuckDBPyConnection, frozenset[str]] | None] = ContextVar(
    "rankwatch_known_tables", default=None)
"""The tables of one connection while `load_frames` runs its queries (the catalog does not change meanwhile)."""


def _tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    known = _KNOWN_TABLES.get()
    if known is not None and known[0] is con:
        return set(known[1])
    return {r[0] for r in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal UNION SELECT table_name FROM duckdb_tables()").fetchall()}


def _frame(con: duckdb.DuckDBPyConnection, sql: str) -> pl.DataFrame:
    return pl.from_arrow(con.sql(sql).to_arrow_table())  # type: ignore[return-value]


def _since(since_step: int | None, col: str = "step") -> str:
    return "" if since_step is None else f" AND {col} >= {int(since_step)}"


def run_clock(con: duckdb.DuckDBPyConnection, clock: Clock = Clock.AUTO,
              since_step: int | None = None) -> tuple[Clock, str | None]:
    """The clock to read the run's timing from, and a warning when AUTO had to fall back: DEVICE when every rank
    with steps carries device columns (`steps.device_ns`), CPU when none does; when only some do, CPU for all
    (device figures are never compared with CPU ones) with a warning naming the ranks without device timing. An
    explicit CPU or DEVICE is kept as given (DEVICE on a run without device columns raises `ValueError`)."""
    if clock is Clock.CPU or Table.STEPS not in _tables(con):
        return Clock.CPU, None
    ranks, timed, untimed = con.execute(f"""
        SELECT count(*), count(*) FILTER (WHERE timed),
               list(rank ORDER BY rank) FILTER (WHERE NOT timed)[1:8]
        FROM (SELECT rank, bool_or(device_ns IS NOT NULL) AS timed FROM steps WHERE true {_since(since_step)}
              GROUP BY rank)""").fetchall()[0]
    if clock is Clock.DEVICE:
        if not timed:
            raise ValueError("clock device: no rank of the run recorded device timing (steps.device_ns is null "
                             "everywhere: a CPU run)")
        return Clock.DEVICE, None
    if ranks and timed == ranks:
        return Clock.DEVICE, None
    if timed:
        shown = ",".join(str(r) for r in untimed or [])
        more = "…" if ranks - timed > len(untimed or []) else ""
        return Clock.CPU, (f"{ranks - timed} of {ranks} ranks recorded no device timing (ranks {shown}{more}): the run "
                           "is analysed on the CPU clock, which on CUDA ranks does not see their GPUs' work")
    return Clock.CPU, None


# -- frames for the detectors ------------------------------------------------------------------------------------


_TOPOLOGY_ROWS = """SELECT rank, attempt, world_size, host, local_rank, pid, device_uuid, dp, tp, pp, dp_size, tp_size, pp_size,
               'pp=' || pp AS role, start_wall_ns
        FROM topology"""


def topology(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Each rank's latest start: host, device, parallel coordinates; role = its pipeline stage."""
    if Table.TOPOLOGY not in _tables(con):
        return conform("topology", None)
    return conform("topology", _frame(con, f"""
        {_TOPOLOGY_ROWS}
        QUALIFY row_number() OVER (PARTITION BY rank ORDER BY attempt DESC, start_wall_ns DESC) = 1
        ORDER BY rank"""))


def attempt_topology(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Each rank's start in every attempt (its latest row per attempt), as `topology` has them, by attempt and rank:
    where every attempt placed every rank (a relaunch may move ranks to other devices)."""
    if Table.TOPOLOGY not in _tables(con):
        return conform("topology", None)
    return conform("topology", _frame(con, f"""
        {_TOPOLOGY_ROWS}
        QUALIFY row_number() OVER (PARTITION BY rank, attempt ORDER BY start_wall_ns DESC) = 1
        ORDER BY attempt, rank"""))


def groups(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Every process group of the run once: kind, members, their hosts and the inter-host links it crosses."""
    if Table.TOPOLOGY not in _tables(con):
        return conform("groups", None)
    return conform("groups", _frame(con, f"""
        SELECT "group", kind, ranks, hosts, links FROM {_group_info(con)} ORDER BY "group" ASC"""))


_GROUP_INFO = "_rankwatch_group_info"


def _group_info(con: duckdb.DuckDBPyConnection) -> str:
    """A temporary table with one row per process group ("group", kind, ranks, hosts, links), read from the
    topology once and again only when the topology changes. Every rank's topology row lists its groups with all
    members, hosts and links; reading that column costs more than any other query of a window, so the three queries
    that need the groups share one read."""
    key = con.execute("SELECT count(*), max(start_wall_ns), max(attempt) FROM topology").fetchall()[0]
    try:
        cached = con.execute(f"SELECT n, t, a FROM {_GROUP_INFO}_key").fetchall()
    except duckdb.CatalogException:
        cached = []
    if [key] != cached:
        con.execute(f"""
            CREATE OR REPLACE TEMP TABLE {_GROUP_INFO} AS
            SELECT g.name AS "group", any_value(g.kind) AS kind, any_value(g.ranks) AS ranks,
                   any_value(g.hosts) AS hosts, any_value(g.links) AS links
            FROM (SELECT unnest(groups) AS g FROM topology) GROUP BY g.name""")
        con.execute(f"CREATE OR REPLACE TEMP TABLE {_GROUP_INFO}_key AS SELECT $1::BIGINT AS n, $2::BIGINT AS t, "
                    "$3::BIGINT AS a", list(key))
    return _GROUP_INFO


def steps(con: duckdb.DuckDBPyConnection, since_step: int | None = None, clock: Clock = Clock.CPU) -> pl.DataFrame:
    """Completed steps per rank; where a restarted rank repeated a step, its latest attempt's row. On the device
    clock compute and collective wait are the device's (`steps.device_compute_ns`, `device_collective_ns`)."""
    if Table.STEPS not in _tables(con):
        return conform("steps", None)
    restarted = con.execute("SELECT max(attempt) FROM steps").fetchall()[0][0] or 0
    dedupe = "QUALIFY row_number() OVER (PARTITION BY rank, step ORDER BY attempt DESC) = 1" if restarted else ""
    if clock is Clock.DEVICE:
        timing, untimed, join = "device_compute_ns AS compute_ns, device_collective_ns AS collective_wait_ns", "", ""
    elif has_untimed(con):
        untimed = f"WITH u AS ({_untimed_waits_sql(since_step)}),"
        timing = ("greatest(s.compute_ns - coalesce(u.wait_ns, 0), 0) AS compute_ns, "
                  "s.collective_wait_ns + least(coalesce(u.wait_ns, 0), s.compute_ns) AS collective_wait_ns")
        join = "LEFT JOIN u ON u.rank = s.rank AND u.step = s.step AND u.attempt = s.attempt"
    else:
        timing, untimed, join = "compute_ns, collective_wait_ns", "", ""
    return conform("steps", _frame(con, f"""
        {untimed or "WITH"} s AS (SELECT * FROM steps WHERE true {_since(since_step)} {dedupe})
        SELECT s.rank, s.attempt, s.step, s.start_wall_ns, s.end_wall_ns, s.duration_ns, {timing},
               s.dataloader_wait_ns, s.checkpoint_ns, s.loss, s.local_grad_norm, s.all_finite, s.data_position,
               s.tokens
        FROM s {join} ORDER BY s.rank, s.step"""))


def has_untimed(con: duckdb.DuckDBPyConnection) -> bool:
    """Untimed collectives recorded, with the topology (hosts) and events (attempts) their waits are read with."""
    return {Table.COLLECTIVES, Table.TOPOLOGY, Table.EVENTS} <= _tables(con) and bool(con.execute(
        f"SELECT 1 FROM collectives WHERE status = '{CollectiveStatus.UNTIMED}' LIMIT 1").fetchall())


def untimed_arrivals_sql(since_step: int | None = None) -> str:
    """SQL of the arrivals at collectives nothing timed (`untimed` rows: a compiled graph's, read from the Flight
    Recorder, collector/backfill.py): per member rank, attempt and operation its op, group, bytes, enter times and
    ``last_ns``, the wall time the group's last member arrived. The Flight Recorder gives each member's enqueue time
    on its host's wall clock; a blocking collective cannot end before its last member arrives, so each member waited
    at least from its own arrival to the last one's. Only operations every member has a row of, all on one host
    (one clock: across hosts the clocks' offset would read as waiting), as tensor-parallel groups are."""
    return f"""
        WITH h AS (SELECT rank, arg_max(host, attempt) AS host FROM topology GROUP BY rank),
        o AS (
            SELECT c.rank, coalesce(e.attempt, 0) AS attempt, c.step, c.op, c."group", c.group_ranks, c.group_seq,
                   c.bytes, c.enter_wall_ns, c.enter_mono_ns, h.host
            FROM collectives c JOIN h USING (rank)
            ASOF LEFT JOIN (SELECT rank, attempt, wall_ns FROM events WHERE kind = '{EventKind.START}') e
              ON c.rank = e.rank AND c.enter_wall_ns >= e.wall_ns
            WHERE c.status = '{CollectiveStatus.UNTIMED}' AND c.op IN {_MEMBER_OPS} AND len(c.group_ranks) > 1
                  AND c.step >= 0 {_since(since_step, "c.step")}),
        m AS (
            SELECT *, max(enter_wall_ns) OVER w AS last_ns, count(*) OVER w AS n, count(DISTINCT host) OVER w AS hosts
            FROM o WINDOW w AS (PARTITION BY "group", group_seq, step, attempt))
        SELECT rank, attempt, step, op, "group", group_ranks, bytes, enter_wall_ns, enter_mono_ns, last_ns
        FROM m WHERE n = len(group_ranks) AND hosts = 1"""


def _untimed_waits_sql(since_step: int | None) -> str:
    """Per (rank, attempt, step): the time the rank waited in collectives nothing timed, from their arrivals
    (`untimed_arrivals_sql`). Without this, those waits count as compute, and the peers of a slow rank look as
    slow as it."""
    return f"""SELECT rank, attempt, step, sum(last_ns - enter_wall_ns) AS wait_ns
        FROM ({untimed_arrivals_sql(since_step)}) GROUP BY ALL"""


def _inside(clock: Clock) -> tuple[str, str]:
    """(time inside an operation, which operations count) on `clock`. On the CPU an asynchronous operation's time
    is issue to completion on the host, unrelated to arrival; on the device its start event is recorded where the
    rank's stream reached it, so a DDP bucket's device time is arrival evidence like a blocking collective's."""
    if clock is Clock.DEVICE:
        return "device_duration_ns", "device_duration_ns IS NOT NULL"
    return "duration_ns", "NOT async_op"


def lateness(con: duckdb.DuckDBPyConnection, since_step: int | None = None, clock: Clock = Clock.CPU) -> pl.DataFrame:
    """Per rank per step, clock-free: how late the rank arrived to the step's blocking collectives, measured by
    how much less it waited than the member that waited longest (the late rank waits least). On the device clock,
    from the operations' device time (asynchronous ones included)."""
    if Table.COLLECTIVES not in _tables(con):
        return conform("lateness", None)
    inside, which = _inside(clock)
    return conform("lateness", _frame(con, f"""
        WITH c AS (
            SELECT rank, step, "group", group_seq, {inside} AS duration_ns FROM collectives
            WHERE status = '{CollectiveStatus.OK}' AND {which} AND op IN {_MEMBER_OPS}
              AND len(group_ranks) > 1 {_since(since_step)}),
        m AS (
            SELECT "group", group_seq, step, max(duration_ns) AS max_wait, min(duration_ns) AS min_wait
            FROM c GROUP BY ALL)
        SELECT c.rank, c.step, count(*) AS ops, sum(c.duration_ns) AS wait_ns,
               sum(m.max_wait - c.duration_ns) AS late_ns,
               sum(CASE WHEN c.duration_ns = m.min_wait THEN 1 ELSE 0 END) AS last_arrivals
        FROM c JOIN m USING ("group", group_seq, step)
        GROUP BY c.rank, c.step ORDER BY c.rank, c.step"""))


def _op_transfers_sql(since_step: int | None, group_info: str, clock: Clock = Clock.CPU) -> str:
    """One row per operation that moved bytes: its group, group kind, step, transfer time, bytes, and the
    inter-host links it crossed.

    A collective's transfer is the shortest member's time inside (the last to arrive waits only for the
    transfer); it crosses the links of its group's ring. A point-to-point transfer pairs the k-th send from a to b
    in a step with the k-th recv at b from a, takes the shorter of the two times, and crosses only the link
    between a's and b's hosts. On the device clock the times are the operations' device times."""
    inside = "device_duration_ns" if clock is Clock.DEVICE else "duration_ns"
    ok = f"status = '{CollectiveStatus.OK}' AND {inside} IS NOT NULL AND bytes > 0 {_since(since_step)}"
    return f"""
        g AS (SELECT "group", kind, links FROM {group_info}),
        host AS (SELECT rank, arg_max(host, attempt) AS host FROM topology GROUP BY rank),
        coll AS (
            SELECT "group", step, group_seq, min({inside}) AS transfer_ns, max(bytes) AS bytes
            FROM collectives WHERE op IN {_MEMBER_OPS} AND len(group_ranks) > 1 AND {ok}
            GROUP BY ALL),
        snd AS (SELECT rank AS src, peer AS dst, step, "group", {inside} AS duration_ns, bytes,
                       row_number() OVER (PARTITION BY rank, peer, step ORDER BY seq) AS k
                FROM collectives WHERE op = 'send' AND peer IS NOT NULL AND {ok}),
        rcv AS (SELECT peer AS src, rank AS dst, step, {inside} AS duration_ns,
                       row_number() OVER (PARTITION BY rank, peer, step ORDER BY seq) AS k
                FROM collectives WHERE op = 'recv' AND peer IS NOT NULL AND {ok}),
        p2p AS (
            SELECT snd."group", snd.step, least(snd.duration_ns, rcv.duration_ns) AS transfer_ns, snd.bytes,
                   CASE WHEN hs.host = hd.host THEN []::VARCHAR[]
                        ELSE [least(hs.host, hd.host) || '<->' || greatest(hs.host, hd.host)] END AS links
            FROM snd JOIN rcv USING (src, dst, step, k)
            JOIN host hs ON hs.rank = snd.src JOIN host hd ON hd.rank = snd.dst),
        op AS (
            SELECT coll."group", g.kind, coll.step, coll.transfer_ns, coll.bytes, g.links
            FROM coll JOIN g USING ("group")
            UNION ALL
            SELECT p2p."group", g.kind, p2p.step, p2p.transfer_ns, p2p.bytes, p2p.links
            FROM p2p JOIN g USING ("group"))"""


def group_transfer(con: duckdb.DuckDBPyConnection, since_step: int | None = None,
                   clock: Clock = Clock.CPU) -> pl.DataFrame:
    """Per group per step: the median transfer time of its operations (see `_op_transfers_sql`)."""
    if not {Table.COLLECTIVES, Table.TOPOLOGY} <= _tables(con):
        return conform("group_transfer", None)
    return _group_transfer(con, _op_transfers_sql(since_step, _group_info(con), clock))


def _group_transfer(con: duckdb.DuckDBPyConnection, ops: str) -> pl.DataFrame:
    return conform("group_transfer", _frame(con, f"""
        WITH {ops}
        SELECT "group", kind, step, count(*) AS ops, sum(bytes) AS bytes, median(transfer_ns)::BIGINT AS transfer_ns
        FROM op GROUP BY ALL ORDER BY "group", step"""))


def links(con: duckdb.DuckDBPyConnection, since_step: int | None = None, clock: Clock = Clock.CPU) -> pl.DataFrame:
    """Per inter-host link per group kind per step: bytes moved and median transfer time of the operations that
    crossed it, and the effective bandwidth in Gbit/s."""
    if not {Table.COLLECTIVES, Table.TOPOLOGY} <= _tables(con):
        return conform("links", None)
    return _links(con, _op_transfers_sql(since_step, _group_info(con), clock))


def _links(con: duckdb.DuckDBPyConnection, ops: str) -> pl.DataFrame:
    return conform("links", _frame(con, f"""
        WITH {ops},
        l AS (SELECT kind, step, transfer_ns, bytes, unnest(links) AS link FROM op)
        SELECT link, kind, step, count(*) AS ops, sum(bytes) AS bytes, median(transfer_ns)::BIGINT AS transfer_ns,
               sum(bytes) * 8.0 / greatest(sum(transfer_ns), 1) AS gbps
        FROM l GROUP BY ALL ORDER BY link, kind, step"""))


_OPS = "_rankwatch_op_transfers"


def _links_and_group_transfer(con: duckdb.DuckDBPyConnection, since_step: int | None,
                              clock: Clock = Clock.CPU) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`links` and `group_transfer` from one computation of the operations they both aggregate."""
    if not {Table.COLLECTIVES, Table.TOPOLOGY} <= _tables(con):
        return conform("links", None), conform("group_transfer", None)
    con.execute(f"CREATE OR REPLACE TEMP TABLE {_OPS} AS WITH {_op_transfers_sql(since_step, _group_info(con), clock)} "
                "SELECT * FROM op")
    try:
        shared = f"op AS (SELECT * FROM {_OPS})"
        return _links(con, shared), _group_transfer(con, shared)
    finally:
        con.execute(f"DROP TABLE {_OPS}")


def host(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """Per rank per step (device clock): how much longer than its stage peers the rank's host thread took in the
    step's phases — the positive parts of (CPU phase duration - the stage's median of that phase) summed over the
    step's phases, less the stage's median of that sum (frames.FRAME_SCHEMAS['host']). Empty without phases."""
    if Table.PHASES not in _tables(con):
        return conform("host", None)
    stage = ("(SELECT rank, arg_max(pp, attempt) AS pp FROM topology GROUP BY rank)" if Table.TOPOLOGY in _tables(con)
             else "(SELECT DISTINCT rank, 0 AS pp FROM phases)")
    return conform("host", _frame(con, f"""
        WITH p AS (
            SELECT ph.rank, ph.step, ph.phase, ph.duration_ns, s.pp
            FROM phases ph JOIN {stage} s USING (rank) WHERE ph.step >= 0 {_since(since_step, 'ph.step')}),
        m AS (SELECT pp, step, phase, median(duration_ns) AS med FROM p GROUP BY ALL),
        r AS (
            SELECT p.rank, p.pp, p.step, sum(greatest(p.duration_ns - m.med, 0)) AS excess
            FROM p JOIN m USING (pp, step, phase) GROUP BY ALL),
        b AS (SELECT pp, step, median(excess) AS base FROM r GROUP BY ALL)
        SELECT r.rank, r.step, greatest(r.excess - b.base, 0)::BIGINT AS host_excess_ns
        FROM r JOIN b USING (pp, step) ORDER BY r.rank, r.step"""))


def gpu(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """Per rank per step: the means of its GPU samples, the OR of their throttle bits, and the largest value
    of each cumulative error counter (an increase from one step to the next is a new error)."""
    if Table.GPU not in _tables(con):
        return conform("gpu", None)
    return conform("gpu", _frame(con, f"""
        SELECT rank, any_value(device_uuid) AS device_uuid, step, count(*) AS samples,
               avg(sm_clock_mhz) AS sm_clock_mhz, avg(sm_clock_max_mhz) AS sm_clock_max_mhz,
               avg(power_w) AS power_w, avg(power_limit_w) AS power_limit_w, avg(temperature_c) AS temperature_c,
               avg(gpu_util_pct) AS gpu_util_pct, bit_or(throttle_reasons) AS throttle_reasons,
               max(ecc_sbe_volatile) AS ecc_sbe_volatile, max(ecc_dbe_volatile) AS ecc_dbe_volatile,
               max(pcie_replay) AS pcie_replay,
               max(coalesce(nvlink_crc_errors, 0) + coalesce(nvlink_replay_errors, 0)
                   + coalesce(nvlink_recovery_errors, 0)) AS nvlink_errors,
               flatten(list(xid_events)) AS xid_events,
               max(coalesce(retired_pages_sbe, 0) + coalesce(retired_pages_dbe, 0)) AS retired_pages,
               max(coalesce(remapped_rows_correctable, 0) + coalesce(remapped_rows_uncorrectable, 0)) AS remapped_rows
        FROM gpu WHERE step >= 0 {_since(since_step)}
        GROUP BY rank, step ORDER BY rank, step"""))


def checkpoints(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """Every checkpoint phase of every rank."""
    if Table.CHECKPOINT_PHASES not in _tables(con):
        return conform("checkpoints", None)
    return conform("checkpoints", _frame(con, f"""
        SELECT rank, step, checkpoint_id, phase, start_wall_ns, end_wall_ns, duration_ns, bytes, ok
        FROM checkpoint_phases WHERE true {_since(since_step)} ORDER BY rank, start_wall_ns"""))


def fingerprints(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """State fingerprints, the latest one of each (rank, step): a step replayed after a rollback or restart is
    fingerprinted again, and the replay supersedes the attempt it replaced (whose rows, compared with the replay's,
    would read as a divergence that no longer exists; what it held is in the recovery's evidence bundle)."""
    if Table.FINGERPRINTS not in _tables(con):
        return conform("fingerprints", None)
    return conform("fingerprints", _frame(con, f"""
        SELECT * EXCLUDE (rank), rank::INTEGER AS rank FROM fingerprints WHERE true {_since(since_step)}
        QUALIFY row_number() OVER (PARTITION BY rank, step ORDER BY wall_ns DESC) = 1
        ORDER BY step, rank"""))


def replays(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """Fingerprints of the (rank, step)s that more than one attempt fingerprinted: each attempt's latest row, for
    replay verification (`divergence.replay_mismatches`). Rows of parts without an attempt column cannot be told
    apart and are not replays."""
    if Table.FINGERPRINTS not in _tables(con):
        return conform("replays", None)
    return conform("replays", _frame(con, f"""
        SELECT * EXCLUDE (rank), rank::INTEGER AS rank FROM (
            SELECT * FROM fingerprints WHERE attempt IS NOT NULL {_since(since_step)}
            QUALIFY row_number() OVER (PARTITION BY rank, step, attempt ORDER BY wall_ns DESC) = 1)
        QUALIFY min(attempt) OVER (PARTITION BY rank, step) < max(attempt) OVER (PARTITION BY rank, step)
        ORDER BY step, rank, attempt"""))


def events(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Lifecycle events except heartbeats, in time order."""
    if Table.EVENTS not in _tables(con):
        return conform("events", None)
    return conform("events", _frame(con, f"""
        SELECT * EXCLUDE (rank), rank::INTEGER AS rank FROM events WHERE kind <> '{EventKind.HEARTBEAT}'
        ORDER BY wall_ns"""))


def liveness(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Per rank (its latest attempt): the last step it completed and when, its last heartbeat, the newest time
    anything was heard from it, and the first time anything was heard from it in that attempt (a relaunched rank
    beats before it writes its topology row)."""
    have = _tables(con)
    if Table.EVENTS not in have:
        return conform("liveness", None)
    step_cte = ("SELECT rank, max(step) AS last_step, max(end_wall_ns) AS last_step_end_wall_ns FROM steps GROUP BY rank"
                if Table.STEPS in have else
                "SELECT NULL::INTEGER AS rank, NULL::BIGINT AS last_step, NULL::BIGINT AS last_step_end_wall_ns")
    return conform("liveness", _frame(con, f"""
        WITH a AS (SELECT rank, max(attempt) AS attempt FROM events GROUP BY rank),
        e AS (SELECT e.rank, max(e.wall_ns) AS last_seen_wall_ns, min(e.wall_ns) AS first_seen_wall_ns,
                     max(e.wall_ns) FILTER (WHERE e.kind = '{EventKind.HEARTBEAT}') AS last_heartbeat_wall_ns,
                     arg_max(e.step, e.wall_ns) FILTER (WHERE e.kind = '{EventKind.HEARTBEAT}') AS heartbeat_step
              FROM events e JOIN a ON e.rank = a.rank AND e.attempt = a.attempt GROUP BY e.rank),
        s AS ({step_cte})
        SELECT a.rank, a.attempt, coalesce(s.last_step, -1) AS last_step, s.last_step_end_wall_ns,
               e.last_heartbeat_wall_ns, greatest(e.last_seen_wall_ns, s.last_step_end_wall_ns) AS last_seen_wall_ns,
               e.heartbeat_step, e.first_seen_wall_ns
        FROM a LEFT JOIN e USING (rank) LEFT JOIN s USING (rank) ORDER BY a.rank"""))


def open_collectives(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Collectives a rank entered and never left: in_flight snapshots no ok/error row of the same operation
    (rank, group, group_seq, enter time) superseded."""
    if Table.COLLECTIVES not in _tables(con):
        return conform("open_collectives", None)
    return conform("open_collectives", _frame(con, f"""
        WITH f AS (SELECT * FROM collectives WHERE status = '{CollectiveStatus.IN_FLIGHT}'),
        d AS (SELECT rank, "group", group_seq, enter_mono_ns FROM collectives
              WHERE status <> '{CollectiveStatus.IN_FLIGHT}')
        SELECT DISTINCT ON (rank, "group", group_seq, enter_mono_ns)
               rank::INTEGER AS rank, step, op, "group", group_ranks, group_seq, peer, enter_wall_ns
        FROM f ANTI JOIN d USING (rank, "group", group_seq, enter_mono_ns)
        ORDER BY rank, "group", group_seq, enter_mono_ns"""))


def collective_errors(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Collectives that ended in an error."""
    if Table.COLLECTIVES not in _tables(con):
        return conform("collective_errors", None)
    return conform("collective_errors", _frame(con, f"""
        SELECT rank::INTEGER AS rank, step, op, "group", group_ranks, group_seq, exit_wall_ns, error, enter_wall_ns
        FROM collectives WHERE status = '{CollectiveStatus.ERROR}' ORDER BY exit_wall_ns"""))


def end_wall_ns(con: duckdb.DuckDBPyConnection) -> int:
    """The newest wall-clock time anywhere in the run: 'now' for a post-mortem."""
    have = _tables(con)
    parts = [f"SELECT max(end_wall_ns) AS t FROM {Table.STEPS}"] if Table.STEPS in have else []
    if Table.EVENTS in have:
        parts.append(f"SELECT max(wall_ns) AS t FROM {Table.EVENTS}")
    if not parts:
        return 0
    return int(con.execute(f"SELECT max(t) FROM ({' UNION ALL '.join(parts)})").fetchall()[0][0] or 0)


def heartbeat_interval_ns(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> int:
    """The collector's heartbeat period, from the median gap between a rank's heartbeats (from `since_step` on:
    heartbeats carry the step in progress; all of them when the window holds no two of one rank); 1 s if unknown."""
    if Table.EVENTS not in _tables(con):
        return 1_000_000_000
    gap = None
    for since in dict.fromkeys((since_step, None)):
        gap = con.execute(f"""
            SELECT median(d) FROM (
                SELECT wall_ns - lag(wall_ns) OVER (PARTITION BY rank, attempt ORDER BY wall_ns) AS d
                FROM events WHERE kind = '{EventKind.HEARTBEAT}' {_since(since)}) WHERE d > 0""").fetchall()[0][0]
        if gap:
            break
    return int(gap) if gap else 1_000_000_000


def load_frames(run_dir: Path | str | None = None, *, con: duckdb.DuckDBPyConnection | None = None,
                since_step: int | None = None, clock: Clock = Clock.AUTO) -> Frames:
    """Everything the detectors read about a run (or its steps from `since_step` on), timing from `clock`
    (`run_clock`; AUTO = the device columns where every rank has them). Pass a run directory or an open
    connection."""
    if con is None:
        if run_dir is None:
            raise ValueError("load_frames: give a run directory or a connection")
        con = connect(run_dir)
    token = _KNOWN_TABLES.set((con, frozenset(_tables(con))))  # every query asks; the catalog stays as it is
    try:
        clock, _ = run_clock(con, clock, since_step)
        link_frame, transfer_frame = _links_and_group_transfer(con, since_step, clock)
        return Frames(
            topology=topology(con), groups=groups(con), steps=steps(con, since_step, clock),
            lateness=lateness(con, since_step, clock), links=link_frame,
            group_transfer=transfer_frame, gpu=gpu(con, since_step),
            checkpoints=checkpoints(con, since_step), fingerprints=fingerprints(con, since_step),
            events=events(con), liveness=liveness(con), open_collectives=open_collectives(con),
            collective_errors=collective_errors(con), end_wall_ns=end_wall_ns(con),
            heartbeat_interval_ns=heartbeat_interval_ns(con, since_step), replays=replays(con, since_step),
            host=host(con, since_step) if clock is Clock.DEVICE else conform("host", None), clock=clock,
        )
    finally:
        _KNOWN_TABLES.reset(token)


# -- the standard questions -------------------------------------------------------------------------------------


def arrival_order(con: duckdb.DuckDBPyConnection, since_step: int | None = None,
                  clock: Clock = Clock.AUTO) -> pl.DataFrame:
    """Per blocking collective operation and member: arrival order (0 = first) and lateness, clock-free. The
    member that waited longest arrived first; the one that waited least arrived last and is the one the others
    waited for. lateness_ns = longest wait in the operation - this member's wait. On the device clock (`run_clock`)
    from the operations' device time: a CUDA collective's CPU time is launch latency, and its order launch jitter."""
    if Table.COLLECTIVES not in _tables(con):
        return pl.DataFrame()
    clock, _ = run_clock(con, clock, since_step)
    inside, which = _inside(clock)
    return _frame(con, f"""
        SELECT step, "group", group_seq, op, rank::INTEGER AS rank, {inside} AS wait_ns,
               (rank() OVER w) - 1 AS arrival, max({inside}) OVER w - {inside} AS lateness_ns, '{clock}' AS clock
        FROM collectives
        WHERE status = '{CollectiveStatus.OK}' AND {which} AND op IN {_MEMBER_OPS} AND len(group_ranks) > 1
              {_since(since_step)}
        WINDOW w AS (PARTITION BY "group", group_seq, step ORDER BY {inside} DESC)
        ORDER BY step, "group", group_seq, arrival""")


def compute_decomposition(con: duckdb.DuckDBPyConnection, since_step: int | None = None,
                          clock: Clock = Clock.AUTO) -> pl.DataFrame:
    """Per rank: where its step time goes — median step, compute, collective wait, dataloader wait and checkpoint
    time (ms), and compute's share of the step. On the device clock (`run_clock`) step, compute and collective
    wait are the device's (`device_ns`, `device_compute_ns`, `device_collective_ns`); dataloader and checkpoint
    time are the host's on either clock."""
    if Table.STEPS not in _tables(con):
        return pl.DataFrame()
    clock, _ = run_clock(con, clock, since_step)
    step, comp, wait = (("device_ns", "device_compute_ns", "device_collective_ns") if clock is Clock.DEVICE
                        else ("duration_ns", "compute_ns", "collective_wait_ns"))
    return _frame(con, f"""
        SELECT rank::INTEGER AS rank, count(*) AS steps,
               median({step}) / 1e6 AS step_ms, median({comp}) / 1e6 AS compute_ms,
               median({wait}) / 1e6 AS collective_wait_ms,
               median(dataloader_wait_ns) / 1e6 AS dataloader_wait_ms, sum(checkpoint_ns) / 1e6 AS checkpoint_ms_total,
               sum({comp}) / greatest(sum({step}), 1) AS compute_share, '{clock}' AS clock
        FROM steps WHERE true {_since(since_step)} GROUP BY rank ORDER BY rank""")


def link_bandwidth(con: duckdb.DuckDBPyConnection, since_step: int | None = None,
                   clock: Clock = Clock.AUTO) -> pl.DataFrame:
    """Per inter-host link and group kind: effective bandwidth (Gbit/s) over the window, median per-step transfer
    time, and how it compares with the other links of the same group kind (1.0 = the median link). On the device
    clock (`run_clock`) from the operations' device time."""
    return link_table(links(con, since_step, run_clock(con, clock, since_step)[0]))


def link_table(df: pl.DataFrame) -> pl.DataFrame:
    """`link_bandwidth` of a loaded `links` frame (empty in, empty out)."""
    if df.height == 0:
        return df
    per = df.group_by("link", "kind").agg(
        pl.col("ops").sum(), pl.col("bytes").sum(), pl.col("transfer_ns").median().alias("median_transfer_ns"),
        (pl.col("bytes").sum() * 8.0 / pl.col("transfer_ns").sum().clip(1)).alias("gbps"))
    return per.with_columns(
        (pl.col("gbps") / pl.col("gbps").median().over("kind")).alias("vs_median_link")).sort("kind", "link")


def gpu_vs_peers(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """Per rank: its GPU's median SM clock, power and temperature against the median of all GPUs, the share of
    steps with a slowdown throttle bit set, and new ECC double-bit errors, PCIe replays and XIDs in the window."""
    return gpu_peer_table(gpu(con, since_step))


def gpu_peer_table(g: pl.DataFrame) -> pl.DataFrame:
    """`gpu_vs_peers` of a loaded `gpu` frame (empty in, empty out)."""
    if g.height == 0:
        return pl.DataFrame()
    from rankwatch.base.schema import SLOWDOWN_REASONS

    mask = 0
    for reason in SLOWDOWN_REASONS:
        mask |= int(reason)
    per = g.group_by("rank", "device_uuid").agg(
        pl.col("sm_clock_mhz").median(), pl.col("power_w").median(), pl.col("temperature_c").median(),
        ((pl.col("throttle_reasons").fill_null(0) & mask) != 0).mean().alias("throttled_share"),
        (pl.col("ecc_dbe_volatile").max() - pl.col("ecc_dbe_volatile").min()).alias("new_ecc_dbe"),
        (pl.col("pcie_replay").max() - pl.col("pcie_replay").min()).alias("new_pcie_replay"),
        pl.col("xid_events").explode().drop_nulls().len().alias("xid_count"))
    return per.with_columns(
        (pl.col("sm_clock_mhz") / pl.col("sm_clock_mhz").median()).alias("clock_vs_peers"),
        (pl.col("power_w") / pl.col("power_w").median()).alias("power_vs_peers"),
        (pl.col("temperature_c") - pl.col("temperature_c").median()).alias("temp_vs_peers_c")).sort("rank")


def checkpoint_overlap(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """Per checkpoint: its step, wall span over all ranks, the slowest phase, and how many of the run's slow
    steps (duration > 1.5 x the rank's median) overlap its span in time."""
    have = _tables(con)
    if not {Table.CHECKPOINT_PHASES, Table.STEPS} <= have:
        return pl.DataFrame()
    return _frame(con, f"""
        WITH ck AS (
            SELECT checkpoint_id, min(step) AS step, min(start_wall_ns) AS start_wall_ns, max(end_wall_ns) AS end_wall_ns,
                   arg_max(phase, duration_ns) AS slowest_phase, max(duration_ns) / 1e6 AS slowest_phase_ms,
                   bool_and(ok) AS ok
            FROM checkpoint_phases WHERE true {_since(since_step)} GROUP BY checkpoint_id),
        med AS (SELECT rank, median(duration_ns) AS m FROM steps GROUP BY rank),
        slow AS (SELECT s.rank, s.step, s.start_wall_ns, s.end_wall_ns FROM steps s JOIN med USING (rank)
                 WHERE s.duration_ns > 1.5 * med.m {_since(since_step, 's.step')})
        SELECT ck.checkpoint_id, ck.step, (ck.end_wall_ns - ck.start_wall_ns) / 1e6 AS span_ms, ck.slowest_phase,
               ck.slowest_phase_ms, ck.ok,
               count(slow.rank) AS overlapping_slow_steps, count(DISTINCT slow.rank) AS ranks_slowed
        FROM ck LEFT JOIN slow ON slow.start_wall_ns < ck.end_wall_ns AND slow.end_wall_ns > ck.start_wall_ns
        GROUP BY ALL ORDER BY ck.step""")


def fingerprint_agreement(con: duckdb.DuckDBPyConnection, since_step: int | None = None) -> pl.DataFrame:
    """Per consistency domain per fingerprinted step: how many members reported, and how many distinct values
    each field takes (1 = the members agree)."""
    if Table.FINGERPRINTS not in _tables(con):
        return pl.DataFrame()
    return _frame(con, f"""
        SELECT domain, step, count(*) AS members, count(DISTINCT param_hash) AS param_values,
               count(DISTINCT optim_hash) AS optim_values,
               count(DISTINCT (rng_python_hash, rng_numpy_hash, rng_torch_hash, coalesce(rng_cuda_hash, ''))) AS rng_values,
               count(DISTINCT data_position) AS data_position_values,
               (count(DISTINCT param_hash) = 1 AND count(DISTINCT optim_hash) = 1
                AND count(DISTINCT (rng_python_hash, rng_numpy_hash, rng_torch_hash, coalesce(rng_cuda_hash, ''))) = 1
                AND count(DISTINCT data_position) <= 1) AS agree
        FROM fingerprints WHERE true {_since(since_step)} GROUP BY domain, step ORDER BY domain, step""")
