"""What people look at: the frames the dashboard and the post-mortem notebook draw, computed by analytics.

An analysis (`analyze(..., config=AnalysisConfig(views=True))`, what `rankwatch analyze` runs) builds the run's
views from the frames it already loaded — per-rank progress, the rank x step matrix, the straggler leaderboard,
collective progress per group and rank, the time breakdown, GPUs against their peers, link bandwidth, checkpoints,
fingerprint agreement, lifecycle events, topology — and `write_views` stores them as small parquet files under
`<run>/analysis/views/` with a manifest naming the telemetry they were computed from. A reader (`ViewStore`) opens
them in milliseconds where opening the telemetry of a 2,048-rank run takes tens of seconds; `ViewStore.stale` tells
when the telemetry grew since.

What is not in the telemetry is read from the run's own files: the recovery manager's decisions
(`<run>/recovery/recovery-*.json`, and the dry-run plan `<run>/recovery/dry-run.json`), the lineage
(`<run>/lineage.jsonl`) and the quarantine list (`<run>/quarantine.json`). `incident_detail`, `timeline`,
`topology_status`, `heatmap` and `across_runs` join them. No detector runs here: every figure is one analytics
already computes, arranged for a reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Incident, IncidentClass, SubjectKind, read_incidents, write_incidents
from rankwatch.analytics.localize import Localization, RunObservation, localize
from rankwatch.analytics.queries import gpu_peer_table, link_table
from rankwatch.collector.schema import TELEMETRY_DIR, CheckpointPhase, EventKind

VIEWS_DIR = "views"
"""Under `<run>/analysis/`."""
VIEWS_VERSION = 1
MANIFEST = "manifest.json"
DRY_RUN_FILE = "dry-run.json"
"""`<run>/recovery/dry-run.json`: a recovery plan decided but not carried out (the same record shape as
`recovery-*.json`)."""
FRAME_NAMES = ("progress", "rank_steps", "leaderboard", "collectives", "breakdown", "gpu_peers", "links",
               "checkpoints", "fingerprints", "events", "topology", "groups")

_R, _S = "rank", "step"


# ------------------------------------------------------------------------------------------------- the summary


@dataclass(frozen=True, kw_only=True, slots=True)
class ViewSummary:
    """The run at a glance, from the analysis the views were built by."""

    run_dir: str
    ranks: int
    first_step: int
    last_step: int
    clock: str
    start_wall_ns: int
    end_wall_ns: int
    wall_s: float
    """From the first rank's start to the newest record."""
    effective_s: float
    """Training time the final trajectory kept: per step the slowest rank's duration, each step once (replayed and
    lost steps, restarts, stalls outside steps are not counted)."""
    steps_per_s: float
    """Steps of the final trajectory per wall second over the run."""
    incidents: int
    warnings: tuple[str, ...]
    since_step: int | None
    """The window the analysis read (None = the whole run)."""
    layout: dict[str, int]
    hosts: int
    signature: tuple[int, int, int]
    """`telemetry_signature` of the telemetry the views were computed from."""
    built_wall_ns: int
    ended: bool = False
    """Every rank recorded its exit (an `exit` event) in its latest attempt: no rank was running when the views
    were built (False for views stored before the field)."""

    @property
    def goodput(self) -> float:
        return self.effective_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in
                ((f, getattr(self, f)) for f in self.__slots__)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViewSummary:
        d = dict(d)
        d["warnings"] = tuple(d.get("warnings", ()))
        d["signature"] = tuple(d["signature"])
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunViews:
    """Every view of one analysis, in memory (what `write_views` stores)."""

    summary: ViewSummary
    incidents: tuple[Incident, ...]
    frames: dict[str, pl.DataFrame] = field(default_factory=dict)


