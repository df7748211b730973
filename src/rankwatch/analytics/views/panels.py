"""The views arranged for a reader: the incident table and an incident's detail, the binned rank x step heatmap, the
dp x pp grid, the topology with its status, the timeline and localization across runs. Each joins stored views
(`views.store`) with the run's records (`views.records`); no detector runs here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.incidents import Incident, IncidentClass, SubjectKind
from rankwatch.analytics.localize import Localization, RunObservation, localize
from rankwatch.analytics.views.records import decisions, recorded_incidents
from rankwatch.analytics.views.store import ViewStore
from rankwatch.analytics.views.story import incident_marks
from rankwatch.base.schema import CheckpointPhase, EventKind

_R, _S = "rank", "step"


def incident_table(incidents: Sequence[Incident], decided: pl.DataFrame,
                   start_wall_ns: int = 0) -> pl.DataFrame:
    """One row per incident, most consequential first: class, subject, ranks, onset and detection step, when it
    was detected (seconds into the run), confidence, cause, the summary, the latest decision and its status
    ('none' when nothing was decided), and what it cost (`Incident.impact`: the share of step time over its span,
    seconds and GPU-hours lost; null where not measured)."""
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
            "status": "undecided" if d is None else str(d["outcome"]), "summary": i.summary,
            "cost_share": None if i.impact is None else i.impact.share,
            "lost_s": None if i.impact is None else i.impact.lost_s,
            "gpu_hours": None if i.impact is None else i.impact.gpu_hours})
    return pl.DataFrame(rows, schema={
        "id": pl.String, "class": pl.String, "subject": pl.String, "ranks": pl.String, "onset_step": pl.Int64,
        "detection_step": pl.Int64, "since_s": pl.Float64, "confidence": pl.Float64, "cause": pl.String,
        "device_fault": pl.Boolean, "decision": pl.String, "status": pl.String, "summary": pl.String,
        "cost_share": pl.Float64, "lost_s": pl.Float64, "gpu_hours": pl.Float64})


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
                    *, around: int = 50, max_ranks: int = 8, max_points: int = 1_000) -> IncidentDetail:
    """The series covers `around` steps either side of the onset; for a straggler or an imbalance, the whole episode:
    from `around` steps before the onset to the run's last step, binned (each bin's mean) to `max_points` steps."""
    ranks = list(incident.ranks[:max_ranks])
    onset = incident.onset_step if incident.onset_step is not None else views.summary.last_step
    lo, hi = onset - around, onset + around
    if incident.klass in (IncidentClass.STRAGGLER, IncidentClass.IMBALANCE):
        hi = max(hi, views.summary.last_step)
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
    series = pl.concat([a, b], how="vertical_relaxed").select(_S, "who", *cols)
    width = -(-(hi - lo + 1) // max_points)
    if width > 1:
        series = series.group_by((pl.col(_S) // width * width).alias(_S), "who").agg([pl.col(c).mean() for c in cols])
    series = series.sort("who", _S)
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
            if r["kind"] == str(EventKind.EXIT):  # its message is the collector's own note, not how it ended
                text = f"exit code {r['exit_code']}" + (f" (signal {r['signal']})" if r["signal"] is not None else "")
            else:
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
    marks = incident_marks(incidents)
    for i in incidents:
        if i.detection_wall_ns is not None:
            rows.append({"wall_ns": i.detection_wall_ns, "kind": "incident", "what": f"{marks[i.id].label} {i.klass} "
                         f"{i.subject}: {i.summary}"[:200], _S: i.detection_step, "attempt": i.attempt})
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
