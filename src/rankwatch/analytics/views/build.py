"""Building the views: the frames the dashboard and the post-mortem notebook draw, from the frames an analysis
already loaded — per-rank progress, the rank x step matrix, the straggler leaderboard, collective progress per group
and rank, the time breakdown, GPUs against their peers, link bandwidth, checkpoints, fingerprint agreement,
lifecycle events, topology (`build_views`). No detector runs here: every figure is one analytics already computes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import duckdb
import polars as pl

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Incident, IncidentClass
from rankwatch.analytics.queries import gpu_peer_table, link_table
from rankwatch.analytics.views.store import RunViews, ViewSummary, telemetry_signature

FRAME_NAMES = ("progress", "rank_steps", "leaderboard", "collectives", "breakdown", "gpu_peers", "links",
               "checkpoints", "fingerprints", "events", "topology", "groups")

_R, _S = "rank", "step"



# ------------------------------------------------------------------------------------------------ building them


def _ms(col: str) -> pl.Expr:
    return (pl.col(col).cast(pl.Float64) / 1e6)


def rank_steps(frames: Frames) -> pl.DataFrame:
    """One row per rank per completed step: step, compute, collective wait, dataloader and checkpoint time (ms),
    lateness in the step's blocking collectives (ms) and how many of them it arrived last to."""
    s = frames.steps.select(
        _R, _S, "attempt", "end_wall_ns", _ms("duration_ns").alias("step_ms"), _ms("compute_ns").alias("compute_ms"),
        _ms("collective_wait_ns").alias("wait_ms"), _ms("dataloader_wait_ns").alias("dataloader_ms"),
        _ms("checkpoint_ns").alias("checkpoint_ms"))
    late = frames.lateness.select(_R, _S, _ms("late_ns").alias("late_ms"), "last_arrivals")
    return s.join(late, on=[_R, _S], how="left").sort(_R, _S)


def progress_frame(frames: Frames) -> pl.DataFrame:
    """Per rank: host, device, coordinates, attempt, last completed step and when, last heartbeat, and its step rate
    over its last 50 steps."""
    topo = frames.topology.select(_R, "host", "device_uuid", "dp", "tp", "pp", "local_rank")
    live = frames.liveness.select(_R, "attempt", "last_step", "last_step_end_wall_ns", "last_heartbeat_wall_ns",
                                  "last_seen_wall_ns")
    rate = (frames.steps.sort(_R, _S).group_by(_R).tail(50).group_by(_R).agg(
        pl.len().alias("n"), pl.col("start_wall_ns").min().alias("t0"), pl.col("end_wall_ns").max().alias("t1"))
        .select(_R, ((pl.col("n") * 1e9) / (pl.col("t1") - pl.col("t0")).clip(1)).alias("steps_per_s")))
    base = topo if topo.height else live.select(_R)
    out = base.join(live, on=_R, how="full", coalesce=True).join(rate, on=_R, how="left")
    return out.sort(_R)


