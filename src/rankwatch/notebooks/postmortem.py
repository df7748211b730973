# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Post-mortem of a training run
#
# Rebuilt from the run's own data through `rankwatch.analytics.views`: the run at a glance and the verdict, the
# timeline with every incident and its state, one incident told in full (a fail-stop from the first rank to stop to
# the steps replayed) and the evidence behind it, the recovery decision and its path through the gates, the lineage
# and whether the trajectory stayed comparable, and what to check next.
#
# Run it with `rankwatch postmortem RUN_DIR [--incident ID] --out report.ipynb [--html report.html]`; in Jupyter,
# set `run_dir` in the parameters cell. The HTML report leaves the code out; the `.ipynb` keeps it.

# %% tags=["parameters"]
run_dir = ""
incident_id = None

# %%
import html
import json
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle
import polars as pl
from IPython.display import Markdown, display

from rankwatch.analytics import views
from rankwatch.analytics.analyze import ensure_views
from rankwatch.analytics.incidents import IncidentClass, sort_incidents
from rankwatch.base.schema import EventKind, LineageKind


def show(fig):
    """Display a figure as an image output and release it."""
    fig.tight_layout()
    display(fig)
    plt.close(fig)


def say(text):
    display(Markdown(text))


def _header(name):
    if name in ("wall_ns", "time_ns"):
        return "when"
    for suffix, unit in (("_wall_ns", ""), ("_ns", ""), ("_ms", " (ms)"), ("_s", ""), ("_mhz", " (MHz)"),
                         ("_w", " (W)"), ("_c", " (°C)")):
        if name.endswith(suffix) and not name.endswith("_per_s"):
            return name[:-len(suffix)].replace("_", " ") + unit
    return name.replace("_", " ")


def _cell(name, v):
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if name.endswith("wall_ns") or name == "time_ns":
        return views.local_time(v)
    if name.endswith("_s") and not name.endswith("_per_s") and isinstance(v, (int, float)):
        return views.duration(v)
    if name.endswith("_ns") and isinstance(v, (int, float)):
        return views.duration(v / 1e9)
    if name == "bytes" and isinstance(v, int):
        return next(f"{v / 10 ** p:.1f} {u}" for p, u in ((9, "GB"), (6, "MB"), (3, "kB"), (0, "B")) if v >= 10 ** p
                    or p == 0)
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "—"
    return str(v)


def table(df, *, rows=30):
    """Display a frame as a table for a person (HTML, and text for a terminal): wall times (`*wall_ns`, `time_ns`) in
    local time, seconds and nanoseconds (`*_s`, `*_ns`) as durations with their unit, other units named in the
    header, sizes in bytes as kB/MB/GB, lists joined, none as '—'; its first `rows` rows."""
    names = df.columns
    cells = [[_cell(n, v) for n, v in zip(names, row)] for row in df.head(rows).iter_rows()]
    heads = [_header(n) for n in names]
    left = ' style="text-align:left"'
    body = "".join("<tr>" + "".join(f"<td{left}>{html.escape(c)}</td>" for c in row) + "</tr>" for row in cells)
    more = f"<p>the first {rows} of {df.height} rows</p>" if df.height > rows else ""
    page = (f'<table class="dataframe"><thead><tr>{"".join(f"<th{left}>{html.escape(h)}</th>" for h in heads)}'
            f"</tr></thead><tbody>{body}</tbody></table>{more}")
    widths = [max(len(c) for c in col) for col in zip(heads, *cells)]
    plain = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [heads, *cells])
    display({"text/html": page, "text/plain": plain + (f"\n(the first {rows} of {df.height} rows)" if more else "")},
            raw=True)


if not run_dir:
    raise ValueError("run_dir is not set: pass the run folder (rankwatch postmortem RUN_DIR)")
RUN = Path(run_dir)
store = ensure_views(RUN)  # a run that cannot be analysed raises here, one line naming the run
summary = store.summary
decided = views.decisions(RUN)
lineage = views.lineage(RUN)
quarantined = views.quarantine(RUN)
incidents = sort_incidents(views.run_incidents(store))
found = {i.id: i for i in incidents}
states = views.incident_states(incidents, decided, str(RUN))
steps = store.frame("rank_steps")
progress = store.frame("progress")
events = store.frame("events")
last_attempt = int(events["attempt"].max()) if events.height else 0  # type: ignore[arg-type]
abnormal = events.filter((pl.col("kind") == str(EventKind.SIGNAL)) | (
    (pl.col("kind") == str(EventKind.EXIT)) & (pl.col("exit_code").fill_null(0) != 0)))