def telemetry_signature(run_dir: Path | str) -> tuple[int, int, int]:
    """(folders, checksum of their modification times, newest of them, ns) under the run's telemetry: changes
    whenever a rank or a rollup publishes a part (parts are immutable files renamed into their folder, which changes
    the folder's time). Only folders are looked at: a 2,048-rank run has ~16,000 part files but a folder per rank and
    table, read in well under a second."""
    folders = total = newest = 0
    stack = [Path(run_dir) / TELEMETRY_DIR]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
            mtime = os.stat(d).st_mtime_ns
        except OSError:
            continue
        folders += 1
        total = (total + mtime) % (1 << 62)
        newest = max(newest, mtime)
        with it:
            stack.extend(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
    return folders, total, newest


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


def build_views(frames: Frames, incidents: Sequence[Incident], *, run_dir: Path | str,
                warnings: Sequence[str] = (), since_step: int | None = None,
                con: duckdb.DuckDBPyConnection | None = None) -> RunViews:
    """Every view of one analysis from the frames it loaded (and, for collective progress, its connection)."""
    s = frames.steps
    topo = frames.topology
    starts = topo["start_wall_ns"] if topo.height else s["start_wall_ns"]
    start = int(starts.min()) if starts.len() else 0  # type: ignore[arg-type]
    end = int(frames.end_wall_ns or 0)
    per_step = s.group_by(_S).agg(pl.col("duration_ns").max()) if s.height else None
    effective = float(per_step["duration_ns"].sum()) / 1e9 if per_step is not None else 0.0
    wall = max(0.0, (end - start) / 1e9)
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


def views_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "analysis" / VIEWS_DIR


def _fallback_dir(run_dir: Path | str) -> Path:
    """Where views of a run whose folder cannot be written go (a read-only copy): the user's cache."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rankwatch" / "views" / key


def write_views(views: RunViews, out: Path | None = None) -> Path:
    """Store the views (parquet per frame, the incidents, the manifest last: a reader sees a complete set or the
    previous one). Into `<run>/analysis/views/`, or the user's cache when the run's folder cannot be written.
    Returns the folder."""
    targets = [out] if out is not None else [views_dir(views.summary.run_dir), _fallback_dir(views.summary.run_dir)]
    last: OSError | None = None
    for d in targets:
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / MANIFEST).unlink(missing_ok=True)
            for name, df in views.frames.items():
                tmp = d / f"{name}.parquet.tmp"
                df.write_parquet(tmp, row_group_size=65_536)
                tmp.replace(d / f"{name}.parquet")
            write_incidents(views.incidents, d)
            tmp = d / f"{MANIFEST}.tmp"
            tmp.write_text(json.dumps({"version": VIEWS_VERSION, "summary": views.summary.to_dict(),
                                       "frames": sorted(views.frames)}, indent=1))
            tmp.replace(d / MANIFEST)
            return d
        except OSError as exc:
            last = exc
    raise RunDirError(f"{targets[0]}: cannot store the run's views ({last})")


class ViewStore:
    """Stored views of one run, each frame read when first asked for. `run_dir` is the run folder they were opened
    for (a run copied or moved elsewhere keeps views that name the folder they were built in)."""

    def __init__(self, folder: Path, run_dir: Path | str | None = None):
        self.folder = folder
        path = folder / MANIFEST
        try:
            doc = json.loads(path.read_text())
            if doc.get("version") != VIEWS_VERSION:
                raise ValueError(f"views version {doc.get('version')!r}, this rankwatch reads {VIEWS_VERSION}")
            self.summary = ViewSummary.from_dict(doc["summary"])
            self.names = tuple(doc["frames"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RunDirError(f"{path}: unreadable views manifest ({type(exc).__name__}: {exc})") from None
        self._frames: dict[str, pl.DataFrame] = {}
        self._incidents: tuple[Incident, ...] | None = None
        self._run_dir = Path(run_dir if run_dir is not None else self.summary.run_dir)

    @property
    def run_dir(self) -> Path:
        return self._run_dir

    def frame(self, name: str) -> pl.DataFrame:
        if name not in self.names:
            raise KeyError(f"view {name!r}: not stored; stored: {', '.join(self.names)}")
        if name not in self._frames:
            path = self.folder / f"{name}.parquet"
            try:
                self._frames[name] = pl.read_parquet(path)
            except (OSError, pl.exceptions.PolarsError) as exc:
                raise RunDirError(f"{path}: unreadable view ({type(exc).__name__}: {exc})") from None
        return self._frames[name]

    def rank(self, rank: int) -> pl.DataFrame:
        """One rank's rows of the rank x step matrix, read with the filter pushed into the file."""
        path = self.folder / "rank_steps.parquet"
        try:
            return pl.scan_parquet(path).filter(pl.col(_R) == rank).collect()
        except (OSError, pl.exceptions.PolarsError) as exc:
            raise RunDirError(f"{path}: unreadable view ({type(exc).__name__}: {exc})") from None

    @property
    def incidents(self) -> tuple[Incident, ...]:
        if self._incidents is None:
            try:
                self._incidents = read_incidents(self.folder / "incidents.json")
            except ValueError as exc:
                raise RunDirError(str(exc)) from None
        return self._incidents

    def stale(self) -> bool:
        """The telemetry changed since the views were built (a run still being written)."""
        return telemetry_signature(self.run_dir) != self.summary.signature


def stored_views(run_dir: Path | str) -> ViewStore | None:
    """The run's stored views (in the run, else in the user's cache), or None when none were stored."""
    for d in (views_dir(run_dir), _fallback_dir(run_dir)):
        if (d / MANIFEST).exists():
            return ViewStore(d, run_dir)
    return None


def ensure_views(run_dir: Path | str, *, refresh: bool = False,
                 progress: Any = None) -> ViewStore:
    """The run's views: the stored ones when they match the telemetry (or, `refresh` False, whatever is stored),
    else an analysis of the run builds and stores them. Raises `AnalyticsError` (one line) for a run that cannot
    be analysed: a missing folder, no telemetry, damaged rows."""
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"{run}: no such run directory")
    have = stored_views(run)
    if have is not None and not (refresh and have.stale()):
        return have
    from rankwatch.analytics.analyze import AnalysisConfig, analyze

    kwargs = {} if progress is None else {"progress": progress}
    analysis = analyze(run, config=AnalysisConfig(views=True), **kwargs)
    assert analysis.views is not None
    return ViewStore(write_views(analysis.views), run)