def leaderboard(frames: Frames, incidents: Sequence[Incident] = ()) -> pl.DataFrame:
    """Per rank, slowest first: its median compute relative to its pipeline stage's median (1.0 = typical), how many
    blocking collectives it arrived last to, its total lateness, persistence (the share of steps its compute was
    over 1.1 x its stage's median that step), and the straggler incidents naming it."""
    s = frames.steps
    if s.height == 0:
        return pl.DataFrame(schema={_R: pl.Int32, "role": pl.String, "score": pl.Float64, "compute_ms": pl.Float64,
                                    "arrived_last": pl.Int64, "late_ms_total": pl.Float64, "persistence": pl.Float64,
                                    "incidents": pl.String})
    roles = frames.topology.select(_R, "role") if frames.topology.height else s.select(_R).unique().with_columns(
        pl.lit("all").alias("role"))
    x = s.select(_R, _S, pl.coalesce("compute_ns", "duration_ns").cast(pl.Float64).alias("c")).join(roles, on=_R,
                                                                                                      how="left")
    x = x.with_columns(pl.col("role").fill_null("all"))
    x = x.with_columns(pl.col("c").median().over("role", _S).alias("peer"))
    per = x.group_by(_R, "role").agg(
        (pl.col("c").median() / 1e6).alias("compute_ms"),
        (pl.col("c") > 1.1 * pl.col("peer")).mean().alias("persistence"))
    per = per.with_columns((pl.col("compute_ms") / pl.col("compute_ms").median().over("role")).alias("score"))
    late = frames.lateness.group_by(_R).agg(pl.col("last_arrivals").sum().cast(pl.Int64).alias("arrived_last"),
                                            (pl.col("late_ns").sum() / 1e6).alias("late_ms_total"))
    named: dict[int, list[str]] = {}
    for inc in incidents:
        if inc.klass in (IncidentClass.STRAGGLER, IncidentClass.IMBALANCE):
            for r in inc.ranks:
                named.setdefault(r, []).append(f"{inc.klass} {inc.subject}")
    tags = pl.DataFrame({_R: list(named), "incidents": ["; ".join(v) for v in named.values()]},
                        schema={_R: pl.Int32, "incidents": pl.String})
    out = per.join(late, on=_R, how="left").join(tags, on=_R, how="left").with_columns(
        pl.col("arrived_last").fill_null(0), pl.col("late_ms_total").fill_null(0.0))
    return out.select(_R, "role", "score", "compute_ms", "arrived_last", "late_ms_total", "persistence",
                      "incidents").sort(["score", "late_ms_total"], descending=True)


def collective_progress(con: duckdb.DuckDBPyConnection | None, frames: Frames) -> pl.DataFrame:
    """Per process group and member: the last operation it issued (entered) and the last it completed, the newest
    any member issued, and how many operations it is behind (0 = up to date). `waiting`: the member issued its
    newest operation and never completed it (it waits there, or its wait ended in an error). A member can be behind
    in one group because it waits in another (a tensor-parallel peer of a hung rank never reaches the data-parallel
    all-reduce); `missing` marks a member that is behind and waits in none of its groups: the one the others wait
    for."""
    schema = {"group": pl.String, "kind": pl.String, _R: pl.Int32, "last_issued": pl.Int64,
              "last_completed": pl.Int64, "last_op": pl.String, "last_step": pl.Int64, "in_flight": pl.Boolean,
              "group_issued": pl.Int64, "behind": pl.Int64, "waiting": pl.Boolean, "missing": pl.Boolean}
    if con is None:
        return pl.DataFrame(schema=schema)
    have = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal UNION "
                                      "SELECT table_name FROM duckdb_tables()").fetchall()}
    if "collectives" not in have:
        return pl.DataFrame(schema=schema)
    df = pl.from_arrow(con.sql("""
        SELECT "group", rank::INTEGER AS rank, max(group_seq) AS last_issued,
               max(group_seq) FILTER (WHERE status = 'ok') AS last_completed,
               arg_max(op, group_seq) AS last_op, max(step) AS last_step
        FROM collectives WHERE len(group_ranks) > 1 GROUP BY ALL""").to_arrow_table())
    assert isinstance(df, pl.DataFrame)
    open_ = frames.open_collectives.select("group", _R, pl.lit(True).alias("in_flight")).unique()
    kinds = frames.groups.select("group", "kind")
    out = (df.join(open_, on=["group", _R], how="left").join(kinds, on="group", how="left")
           .with_columns(pl.col("in_flight").fill_null(False),
                         pl.col("last_issued").max().over("group").alias("group_issued")))
    out = out.with_columns((pl.col("group_issued") - pl.col("last_issued")).alias("behind"),
                           (pl.col("last_completed").fill_null(-1) < pl.col("last_issued")).alias("waiting"))
    out = out.with_columns(((pl.col("behind") > 0) & ~pl.col("waiting").any().over(_R)).alias("missing"))
    return out.select([pl.col(c).cast(t) for c, t in schema.items()]).sort("group", _R)