applied = decided.filter(pl.col("status") == "applied")

# %%
# the steps trained more than once, from the lineage (rank_steps keeps only the final trajectory, so it cannot tell)
replays = []
for r in lineage.filter(pl.col("kind") == str(LineageKind.REPLAYED_DATA_RANGE)).iter_rows(named=True):
    det = json.loads(r["details"] or "{}")
    if det.get("from_step") is not None and det.get("to_step") is not None and det["to_step"] > det["from_step"]:
        replays.append({"first_step": int(det["from_step"]), "last_step": int(det["to_step"]) - 1,  # to_step: exclusive
                        "attempt": r["attempt"], "checkpoint": det.get("checkpoint_id"), "lineage": f"#{r['seq']}"})
replay_spans = ", ".join(f"{x['first_step']}..{x['last_step']}" if x["first_step"] != x["last_step"]
                         else str(x["first_step"]) for x in replays)
replayed_text = (f"steps {replay_spans} were trained twice (replayed after a rollback; lineage "
                 f"{', '.join(x['lineage'] for x in replays)})" if replays else "no step was trained twice")

# a run that stopped, hung, computed wrong values or disagreed with itself failed, recovered or not
FAILING = (IncidentClass.FAIL_STOP, IncidentClass.HANG, IncidentClass.CORRUPTION, IncidentClass.DIVERGENCE)
failing = [i for i in incidents if i.klass in FAILING]
final_abnormal = abnormal.filter(pl.col("attempt") == last_attempt)
# every rank of the last attempt recorded its exit (views stored before `summary.ended` existed say False)
_last = events.filter(pl.col("attempt") == last_attempt)
ended = summary.ended or bool(events.height) and set(
    _last.filter(pl.col("kind") == str(EventKind.START))["rank"].to_list()) <= set(
    _last.filter(pl.col("kind") == str(EventKind.EXIT))["rank"].to_list())
pending = states.filter(pl.col("state").is_in(views.PENDING))


def _recoveries():
    seen: dict[str, str] = {}
    for d in applied.iter_rows(named=True):
        seen.setdefault(d["record"], f"{d['record']} chose to {views.action_text(d['action'], d['target'])} "
                                     f"(outcome: {d['outcome']})")
    return list(seen.values())


def verdict():
    """What happened to the run in a few sentences: whether it failed, whether it was recovered, what is pending.
    Never 'healthy' for a run with a failing incident, an abnormal exit, a restart or a recovery."""
    troubled = bool(failing or abnormal.height or applied.height or last_attempt > 0)
    what = [f"{i.klass} of {i.subject}" + (f" in step {i.onset_step}" if i.onset_step is not None else "")
            + (f" (attempt {i.attempt})" if i.attempt is not None else "") for i in failing[:3]]
    what += [f"and {len(failing) - 3} more failing incident(s)"] if len(failing) > 3 else []
    if not what and abnormal.height:
        what = [f"{abnormal['rank'].n_unique()} rank(s) exited abnormally or by a signal (no incident explains it)"]
    recovered = _recoveries()
    completed = ended and not final_abnormal.height
    stale = ("_The telemetry grew since the views were built: rerun `rankwatch analyze` before trusting this._"
             if store.stale() else "")
    out = []
    if not ended:
        out.append(f"**The run has not ended cleanly:** attempt {last_attempt} has ranks without a recorded exit "
                   "(still running when the views were built, or killed without a trace)"
                   + (f"; before that: {'; '.join(what)}" if what else "") + "."
                   + (f" Recovery: {'; '.join(recovered)}." if recovered else ""))
    elif not troubled and not incidents:
        return ("**The run was healthy:** no incident, no abnormal exit, no restart, and nothing is pending."
                + (f"\n\n{stale}" if stale else ""))
    elif not troubled:
        out.append(f"**The run completed with {len(incidents)} incident(s)** and no failure: "
                   + ", ".join(f"{i.klass} of {i.subject}" for i in incidents[:5])
                   + (" …" if len(incidents) > 5 else "") + ".")
    elif completed and (recovered or last_attempt > 0):
        out.append(f"**The run failed and was recovered:** {'; '.join(what) or 'it was restarted'}. "
                   + (f"Recovery: {'; '.join(recovered)}. " if recovered else "")
                   + f"Attempt {last_attempt} ran to step {summary.last_step} and every rank exited cleanly; "
                   + f"{replayed_text}.")
    elif completed:
        out.append(f"**The run ran to its last step but failed on the way:** {'; '.join(what)}; no recovery was "
                   "applied.")
    else:
        out.append(f"**The run failed and was not recovered:** {'; '.join(what)}. Its last attempt ({last_attempt}) "
                   f"ended with {final_abnormal['rank'].n_unique()} rank(s) exiting abnormally."
                   + (f" Recovery tried: {'; '.join(recovered)}." if recovered else ""))
    if pending.height:
        out.append("**Pending:** " + "; ".join(f"`{r['id']}` ({r['state']}): {r['next_step']}"
                                                for r in pending.iter_rows(named=True)))
    else:
        out.append("Nothing is pending" + (": every incident was recovered or is left as it is by the policy."
                                           if incidents else "."))
    return "\n\n".join(out + ([stale] if stale else []))