# ---------------------------------------------------------------------------- what is not in the telemetry


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


_DECISION_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {"record": pl.String, "status": pl.String, "wall_ns": pl.Int64, "incident": pl.String,
                    "class": pl.String, "subject": pl.String, "action": pl.String, "target": pl.String,
                    "path": pl.List(pl.String), "reasons": pl.List(pl.String), "comparability": pl.String,
                    "changed": pl.List(pl.String), "outcome": pl.String, "plan_action": pl.String,
                    "checkpoint": pl.String}


def decisions(run_dir: Path | str) -> pl.DataFrame:
    """Every decision the recovery manager recorded for the run, oldest first: per incident its action and target,
    its path through the recovery gates and the reasons, the lineage verdict, and the record's outcome. Status is
    `applied` for a recovery carried out (`recovery-*.json`) and `proposed` for a dry-run plan (`dry-run.json`)."""
    folder = Path(run_dir) / "recovery"
    files = sorted(folder.glob("recovery-*.json"))
    if (folder / DRY_RUN_FILE).exists():
        files.append(folder / DRY_RUN_FILE)
    rows = []
    for path in files:
        doc = _json(path)
        try:
            status = "proposed" if path.name == DRY_RUN_FILE else "applied"
            for d in doc["decisions"]:
                rows.append({
                    "record": str(doc.get("id") or path.stem), "status": status, "wall_ns": doc.get("wall_ns"),
                    "incident": d["incident"], "class": d["class"], "subject": d["subject"], "action": d["action"],
                    "target": d.get("target"), "path": [str(p) for p in d.get("path", [])],
                    "reasons": [str(r) for r in d.get("reasons", [])],
                    "comparability": (d.get("lineage") or {}).get("comparability"),
                    "changed": [str(c) for c in (d.get("lineage") or {}).get("changed", [])],
                    "outcome": doc.get("outcome") or status, "plan_action": doc.get("action"),
                    "checkpoint": doc.get("checkpoint")})
        except (KeyError, TypeError, AttributeError) as exc:
            raise RunDirError(f"{path}: not a recovery record ({type(exc).__name__}: {exc})") from None
    return pl.DataFrame(rows, schema=_DECISION_SCHEMA).sort("wall_ns", nulls_last=True)