def breakdown(frames: Frames) -> pl.DataFrame:
    """Per rank, medians per step (ms): compute, collective wait, dataloader wait, and checkpoint time per step
    (the run's checkpoint time spread over its steps), on the run's clock."""
    s = frames.steps
    return s.group_by(_R).agg(
        pl.len().alias("steps"), (pl.col("duration_ns").median() / 1e6).alias("step_ms"),
        (pl.col("compute_ns").median() / 1e6).alias("compute_ms"),
        (pl.col("collective_wait_ns").median() / 1e6).alias("collective_wait_ms"),
        (pl.col("dataloader_wait_ns").median() / 1e6).alias("dataloader_ms"),
        (pl.col("checkpoint_ns").sum() / pl.len() / 1e6).alias("checkpoint_ms")).sort(_R)


def gpu_peers(frames: Frames) -> pl.DataFrame:
    """Per rank: its GPU's medians against all GPUs' (`queries.gpu_vs_peers`, from the loaded frame)."""
    out = gpu_peer_table(frames.gpu)
    if out.height == 0:
        return pl.DataFrame(schema={_R: pl.Int32, "device_uuid": pl.String, "sm_clock_mhz": pl.Float64,
                                    "power_w": pl.Float64, "temperature_c": pl.Float64, "throttled_share": pl.Float64,
                                    "new_ecc_dbe": pl.Int64, "new_pcie_replay": pl.Int64, "xid_count": pl.UInt32,
                                    "clock_vs_peers": pl.Float64, "power_vs_peers": pl.Float64,
                                    "temp_vs_peers_c": pl.Float64})
    return out


def link_summary(frames: Frames) -> pl.DataFrame:
    """Per inter-host link and group kind: bandwidth (Gbit/s) and against the median link of its kind
    (`queries.link_bandwidth`, from the loaded frame)."""
    out = link_table(frames.links)
    if out.height == 0:
        return pl.DataFrame(schema={"link": pl.String, "kind": pl.String, "ops": pl.Int64, "bytes": pl.Int64,
                                    "median_transfer_ns": pl.Float64, "gbps": pl.Float64,
                                    "vs_median_link": pl.Float64})
    return out


def checkpoint_summary(frames: Frames) -> pl.DataFrame:
    """Per checkpoint and phase: step, ranks, wall span, slowest rank's duration (ms), bytes, and whether every
    rank's phase ended ok. A load phase is a checkpoint read back by a resume."""
    c = frames.checkpoints
    return c.group_by("checkpoint_id", "phase").agg(
        pl.col(_S).min(), pl.col(_R).n_unique().alias("ranks"), pl.col("start_wall_ns").min(),
        pl.col("end_wall_ns").max(), (pl.col("duration_ns").max() / 1e6).alias("slowest_ms"),
        pl.col("bytes").sum(), pl.col("ok").all()).sort("start_wall_ns")


def fingerprint_summary(frames: Frames) -> pl.DataFrame:
    """Per consistency domain per fingerprinted step: members reporting, distinct values of each field, and whether
    they agree; `disagreeing` names the ranks holding a minority value of a field that disagrees."""
    f = frames.fingerprints
    if f.height == 0:
        return pl.DataFrame(schema={"domain": pl.String, _S: pl.Int64, "members": pl.UInt32, "agree": pl.Boolean,
                                    "fields": pl.String, "disagreeing": pl.String})
    f = f.sort("wall_ns").unique([_R, _S, "domain"], keep="last")
    f = f.with_columns(pl.concat_str([pl.col(c).fill_null("") for c in
                                      ("rng_python_hash", "rng_numpy_hash", "rng_torch_hash", "rng_cuda_hash")],
                                     separator="|").alias("rng"))
    rows = []
    for (dom, step), g in f.group_by("domain", _S):
        bad, minority = [], set()
        for col, name in (("param_hash", "params"), ("optim_hash", "optimizer"), ("rng", "rng"),
                          ("data_position", "data_position")):
            counts = g.group_by(col).len()
            if counts.height > 1:
                bad.append(name)
                top = counts.sort("len", descending=True).row(0)[0]
                minority |= set(g.filter(pl.col(col) != top)[_R].to_list())
        rows.append({"domain": dom, _S: step, "members": g.height, "agree": not bad, "fields": ",".join(bad),
                     "disagreeing": ",".join(str(r) for r in sorted(minority))})
    return pl.DataFrame(rows, schema={"domain": pl.String, _S: pl.Int64, "members": pl.UInt32, "agree": pl.Boolean,
                                      "fields": pl.String, "disagreeing": pl.String}).sort("domain", _S)