VERDICT = verdict()

# %% [markdown]
# ## 1. The run at a glance

# %%
layout = " x ".join(f"{k}={v}" for k, v in summary.layout.items()) or "unknown"
glance = pl.DataFrame({
    "what": ["run", "ranks", "layout", "hosts", "steps", "clock", "first start", "last record", "wall time",
             "attempts", "effective training time", "goodput", "steps per second", "incidents",
             "decisions recorded", "lineage entries", "quarantined", "views"],
    "value": [str(RUN), str(summary.ranks), layout, str(summary.hosts),
              f"{summary.first_step}..{summary.last_step}", summary.clock, views.local_time(summary.start_wall_ns),
              views.local_time(summary.end_wall_ns), views.duration(summary.wall_s), str(last_attempt + 1),
              views.duration(summary.effective_s), f"{summary.goodput:.1%}", f"{summary.steps_per_s:.2f}",
              str(len(incidents)), str(decided.height), str(lineage.height), str(quarantined.height),
              "stale: the telemetry grew since they were built" if store.stale() else "current"],
})
table(glance, rows=glance.height)
say(VERDICT)
for w in summary.warnings:
    say(f"**analysis warning:** {w}")

# %%
per_step = steps.group_by("step").agg(pl.col("step_ms").median().alias("median"),
                                      pl.col("step_ms").max().alias("slowest")).sort("step")
fig, ax = plt.subplots(figsize=(10, 3.5))
if per_step.height:
    ax.plot(per_step["step"], per_step["median"], label="median rank", lw=1)
    ax.plot(per_step["step"], per_step["slowest"], label="slowest rank", lw=1)
for i in incidents:
    if i.onset_step is not None:
        ax.axvline(i.onset_step, color="tab:red", ls=":", lw=1)
ax.set(xlabel="step", ylabel="step time (ms)", title="Step time across ranks (dotted: incident onsets)")
ax.legend()
show(fig)
behind = progress.filter(pl.col("last_step") < summary.last_step)
say(f"{progress.height - behind.height} of {progress.height} ranks reached step {summary.last_step}"
    + (f"; behind: {behind.select('rank', 'host', 'last_step').to_dicts()}" if behind.height else "."))
breakdown = store.frame("breakdown").sort("rank")
say("Where each rank's step time went (medians per step; checkpoint: the run's checkpoint time spread over its "
    "steps):" if breakdown.height <= 32 else f"Where the step time went, over the {breakdown.height} ranks (each "
    "rank's medians per step):")
table(breakdown if breakdown.height <= 32 else breakdown.drop("rank").describe(), rows=32)

# %% [markdown]
# ## 2. Incident timeline and every incident

# %%
tl = views.timeline(store, incidents, decided, lineage)
# drawn: all the run's processes recorded (starts, stops, errors, recovery steps, checkpoints), the incidents, the
# applied decisions and the lineage of its attempts. A dry-run proposal or a lineage note made after the fact may lie
# far from the run; those are listed below the figure instead.
must = tl.filter(pl.col("t_s").is_not_null() & (pl.col("kind") != "decision (proposed)")
                 & ~((pl.col("kind") == "lineage") & pl.col("attempt").is_null()))