def recorded_incidents(run_dir: Path | str) -> tuple[Incident, ...]:
    """Incidents the recovery records carry (the live loop's, which the run's own analysis may not hold)."""
    out: dict[str, Incident] = {}
    folder = Path(run_dir) / "recovery"
    for path in sorted(folder.glob("recovery-*.json")):
        for d in _json(path).get("decisions", []):
            doc = d.get("incident_doc")
            if doc:
                try:
                    inc = Incident.from_dict(doc)
                except ValueError as exc:
                    raise RunDirError(f"{path}: {exc}") from None
                out.setdefault(inc.id, inc)
    return tuple(out.values())


_LINEAGE_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {"seq": pl.Int64, "time_ns": pl.Int64, "kind": pl.String, "comparability": pl.String,
                   "reasons": pl.List(pl.String), "note": pl.String, "attempt": pl.Int64, "details": pl.String}


def lineage(run_dir: Path | str) -> pl.DataFrame:
    """The run's lineage entries (`<run>/lineage.jsonl`) in order: kind, comparability verdict and its reasons, the
    note, and the details as JSON. Reading only: `rankwatch lineage RUN` verifies the hash chain."""
    path = Path(run_dir) / "lineage.jsonl"
    rows = []
    if path.exists():
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise RunDirError(f"{path}: unreadable ({exc})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                v = e["verdict"]
                rows.append({"seq": int(e["seq"]), "time_ns": int(e["time_ns"]), "kind": str(e["kind"]),
                             "comparability": str(v["comparability"]), "reasons": [str(r) for r in v["reasons"]],
                             "note": str(v.get("note") or ""), "attempt": (e.get("details") or {}).get("attempt"),
                             "details": json.dumps(e.get("details") or {}, sort_keys=True)})
            except (ValueError, KeyError, TypeError) as exc:
                raise RunDirError(f"{path}: line {n} is not a lineage entry ({type(exc).__name__}: {exc})") from None
    return pl.DataFrame(rows, schema=_LINEAGE_SCHEMA)


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparability:
    """Whether the run's trajectory stayed what an uninterrupted run would have been."""

    bitwise: bool
    """Every lineage entry expects a bitwise-identical trajectory and no replay was found nondeterministic."""
    entries: int
    changed: tuple[str, ...]
    """One line per entry that changed the trajectory: its kind and reasons."""
    replay_mismatches: int
    """Replay-divergence incidents: a replayed step that ended in another state."""

    def line(self) -> str:
        if not self.entries:
            return "no lineage entries: the run was never interrupted, replayed or changed"
        if self.bitwise:
            return f"comparable: all {self.entries} lineage entries expect a bitwise-identical trajectory"
        why = "; ".join(self.changed) or f"{self.replay_mismatches} replayed step(s) ended in another state"
        return f"CHANGED: {why}"


def comparability(run_dir: Path | str, incidents: Sequence[Incident] = ()) -> Comparability:
    lin = lineage(run_dir)
    changed = tuple(f"#{r['seq']} {r['kind']}: {', '.join(r['reasons']) or r['note']}"
                    for r in lin.iter_rows(named=True) if r["comparability"] != "bitwise_identical_expected")
    replay = sum(1 for i in incidents if str(i.cause) == "nondeterministic_replay")
    return Comparability(bitwise=not changed and not replay, entries=lin.height, changed=changed,
                         replay_mismatches=replay)


def quarantine(run_dir: Path | str) -> pl.DataFrame:
    """The run's quarantine list (`<run>/quarantine.json`): kind, id, and why."""
    path = Path(run_dir) / "quarantine.json"
    schema = {"kind": pl.String, "id": pl.String, "reason": pl.String}
    if not path.exists():
        return pl.DataFrame(schema=schema)
    doc = _json(path)
    items = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise RunDirError(f"{path}: not a quarantine list (expected an object with an 'entries' list)")
    rows = []
    for it in items:
        if not isinstance(it, dict) or "kind" not in it or "id" not in it:
            raise RunDirError(f"{path}: not a quarantine list (an entry without kind and id: {it!r:.80})")
        rows.append({"kind": str(it["kind"]), "id": str(it["id"]), "reason": str(it.get("incident") or "")})
    return pl.DataFrame(rows, schema=schema)


# ------------------------------------------------------------------------------------------------ arranged


def incident_table(incidents: Sequence[Incident], decided: pl.DataFrame,
                   start_wall_ns: int = 0) -> pl.DataFrame:
    """One row per incident, most consequential first: class, subject, ranks, onset and detection step, when it
    was detected (seconds into the run), confidence, cause, the summary, and the latest decision and its status
    ('none' when nothing was decided)."""
    latest: dict[str, dict[str, Any]] = {}
    for row in decided.iter_rows(named=True):
        latest[row["incident"]] = row
    rows = []
    for i in incidents:
        d = latest.get(i.id)
        rows.append({
            "id": i.id, "class": str(i.klass), "subject": str(i.subject), "ranks": _ranks_text(i.ranks),
            "onset_step": i.onset_step, "detection_step": i.detection_step,
            "since_s": None if i.detection_wall_ns is None or not start_wall_ns
            else round((i.detection_wall_ns - start_wall_ns) / 1e9, 1),
            "confidence": round(i.confidence, 2), "cause": str(i.cause), "device_fault": i.device_fault,
            "decision": "none" if d is None else d["action"] + (f" {d['target']}" if d["target"] else ""),
            "status": "undecided" if d is None else str(d["outcome"]), "summary": i.summary})
    return pl.DataFrame(rows, schema={
        "id": pl.String, "class": pl.String, "subject": pl.String, "ranks": pl.String, "onset_step": pl.Int64,
        "detection_step": pl.Int64, "since_s": pl.Float64, "confidence": pl.Float64, "cause": pl.String,
        "device_fault": pl.Boolean, "decision": pl.String, "status": pl.String, "summary": pl.String})


def _ranks_text(ranks: Sequence[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return ",".join(map(str, ranks))
    return ",".join(map(str, ranks[:limit])) + f",… ({len(ranks)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class IncidentDetail:
    """The evidence behind one incident, arranged: the subject ranks' GPUs against the median GPU, their
    per-step time and lateness against their stage peers' median around the onset, the links involved, the
    checkpoints around it, the fingerprints that disagree, and the decisions with their gates."""

    incident: Incident
    gpu: pl.DataFrame
    series: pl.DataFrame
    """step, who ('subject': the largest of the subject ranks; 'peers median': of up to 64 ranks of the same
    pipeline stages), step_ms, compute_ms, wait_ms, late_ms. In lockstep training every rank's step takes as long
    as the slowest's: a straggler shows in its compute (and in lateness: it is the one the others wait for), not in
    its step time."""
    arrivals: pl.DataFrame
    links: pl.DataFrame
    checkpoints: pl.DataFrame
    fingerprints: pl.DataFrame
    decisions: pl.DataFrame


def incident_detail(views: ViewStore, incident: Incident, decided: pl.DataFrame | None = None,
                    *, around: int = 50, max_ranks: int = 8) -> IncidentDetail:
    ranks = list(incident.ranks[:max_ranks])
    onset = incident.onset_step if incident.onset_step is not None else views.summary.last_step
    lo, hi = onset - around, onset + around
    gp = views.frame("gpu_peers")
    gpu = gp.filter(pl.col(_R).is_in(ranks)).with_columns(pl.lit("subject").alias("who"))
    if gp.height:
        med = gp.select(pl.lit(None, pl.Int32).alias(_R), pl.lit("all GPUs").alias("device_uuid"),
                        *[pl.col(c).median() for c in gp.columns if c not in (_R, "device_uuid") and
                          gp[c].dtype.is_numeric()]).with_columns(pl.lit("median GPU").alias("who"))
        gpu = pl.concat([gpu, med.select(gpu.columns)], how="vertical_relaxed") if gpu.height else med
    topo = views.frame("topology")
    roles = topo.filter(pl.col(_R).is_in(ranks))["role"].unique().to_list() if topo.height else []
    peers = topo.filter(pl.col("role").is_in(roles) & ~pl.col(_R).is_in(ranks))[_R].to_list()[:64] if topo.height else []
    subj = pl.concat([views.rank(r) for r in ranks], how="vertical_relaxed") if ranks else views.rank(-1)
    peer_rows = pl.concat([views.rank(r) for r in peers], how="vertical_relaxed") if peers else subj.clear()
    window = pl.col(_S).is_between(lo, hi)
    cols = ("step_ms", "compute_ms", "wait_ms", "late_ms")
    a = subj.filter(window).group_by(_S).agg([pl.col(c).max() for c in cols]).with_columns(
        pl.lit("subject").alias("who"))
    b = peer_rows.filter(window).group_by(_S).agg([pl.col(c).median() for c in cols]
                                                   ).with_columns(pl.lit("peers median").alias("who"))
    series = pl.concat([a, b], how="vertical_relaxed").select(_S, "who", *cols).sort("who", _S)
    lb = views.frame("leaderboard")
    arrivals = lb.filter(pl.col(_R).is_in(ranks + peers[:8]))
    ln = views.frame("links")
    hosts = topo.filter(pl.col(_R).is_in(ranks))["host"].unique().to_list() if topo.height else []
    if incident.subject.kind is SubjectKind.LINK:
        links = ln.filter(pl.col("link") == incident.subject.id)
    else:
        links = ln.filter(pl.any_horizontal([pl.col("link").str.contains(f"(^|<->){h}($|<->)") for h in hosts])
                          if hosts else pl.lit(False))
    ck = views.frame("checkpoints")
    checkpoints = ck.filter(pl.col(_S).is_between(lo, hi)) if ck.height else ck
    fp = views.frame("fingerprints")
    fingerprints = fp.filter(~pl.col("agree")) if fp.height else fp
    if fingerprints.height and ranks:
        fingerprints = fingerprints.filter(pl.col("disagreeing").str.contains("|".join(
            f"(^|,){r}(,|$)" for r in ranks)) | pl.lit(incident.klass in (IncidentClass.DIVERGENCE,
                                                                          IncidentClass.CORRUPTION)))
    dec = (decided if decided is not None else decisions(views.run_dir)).filter(pl.col("incident") == incident.id)
    return IncidentDetail(incident=incident, gpu=gpu, series=series, arrivals=arrivals, links=links,
                          checkpoints=checkpoints, fingerprints=fingerprints.head(50), decisions=dec)


def heatmap(views: ViewStore, metric: str = "step_ms", *, max_ranks: int = 128, max_steps: int = 200) -> pl.DataFrame:
    """The rank x step matrix of `metric` (step_ms, compute_ms, wait_ms, late_ms, dataloader_ms), binned to at most
    max_ranks x max_steps cells; a cell holds the largest value in it (a straggler is never averaged away).
    Columns rank_lo, rank_hi, step_lo, step_hi, value."""
    path = views.folder / "rank_steps.parquet"
    s = views.summary
    rbin = max(1, -(-max(s.ranks, 1) // max_ranks))
    first, last = s.first_step, s.last_step
    sbin = max(1, -(-max(last - first + 1, 1) // max_steps))
    try:
        df = (pl.scan_parquet(path).select(_R, _S, metric)
              .with_columns((pl.col(_R) // rbin).alias("rb"), ((pl.col(_S) - first) // sbin).alias("sb"))
              .group_by("rb", "sb").agg(pl.col(metric).max().alias("value")).collect())
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise RunDirError(f"{path}: unreadable view ({type(exc).__name__}: {exc})") from None
    return df.select((pl.col("rb") * rbin).cast(pl.Int32).alias("rank_lo"),
                     ((pl.col("rb") + 1) * rbin - 1).cast(pl.Int32).alias("rank_hi"),
                     (pl.col("sb") * sbin + first).alias("step_lo"),
                     ((pl.col("sb") + 1) * sbin + first - 1).alias("step_hi"), "value").sort("rank_lo", "step_lo")


def grid(views: ViewStore, metric: str = "score") -> pl.DataFrame:
    """The dp x pp grid: per (dp, pp) cell the largest leaderboard `metric` among its tensor-parallel ranks and
    which rank it is."""
    topo = views.frame("topology")
    lb = views.frame("leaderboard")
    if topo.height == 0 or lb.height == 0:
        return pl.DataFrame(schema={"dp": pl.Int32, "pp": pl.Int32, "value": pl.Float64, _R: pl.Int32})
    j = topo.select(_R, "dp", "pp").join(lb.select(_R, metric), on=_R)
    return j.group_by("dp", "pp").agg(pl.col(metric).max().alias("value"),
                                      pl.col(_R).sort_by(metric).last()).sort("dp", "pp")


def topology_status(views: ViewStore, incidents: Sequence[Incident], quarantined: pl.DataFrame
                    ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(devices, links): every rank's host and device with the incidents naming it (its rank, device or host) and
    whether the device or host is quarantined; every inter-host link with its bandwidth against the median link,
    the incidents naming it and whether it is quarantined."""
    topo = views.frame("topology")
    q = {(r["kind"], r["id"]) for r in quarantined.iter_rows(named=True)}
    by_rank: dict[int, list[str]] = {}
    by_link: dict[str, list[str]] = {}
    for inc in incidents:
        tag = f"{inc.klass}"
        if inc.subject.kind is SubjectKind.LINK:
            by_link.setdefault(inc.subject.id, []).append(tag)
        elif inc.subject.kind is not SubjectKind.JOB:
            for r in inc.ranks:
                by_rank.setdefault(r, []).append(tag)
    dev_rows = []
    for t in topo.iter_rows(named=True):
        tags = by_rank.get(t[_R], [])
        dev_rows.append({"host": t["host"], "local_rank": t["local_rank"], _R: t[_R], "device": t["device_uuid"],
                         "dp": t["dp"], "tp": t["tp"], "pp": t["pp"], "incidents": ",".join(dict.fromkeys(tags)),
                         "status": "quarantined" if ("device", t["device_uuid"]) in q or ("host", t["host"]) in q
                         else (tags[0] if tags else "ok")})
    devices = pl.DataFrame(dev_rows, schema={"host": pl.String, "local_rank": pl.Int32, _R: pl.Int32,
                                             "device": pl.String, "dp": pl.Int32, "tp": pl.Int32, "pp": pl.Int32,
                                             "incidents": pl.String, "status": pl.String})
    ln = views.frame("links")
    per = (ln.group_by("link").agg(pl.col("gbps").min(), pl.col("vs_median_link").min()) if ln.height
           else pl.DataFrame(schema={"link": pl.String, "gbps": pl.Float64, "vs_median_link": pl.Float64}))
    names = set(per["link"].to_list()) | set(by_link)
    for g in views.frame("groups").iter_rows(named=True):
        names |= set(g["links"] or [])
    known = {r["link"]: r for r in per.iter_rows(named=True)}
    link_rows = []
    for name in sorted(names):
        a, _, b = name.partition("<->")
        tags = by_link.get(name, [])
        k = known.get(name, {})
        link_rows.append({"link": name, "a": a, "b": b, "gbps": k.get("gbps"), "vs_median_link": k.get("vs_median_link"),
                          "incidents": ",".join(dict.fromkeys(tags)),
                          "status": "quarantined" if ("link", name) in q else (tags[0] if tags else "ok")})
    links = pl.DataFrame(link_rows, schema={"link": pl.String, "a": pl.String, "b": pl.String, "gbps": pl.Float64,
                                            "vs_median_link": pl.Float64, "incidents": pl.String, "status": pl.String})
    return devices, links


_TIMELINE: dict[str, pl.DataType | type[pl.DataType]] = {"wall_ns": pl.Int64, "t_s": pl.Float64, "kind": pl.String, "what": pl.String, "rank": pl.Int32,
             "step": pl.Int64, "attempt": pl.Int32}


def timeline(views: ViewStore, incidents: Sequence[Incident], decided: pl.DataFrame, lineage_frame: pl.DataFrame,
             *, max_events: int = 2_000) -> pl.DataFrame:
    """Everything that happened to the run in time order: starts and restarts (per attempt, not per rank), exits,
    signals and exceptions, checkpoints saved and loaded, incidents (when detected), decisions and lineage entries.
    t_s is seconds since the run's first start."""
    start = views.summary.start_wall_ns
    rows: list[dict[str, Any]] = []
    ev = views.frame("events")
    if ev.height:
        starts = ev.filter(pl.col("kind") == str(EventKind.START)).group_by("attempt").agg(
            pl.col("wall_ns").min(), pl.len().alias("n"))
        for r in starts.iter_rows(named=True):
            rows.append({"wall_ns": r["wall_ns"], "kind": "start" if not r["attempt"] else "restart",
                         "what": f"attempt {r['attempt']}: {r['n']} ranks started", "attempt": r["attempt"]})
        other = ev.filter(pl.col("kind").is_in([str(EventKind.EXIT), str(EventKind.SIGNAL), str(EventKind.EXCEPTION),
                                                str(EventKind.RECOVERY), str(EventKind.CHECKPOINT_FAILED)]))
        # a clean exit of every rank is one line per attempt, not one per rank
        clean = other.filter((pl.col("kind") == str(EventKind.EXIT)) & (pl.col("exit_code").fill_null(0) == 0))
        for r in clean.group_by("attempt").agg(pl.col("wall_ns").max(), pl.len().alias("n")).iter_rows(named=True):
            rows.append({"wall_ns": r["wall_ns"], "kind": "exit", "what": f"attempt {r['attempt']}: {r['n']} ranks "
                         "exited cleanly", "attempt": r["attempt"]})
        for r in other.filter(~((pl.col("kind") == str(EventKind.EXIT)) & (pl.col("exit_code").fill_null(0) == 0))
                              ).head(max_events).iter_rows(named=True):
            text = " ".join(str(x) for x in (r["exc_type"], r["message"]) if x) or (
                f"signal {r['signal']}" if r["signal"] is not None else f"exit code {r['exit_code']}")
            rows.append({"wall_ns": r["wall_ns"], "kind": r["kind"], "what": text[:200], _R: r[_R], _S: r[_S],
                         "attempt": r["attempt"]})
    ck = views.frame("checkpoints")
    for r in ck.filter(pl.col("phase").is_in([str(CheckpointPhase.PUBLISH), str(CheckpointPhase.LOAD)])
                       ).iter_rows(named=True):
        saved = r["phase"] == str(CheckpointPhase.PUBLISH)
        rows.append({"wall_ns": r["end_wall_ns"], "kind": "checkpoint saved" if saved else "checkpoint loaded",
                     "what": f"{r['checkpoint_id']} (step {r[_S]}, {r['ranks']} ranks{'' if r['ok'] else ', FAILED'})",
                     _S: r[_S]})
    for i in incidents:
        if i.detection_wall_ns is not None:
            rows.append({"wall_ns": i.detection_wall_ns, "kind": "incident", "what": f"{i.klass} {i.subject}: "
                         f"{i.summary}"[:200], _S: i.detection_step, "attempt": i.attempt})
    for d in decided.iter_rows(named=True):
        rows.append({"wall_ns": d["wall_ns"], "kind": f"decision ({d['status']})",
                     "what": f"{d['class']} {d['subject']}: {d['action']}" + (f" {d['target']}" if d["target"] else "")
                     + f" — {d['outcome']}"})
    for r in lineage_frame.iter_rows(named=True):
        rows.append({"wall_ns": r["time_ns"], "kind": "lineage", "what": f"#{r['seq']} {r['kind']}: "
                     f"{r['comparability']}" + (f" ({', '.join(r['reasons'])})" if r["reasons"] else ""),
                     "attempt": r["attempt"]})
    df = pl.DataFrame(rows, schema={k: v for k, v in _TIMELINE.items() if k != "t_s"}, strict=False)
    return df.with_columns(((pl.col("wall_ns") - start) / 1e9).alias("t_s")).select(list(_TIMELINE)).sort(
        "wall_ns", nulls_last=True)


def run_incidents(views: ViewStore) -> tuple[Incident, ...]:
    """The run's incidents: its analysis' (the stored views'), then those only the recovery records carry (the live
    loop's), each once."""
    found = {i.id: i for i in views.incidents}
    for i in recorded_incidents(views.run_dir):
        found.setdefault(i.id, i)
    return tuple(found.values())


def observation(views: ViewStore) -> RunObservation:
    """The run's incidents (`run_incidents`) on the topology they happened on, for `localize`."""
    topo = views.frame("topology")
    attempt = int(topo["attempt"].max()) if topo.height else 0  # type: ignore[arg-type]
    return RunObservation(run=str(views.run_dir), attempt=attempt, incidents=run_incidents(views), topology=topo,
                          groups=views.frame("groups"))


def across_runs(stores: Sequence[ViewStore]) -> tuple[Localization, ...]:
    """Localization of recurring faults across the runs: does it follow the device, the rank, the host or a link?"""
    return localize([observation(v) for v in stores])


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
    from rankwatch.collector.schema import Table

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