def _ended(frames: Frames) -> bool:
    """Every rank's latest attempt (liveness) recorded its exit."""
    live, ev = frames.liveness, frames.events
    if live.height == 0 or ev.height == 0:
        return False
    exits = ev.filter(pl.col("kind") == "exit").select(_R, "attempt").unique()
    return live.select(_R, "attempt").join(exits, on=[_R, "attempt"], how="anti").height == 0


def run_span(frames: Frames) -> tuple[int, int, float, float]:
    """(start ns, end ns, wall s, effective s) of the whole run, every attempt of it: the wall from the first launch's
    first sign of life (any attempt's start event, topology row or step) to the newest record; effective = per step of
    the final trajectory (each step once, its newest attempt: `queries.steps`) the slowest rank's duration. Time lost
    to kills, restarts, restores and replays is in the wall and not in effective, so effective <= wall."""
    firsts = [int(v) for v in (  # type: ignore[arg-type]
        frames.topology["start_wall_ns"].min() if frames.topology.height else None,
        frames.steps["start_wall_ns"].min() if frames.steps.height else None,
        frames.events["wall_ns"].min() if frames.events.height else None,
    ) if v is not None]
    start = min(firsts) if firsts else 0
    end = max(int(frames.end_wall_ns or 0), start)
    s = frames.steps
    effective = float(s.group_by(_S).agg(pl.col("duration_ns").max())["duration_ns"].sum()) / 1e9 if s.height else 0.0
    return start, end, (end - start) / 1e9, effective


def build_views(frames: Frames, incidents: Sequence[Incident], *, run_dir: Path | str,
                warnings: Sequence[str] = (), since_step: int | None = None,
                con: duckdb.DuckDBPyConnection | None = None) -> RunViews:
    """Every view of one analysis from the frames it loaded (and, for collective progress, its connection)."""
    s = frames.steps
    topo = frames.topology
    start, end, wall, effective = run_span(frames)
    per_step = s.group_by(_S).agg(pl.col("duration_ns").max()) if s.height else None
    layout = ({k: int(topo[f"{k}_size"].max()) for k in ("dp", "tp", "pp")}  # type: ignore[arg-type]
              if topo.height else {})
    summary = ViewSummary(
        run_dir=str(run_dir), ranks=frames.world_size, first_step=frames.first_step, last_step=frames.last_step,
        clock=str(frames.clock), start_wall_ns=start, end_wall_ns=end, wall_s=wall, effective_s=effective,
        steps_per_s=(per_step.height / wall) if per_step is not None and wall > 0 else 0.0,
        incidents=len(incidents), warnings=tuple(warnings), since_step=since_step, layout=layout,
        hosts=int(topo["host"].n_unique()) if topo.height else 0, signature=telemetry_signature(run_dir),
        built_wall_ns=time.time_ns(), ended=_ended(frames))
    out = {
        "progress": progress_frame(frames), "rank_steps": rank_steps(frames),
        "leaderboard": leaderboard(frames, incidents), "collectives": collective_progress(con, frames),
        "breakdown": breakdown(frames), "gpu_peers": gpu_peers(frames), "links": link_summary(frames),
        "checkpoints": checkpoint_summary(frames), "fingerprints": fingerprint_summary(frames),
        "events": frames.events, "topology": topo, "groups": frames.groups,
    }
    return RunViews(summary=summary, incidents=tuple(incidents), frames=out)


# ---------------------------------------------------------------------------- what is not in the telemetry


# ------------------------------------------------------------------------------------------------ arranged