first_t, last_t = must.select(pl.col("t_s").min().alias("lo"), pl.col("t_s").max().alias("hi")).row(0)
lo = min(0.0, first_t if first_t is not None else 0.0)
hi = max(summary.wall_s, last_t if last_t is not None else 0.0)
pad = 0.03 * (hi - lo) + 0.2
inside = tl.filter(pl.col("t_s").is_between(lo - pad, hi + pad))
outside = tl.filter(~pl.col("t_s").is_between(lo - pad, hi + pad) | pl.col("t_s").is_null())
kinds = inside.drop_nulls("t_s").group_by("kind").agg(pl.col("t_s").min()).sort("t_s")["kind"].to_list()
fig, ax = plt.subplots(figsize=(10, 0.5 * max(len(kinds), 2) + 1.8))
for y, kind in enumerate(kinds):
    pts = inside.filter(pl.col("kind") == kind)
    # red: something went wrong; green: the job started or recovered; orange: a decision; grey: the rest
    colors = ["tab:green" if kind in ("start", "restart", "recovery") or "exited cleanly" in what else
              "tab:red" if kind in ("incident", "exception", "signal", "exit") else
              "tab:orange" if kind.startswith("decision") else "tab:gray" for what in pts["what"]]
    ax.scatter(pts["t_s"], [y] * pts.height, s=40, color=colors)
for r in inside.filter(pl.col("kind") == "incident").iter_rows(named=True):
    ax.axvline(r["t_s"], color="tab:red", ls=":", lw=1)
for r in inside.filter(pl.col("kind") == "restart").iter_rows(named=True):
    ax.axvline(r["t_s"], color="tab:green", ls="--", lw=1)
ax.invert_yaxis()
ax.set_yticks(range(len(kinds)), kinds)
ax.set_xlim(lo - pad, hi + pad)
ax.set(xlabel=f"seconds since the run's first start ({views.local_time(summary.start_wall_ns)})",
       title="What happened to the run, in time (dotted: incidents detected; dashed: restarts)")
show(fig)
say(f"Drawn: {inside.height} entries, from " + ("the first start" if lo == 0 else f"{views.duration(-lo)} before "
    "the first start") + f" to {views.duration(hi)} after it; every start and stop, error, recovery step, checkpoint, "
    "incident and applied decision of the run is inside.")
table(inside.rename({"t_s": "since_start_s"}).select("wall_ns", "since_start_s", "kind", "what", "rank", "step",
                                                     "attempt"), rows=200)
if outside.height:
    say(f"{outside.height} entr{'y was' if outside.height == 1 else 'ies were'} recorded outside the run's time "
        "(a dry-run plan or a lineage note written after the fact), not drawn:")
    table(outside.select("wall_ns", "kind", "what", "attempt"), rows=50)

# %%
every = views.incident_table(incidents, decided, summary.start_wall_ns).drop("decision", "status").join(
    states, on="id", how="left", maintain_order="left").with_columns(
    pl.Series("detected_wall_ns", [i.detection_wall_ns for i in incidents], dtype=pl.Int64)).rename(
    {"since_s": "since_start_s"})
if incidents:
    say(f"### Every incident of the run ({len(incidents)})\n\nMost consequential first; its state and the next step "
        "come from the recorded decisions. Section 3 tells "
        + ("the chosen one" if incident_id is not None else "the first one") + " in full; `rankwatch postmortem "
        f"{RUN} --incident ID` tells another.")
    table(every.select("id", "class", "subject", "ranks", "onset_step", "detected_wall_ns", "since_start_s", "cause",
                       "state", "decision", "next_step", "summary"), rows=200)
else:
    say("### Every incident of the run\n\nNone was found.")

# %% [markdown]
# ## 3. The incident

# %%
if incident_id is not None and incident_id not in found:
    raise ValueError(f"{RUN}: no incident {incident_id!r}; the run's incidents: {', '.join(found) or 'none'}")
