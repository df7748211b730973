"""Progress read live while the run is being written: per rank, the last completed step, the last heartbeat and the
step rate, from the increment of telemetry written since the stored views, merged over them."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from rankwatch.analytics.views.store import ViewStore

_R, _S = "rank", "step"


LIVE_SKEW_NS = 30 * 10**9
"""How far a host's record clock may run ahead of the telemetry folder's file times (`live_progress`)."""


def live_progress(run_dir: Path | str, *, since: ViewStore | None = None) -> pl.DataFrame:
    """Per rank, read from the telemetry now (the run may be being written): attempt, last completed step and when,
    last heartbeat, last sign of life and step rate over its last 50 steps. With `since` (the run's stored views),
    only the parts written after the newest record those views hold are read (less `LIVE_SKEW_NS` for clock skew)
    and merged over the stored progress: a 2,048-rank run's refresh reads the increment, not the whole run."""
    from rankwatch.analytics import queries
    from rankwatch.analytics.errors import RunDirError
    from rankwatch.analytics.store import open_run
    from rankwatch.base.schema import Table

    cols = (_R, "attempt", "last_step", "last_step_end_wall_ns", "last_heartbeat_wall_ns", "last_seen_wall_ns",
            "steps_per_s")
    cutoff = None if since is None else since.summary.end_wall_ns - LIVE_SKEW_NS
    try:
        store = open_run(run_dir, tables=(Table.STEPS, Table.EVENTS), modified_since_ns=cutoff)
    except RunDirError:
        if since is None:
            raise
        return since.frame("progress").select(cols).sort(_R)  # nothing written since the views
    try:
        live = queries.liveness(store.con)
        if Table.STEPS in store.tables:
            rate = pl.from_arrow(store.con.sql("""
                SELECT rank::INTEGER AS rank, count(*) AS _n,
                       count(*) * 1e9 / greatest(max(end_wall_ns) - min(start_wall_ns), 1) AS steps_per_s
                FROM (SELECT * FROM steps QUALIFY row_number() OVER (PARTITION BY rank ORDER BY step DESC) <= 50)
                GROUP BY rank""").to_arrow_table())
            assert isinstance(rate, pl.DataFrame)
            live = live.join(rate, on=_R, how="left")
        else:
            live = live.with_columns(pl.lit(0, pl.Int64).alias("_n"), pl.lit(None, pl.Float64).alias("steps_per_s"))
    finally:
        store.con.close()
    if since is None:
        return live.select(cols).sort(_R)
    return _merge_live(since.frame("progress").select(cols), live)


def _merge_live(stored: pl.DataFrame, new: pl.DataFrame) -> pl.DataFrame:
    """The stored progress with each rank's newer rows over it: a newer attempt replaces the rank's row; within one
    attempt the later step, heartbeat and sign of life win, and a rate from fewer than 2 new steps keeps the stored."""
    new = new.rename({c: f"{c}_n" for c in new.columns if c != _R})
    m = stored.join(new, on=_R, how="full", coalesce=True)
    newer = pl.col("attempt_n").is_not_null() & (pl.col("attempt").is_null() | (pl.col("attempt_n") > pl.col("attempt")))
    same = pl.col("attempt_n").is_not_null() & (pl.col("attempt_n") == pl.col("attempt"))
    later_step = same & (pl.col("last_step_n").fill_null(-1) > pl.col("last_step").fill_null(-1))

    def pick(col: str, when_same: pl.Expr) -> pl.Expr:
        return (pl.when(newer).then(pl.col(f"{col}_n")).when(when_same).then(pl.col(f"{col}_n"))
                .otherwise(pl.col(col)).alias(col))

    return m.select(
        _R, pick("attempt", pl.lit(False)), pick("last_step", later_step), pick("last_step_end_wall_ns", later_step),
        pl.when(newer).then(pl.col("last_heartbeat_wall_ns_n"))
        .otherwise(pl.max_horizontal("last_heartbeat_wall_ns", "last_heartbeat_wall_ns_n")).alias("last_heartbeat_wall_ns"),
        pl.when(newer).then(pl.col("last_seen_wall_ns_n"))
        .otherwise(pl.max_horizontal("last_seen_wall_ns", "last_seen_wall_ns_n")).alias("last_seen_wall_ns"),
        pick("steps_per_s", same & (pl.col("_n_n").fill_null(0) >= 2)),
    ).sort(_R)


def heartbeat_age(progress: pl.DataFrame, now_ns: int) -> pl.DataFrame:
    """`progress` with heartbeat_age_s and step_age_s: seconds since the rank's last heartbeat and last step."""
    return progress.with_columns(
        ((now_ns - pl.col("last_heartbeat_wall_ns")) / 1e9).alias("heartbeat_age_s"),
        ((now_ns - pl.col("last_step_end_wall_ns")) / 1e9).alias("step_age_s"))