incident = found[incident_id] if incident_id is not None else (incidents[0] if incidents else None)
story = None
if incident is None:
    say(f"**No incidents were found in this run.** {summary.ranks} ranks ran steps {summary.first_step}.."
        f"{summary.last_step} with {summary.goodput:.1%} goodput; the slowest ranks against their stage peers "
        "and the GPUs furthest from the median follow.")
    table(store.frame("leaderboard").head(5))
    gp = store.frame("gpu_peers")
    if gp.height:
        table(gp.sort((pl.col("clock_vs_peers") - 1).abs(), descending=True).head(5))
else:
    chosen = "chosen" if incident_id is not None else "the most consequential of the run's " f"{len(incidents)}"
    state = states.filter(pl.col("id") == incident.id).row(0, named=True)
    say(f"### `{incident.id}` ({chosen})\n\n"
        f"- **class:** {incident.klass}\n- **subject:** {incident.subject}\n"
        f"- **ranks:** {', '.join(map(str, incident.ranks)) or 'none'}\n"
        f"- **onset step:** {incident.onset_step}; **detected at step:** {incident.detection_step}"
        f" ({views.local_time(incident.detection_wall_ns)})"
        + (f"; last step seen sound: {incident.last_good_step}" if incident.last_good_step is not None else "")
        + f"\n- **confidence:** {incident.confidence:.2f}\n- **cause:** {incident.cause}\n"
        f"- **device fault:** {'yes: ' + ', '.join(map(str, incident.hardware)) if incident.device_fault else 'no'}\n"
        + (f"- **fields:** {', '.join(incident.fields)}\n" if incident.fields else "")
        + f"- **state:** {state['state']}; **next step:** {state['next_step']}\n"
        + f"\n{incident.summary}")
    detail = views.incident_detail(store, incident, decided)
    if views.is_fail_stop(incident):
        story = views.fail_stop_story(store, incident, decided, lineage)
        say("#### What happened, in order\n\n" + "\n".join(f"{n}. {line}" for n, line in enumerate(story.lines(), 1)))
        say("How each rank of the attempt ended (first to stop first; the others by time):")
        table(story.stops, rows=64)
        if story.waits.height:
            say("The collectives the others were left in when the first one went:")
            table(story.waits, rows=64)

# %% [markdown]
# ## 4. Root-cause evidence

# %%
if incident is None:
    say("No incident: no root-cause evidence to show.")
elif story is not None:
    # a fail-stop: the ranks in time around the first stop, instead of the straggler figures
    t0 = story.stops.select(pl.col("wall_ns").min()).item() if story.stops.height else None
    t0 = t0 if t0 is not None else incident.detection_wall_ns
    att = steps.filter(pl.col("attempt") == incident.attempt) if incident.attempt is not None else steps
    if t0 is not None and (att.height or story.stops.height):
        step_s = (att.select(pl.col("step_ms").median()).item() or 0.0) / 1e3 if att.height else 0.0
        last = story.stops.select(pl.col("wall_ns").max()).item() if story.stops.height else None
        # ten steps before the first stop, and until the last rank stopped
        lo_s, hi_s = -max(1.0, 10 * step_s), max(0.5, ((last or t0) - t0) / 1e9 * 1.1)
        shown = story.stops["rank"].head(48).to_list() or sorted(set(att["rank"].to_list()))[:48]
        near = att.filter(pl.col("rank").is_in(shown)).with_columns(((pl.col("end_wall_ns") - t0) / 1e9).alias("t")
                                                                    ).filter(pl.col("t").is_between(lo_s, hi_s))
        fig, ax = plt.subplots(figsize=(10, 0.25 * len(shown) + 2))
        row_of = {r: n for n, r in enumerate(shown)}
        ax.scatter(near["t"], [row_of[r] for r in near["rank"]], s=12, color="tab:gray", label="a step ended")
        for r in story.stops.filter(pl.col("rank").is_in(shown)).iter_rows(named=True):
            if r["wall_ns"] is not None:
                first = r["role"] == "stopped first"
                ax.scatter([(r["wall_ns"] - t0) / 1e9], [row_of[r["rank"]]], marker="X", s=90,
                           color="tab:red" if first else "tab:orange")
        ax.axvline(0.0, color="tab:red", ls=":", lw=1)
        ax.set_yticks(range(len(shown)), [f"rank {r}" for r in shown])
        ax.invert_yaxis()
        ax.set_xlim(lo_s, hi_s)
        ax.set(xlabel=f"seconds after the first stop ({views.local_time(t0)})",
               title=f"Attempt {incident.attempt} around the first stop: steps it kept (dots) and each rank's stop "
               "(X; red: the first)")
        show(fig)
    say("Left out for a fail-stop: the subject against its stage peers, the rank x step heatmap and the straggler "
        "leaderboard. They measure a rank that runs slow; this one stopped, and how each rank ended is above.")

# %%
if incident is not None and story is None:
    s = detail.series
    topo = store.frame("topology")
    roles = topo.filter(pl.col("rank").is_in(incident.ranks))["role"].unique().to_list() if topo.height else []
    fig, (a0, a1, a2) = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    for who, style in (("subject", "-"), ("peers median", "--")):
        part = s.filter(pl.col("who") == who).sort("step")
        a0.plot(part["step"], part["compute_ms"], style, label=who)
        a1.plot(part["step"], part["step_ms"], style, label=who)
        a2.plot(part["step"], part["late_ms"], style, label=who)
    for ax in (a0, a1, a2):
        if incident.onset_step is not None:
            ax.axvline(incident.onset_step, color="tab:red", ls=":", lw=1, label="onset")
        if incident.detection_step is not None:
            ax.axvline(incident.detection_step, color="tab:orange", ls=":", lw=1, label="detected")
    a0.set(ylabel="compute (ms)",
           title=f"{incident.subject} against its stage peers ({', '.join(roles) or 'no topology'})")
    a1.set(ylabel="step time (ms)")
    a2.set(xlabel="step", ylabel="lateness (ms)")
    a0.legend(fontsize=8)
    show(fig)

# %%
if incident is not None and story is None:
    onset = incident.onset_step if incident.onset_step is not None else summary.last_step
    # own time shows a slow rank; step time is the same for every rank of a synchronous step
    metric = "compute_ms" if str(incident.klass) in ("straggler", "imbalance") else "step_ms"
    hm = views.heatmap(store, metric).filter(pl.col("step_hi") >= onset - 50, pl.col("step_lo") <= onset + 50)
    if hm.height:
        wide = hm.pivot(on="step_lo", index="rank_lo", values="value").sort("rank_lo")
        cols = [c for c in wide.columns if c != "rank_lo"]
        fig, ax = plt.subplots(figsize=(10, 4))
        # the colour scale stops at the 98th percentile: one checkpoint step does not wash out the rest
        top = hm["value"].quantile(0.98)
        im = ax.imshow(wide.select(cols).to_numpy(), aspect="auto", interpolation="nearest", cmap="viridis",
                       vmax=top, extent=(int(cols[0]), int(cols[-1]) + 1, wide.height, 0))
        ranks_lo = wide["rank_lo"].to_list()
        every_n = max(1, wide.height // 16)
        ax.set_yticks([n + 0.5 for n in range(wide.height)][::every_n], [str(r) for r in ranks_lo][::every_n])
        hit = {n for n, lo in enumerate(ranks_lo) for r in incident.ranks
               if lo <= r and (n + 1 == len(ranks_lo) or ranks_lo[n + 1] > r)}
        for n in sorted(hit):
            ax.annotate("\u2190", (int(cols[-1]) + 1, n + 0.5), color="tab:red", fontsize=8,
                        va="center", annotation_clip=False)
        if incident.onset_step is not None:
            ax.axvline(incident.onset_step, color="white", ls=":", lw=1)
        ax.set(xlabel="step", ylabel="rank", title=f"{metric} by rank around the onset (step {onset}; cells hold "
               "the largest value)")
        fig.colorbar(im, ax=ax)
        show(fig)
    else:
        say(f"No rank x step rows around step {onset}.")

# %%
if incident is not None:
    g = detail.gpu
    metrics = [m for m in ("sm_clock_mhz", "power_w", "temperature_c") if m in g.columns]
    med = g.filter(pl.col("who") == "median GPU")
    subj = g.filter(pl.col("who") == "subject")
    if subj.height and med.height:
        fig, ax = plt.subplots(figsize=(10, 3.5))
        width = 0.8 / subj.height
        labels = [f"{m} (%)" for m in metrics] + ["throttled share (points)"]
        for n, row in enumerate(subj.iter_rows(named=True)):
            diff = [100.0 * ((row[m] or 0.0) / med[m][0] - 1.0) if med[m][0] else 0.0 for m in metrics]
            diff.append(100.0 * ((row["throttled_share"] or 0.0) - (med["throttled_share"][0] or 0.0)))
            ax.bar([x + n * width for x in range(len(labels))], diff, width, label=f"rank {row['rank']}")
        ax.set_xticks([x + (subj.height - 1) * width / 2 for x in range(len(labels))], labels)
        ax.axhline(0.0, color="black", lw=0.8)
        span_y = max(5.0, 1.2 * max(abs(b.get_height()) for b in ax.patches if isinstance(b, Rectangle)))
        ax.set_ylim(-span_y, span_y)  # within a few percent of the median reads as flat
        ax.set(ylabel="difference from the median GPU",
               title="GPU counters of the subject ranks against the median GPU (0 = the median)")
        ax.legend(fontsize=8)
        show(fig)
        table(g)
    else:
        say("No GPU telemetry for the subject ranks (no NVML on those hosts, or a subject without ranks): no GPU "
            "counters to compare.")

# %%
if incident is not None:
    for n, e in enumerate(incident.evidence, 1):
        say(f"**evidence {n} — `{e.source}`:** {e.summary}")
        if e.columns:
            table(pl.DataFrame([list(r) for r in e.rows], schema=list(e.columns), orient="row", strict=False))
    for name, frame, what in (
            ("arrivals", detail.arrivals, "the subject and its peers on the straggler leaderboard"),
            ("links", detail.links, "the inter-host links involved"),
            ("checkpoints", detail.checkpoints, "checkpoints around the onset"),
            ("fingerprints", detail.fingerprints, "fingerprints that disagree")):
        if name == "arrivals" and story is not None:
            continue  # a stopped rank is not on a straggler leaderboard: said above
        say(f"**{name}** — {what}: " + ("none" if frame.height == 0 else f"{frame.height} row(s)"))
        if frame.height:
            table(frame)

# %% [markdown]
# ## 5. The decision and its reasons

# %%
if incident is None:
    say("No incident: nothing was decided." if decided.height == 0 else
        f"No incident in the analysis, but {decided.height} recorded decision(s):")
    if decided.height:
        table(decided.select("record", "status", "wall_ns", "incident", "action", "target", "outcome"))
elif detail.decisions.height == 0:
    say(f"**No decision was recorded for `{incident.id}`** (no `recovery/recovery-*.json` or "
        "`recovery/dry-run.json` names it).")
else:
    for d in detail.decisions.iter_rows(named=True):
        lines = [f"### {views.action_text(d['action'], d['target'])} — {d['status']} ({d['record']}, outcome: "
                 f"{d['outcome']})", "", "Path through the recovery gates:", ""]
        lines += [f"{n}. {w} (`{p}`)" for n, (w, p) in enumerate(zip(views.path_words(d["path"]), d["path"]), 1)]
        lines += ["", "Reasons:", ""] + [f"- {r}" for r in d["reasons"]]
        if d["checkpoint"]:
            lines += ["", f"Checkpoint: `{d['checkpoint']}`"]
        if d["comparability"]:
            lines += ["", f"Lineage verdict: **{d['comparability']}**"
                      + (f" (changed: {', '.join(d['changed'])})" if d["changed"] else "")]
        say("\n".join(lines))
    if story is not None:
        say(f"**Decision:** {story.decision}\n\n**Recovery:** {story.recovery}\n\n**Replayed:** "
            f"{story.replayed_text()}")

# %% [markdown]
# ## 6. Lineage and comparability

# %%
comp = views.comparability(RUN, incidents)
say(f"**{comp.line()}**")
if lineage.height:
    table(lineage.select("seq", "time_ns", "kind", "comparability", "reasons", "note", "attempt"), rows=100)
else:
    say("No lineage entries (`lineage.jsonl`) in the run.")
starts = events.filter(pl.col("kind") == str(EventKind.START)).group_by("attempt").agg(
    pl.col("wall_ns").min().alias("started_wall_ns"), pl.col("rank").n_unique().alias("ranks_started"))
ends = events.filter(pl.col("kind") == str(EventKind.EXIT)).group_by("attempt").agg(
    (pl.col("exit_code").fill_null(0) == 0).sum().alias("clean_exits"),
    (pl.col("exit_code").fill_null(0) != 0).sum().alias("abnormal_exits"))
kept = steps.group_by("attempt").agg(pl.col("step").min().alias("first_kept"), pl.col("step").max().alias("last_kept"))
attempts = starts.join(ends, on="attempt", how="full", coalesce=True).join(kept, on="attempt", how="full",
                                                                            coalesce=True).sort("attempt")
say("The attempts: when each started, how its ranks exited, and the steps of the final trajectory it trained "
    "(a step replayed later counts for the attempt that trained it last):")
table(attempts.select("attempt", "started_wall_ns", "ranks_started", "clean_exits", "abnormal_exits", "first_kept",
                      "last_kept"))
say(f"{attempts.height} attempt(s); {replayed_text}.")
if replays:
    table(pl.DataFrame(replays))

# %% [markdown]
# ## 7. What to check next

# %%
todo = []
if store.stale():
    todo.append("The telemetry grew since the views were built: rerun `rankwatch analyze` before trusting this.")
todo += [f"Analysis warning: {w}" for w in summary.warnings]
todo += [f"`{r['id']}` is {r['state']}: {r['next_step']}." for r in pending.iter_rows(named=True)]
if incident is None:
    lb = store.frame("leaderboard")
    if lb.height and lb["score"][0] is not None and lb["score"][0] > 1.05:
        todo.append(f"No incident, but rank {lb['rank'][0]} computes {lb['score'][0] - 1:.0%} slower than its "
                    f"stage median: watch it in the next run.")
else:
    if incident.device_fault:
        todo.append(f"Device {incident.subject.id}: hardware evidence ({', '.join(map(str, incident.hardware))}); "
                    "check it with the vendor's diagnostics before it rejoins the job.")
    if str(incident.cause) == "unknown":
        g = detail.gpu.filter(pl.col("who") == "subject")
        gpu_note = ("; its GPU looks like the median GPU" if g.height and all(
            abs((v or 1.0) - 1.0) < 0.03 for v in g["clock_vs_peers"].to_list()) else "")
        todo.append(f"The cause of `{incident.id}` is not established{gpu_note}: look at what the telemetry does "
                    f"not record for rank(s) {', '.join(map(str, incident.ranks))} (host CPU load, other "
                    "processes, the input pipeline).")
    for r in detail.links.filter(pl.col("vs_median_link") < 0.8).iter_rows(named=True):
        todo.append(f"Link {r['link']} ({r['kind']}) runs at {r['vs_median_link']:.0%} of the median link.")
    if detail.fingerprints.height:
        todo.append(f"{detail.fingerprints.height} fingerprint(s) disagree: check the state saved at or after step "
                    f"{incident.last_good_step if incident.last_good_step is not None else incident.onset_step}.")
    others = [i.id for i in incidents if i.id != incident.id]
    if others:
        todo.append(f"{len(others)} other incident(s), each in the table of section 2: {', '.join(others)}; "
                    "`--incident ID` tells one in full.")
failed_ck = store.frame("checkpoints").filter(~pl.col("ok"))
if failed_ck.height:
    todo.append(f"Checkpoint phases that failed: {', '.join(sorted(set(failed_ck['checkpoint_id'])))}.")
if behind.height:
    todo.append(f"{behind.height} rank(s) stopped before step {summary.last_step}: "
                f"{', '.join(map(str, behind['rank']))}.")
if not comp.bitwise:
    todo.append(f"The trajectory changed ({comp.line()}): compare its loss against a clean run before "
                "comparing results.")
if summary.goodput < 0.9:
    todo.append(f"Goodput was {summary.goodput:.1%}: {views.duration(summary.wall_s - summary.effective_s)} of "
                f"{views.duration(summary.wall_s)} went to lost or replayed steps, restarts and stalls.")
if not quarantined.is_empty():
    todo.append(f"Quarantined: {', '.join(f'{k} {i}' for k, i in quarantined.select('kind', 'id').iter_rows())}.")
say(("\n".join(f"- {t}" for t in todo) if todo else "Nothing further to check.") + f"\n\n#### Verdict\n\n{VERDICT}")
