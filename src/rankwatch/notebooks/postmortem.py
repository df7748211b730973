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
# Rebuilt from the run's own data through `rankwatch.analytics.views`: the run at a glance, the incident
# timeline, one incident and the evidence behind it, the recovery decision and its path through the gates, the
# lineage and whether the trajectory stayed comparable, and what to check next.
#
# Run it with `rankwatch postmortem RUN_DIR [--incident ID] --out report.ipynb [--html report.html]`, or set
# `run_dir` below and run it in Jupyter.

# %% tags=["parameters"]
run_dir = ""
incident_id = None

# %%
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle
import polars as pl
from IPython.display import Markdown, display

from rankwatch.analytics import views

from rankwatch.analytics.analyze import ensure_views
from rankwatch.analytics.incidents import sort_incidents

pl.Config.set_tbl_rows(30)
pl.Config.set_fmt_str_lengths(120)
pl.Config.set_tbl_width_chars(200)


def show(fig):
    """Display a figure as an image output and release it."""
    fig.tight_layout()
    display(fig)
    plt.close(fig)


def say(text):
    display(Markdown(text))


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
table = views.incident_table(incidents, decided, summary.start_wall_ns)
steps = store.frame("rank_steps")
progress = store.frame("progress")

# %% [markdown]
# ## 1. The run at a glance

# %%
layout = " x ".join(f"{k}={v}" for k, v in summary.layout.items()) or "unknown"
glance = pl.DataFrame({
    "what": ["run", "ranks", "layout", "hosts", "steps", "clock", "wall time", "effective training time",
             "goodput", "steps per second", "incidents", "decisions recorded", "lineage entries", "quarantined",
             "views"],
    "value": [str(RUN), str(summary.ranks), layout, str(summary.hosts),
              f"{summary.first_step}..{summary.last_step}", summary.clock, f"{summary.wall_s:.1f} s",
              f"{summary.effective_s:.1f} s", f"{summary.goodput:.1%}", f"{summary.steps_per_s:.2f}",
              str(len(incidents)), str(decided.height), str(lineage.height), str(quarantined.height),
              "stale: the telemetry grew since they were built" if store.stale() else "current"],
})
display(glance)
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
display(store.frame("breakdown").describe())

# %% [markdown]
# ## 2. Incident timeline

# %%
tl = views.timeline(store, incidents, decided, lineage)
span = summary.wall_s * 1.05 + 1.0
inside = tl.filter(pl.col("t_s").is_between(-1.0, span))
after = tl.filter(~pl.col("t_s").is_between(-1.0, span) | pl.col("t_s").is_null())
kinds = sorted(set(inside["kind"].to_list()))
fig, ax = plt.subplots(figsize=(10, 0.5 * max(len(kinds), 2) + 1.5))
for y, kind in enumerate(kinds):
    pts = inside.filter(pl.col("kind") == kind)
    color = "tab:red" if kind == "incident" else ("tab:orange" if kind.startswith("decision") else None)
    ax.scatter(pts["t_s"], [y] * pts.height, s=40, color=color)
ax.set_yticks(range(len(kinds)), kinds)
ax.set_xlim(0, max(span, 1.0))
ax.set(xlabel="seconds since the run's first start", title="What happened to the run, in time")
show(fig)
display(tl.select("t_s", "kind", "what", "rank", "step", "attempt"))
if after.height:
    say(f"{after.height} entr{'y was' if after.height == 1 else 'ies were'} recorded outside the run's time span "
        f"(by the recovery manager or the lineage after the fact): {', '.join(sorted(set(after['kind'])))}.")
display(table)

# %% [markdown]
# ## 3. The incident

# %%
if incident_id is not None and incident_id not in found:
    raise ValueError(f"{RUN}: no incident {incident_id!r}; the run's incidents: {', '.join(found) or 'none'}")
incident = found[incident_id] if incident_id is not None else (incidents[0] if incidents else None)
if incident is None:
    say(f"**No incidents were found in this run.** {summary.ranks} ranks ran steps {summary.first_step}.."
        f"{summary.last_step} with {summary.goodput:.1%} goodput; the slowest ranks against their stage peers "
        "and the GPUs furthest from the median follow.")
    display(store.frame("leaderboard").head(5))
    gp = store.frame("gpu_peers")
    if gp.height:
        display(gp.sort((pl.col("clock_vs_peers") - 1).abs(), descending=True).head(5))
else:
    chosen = "chosen" if incident_id is not None else "the most consequential of the run's " f"{len(incidents)}"
    say(f"### `{incident.id}` ({chosen})\n\n"
        f"- **class:** {incident.klass}\n- **subject:** {incident.subject}\n"
        f"- **ranks:** {', '.join(map(str, incident.ranks)) or 'none'}\n"
        f"- **onset step:** {incident.onset_step}; **detected at step:** {incident.detection_step}"
        + (f"; last step seen sound: {incident.last_good_step}" if incident.last_good_step is not None else "")
        + f"\n- **confidence:** {incident.confidence:.2f}\n- **cause:** {incident.cause}\n"
        f"- **device fault:** {'yes: ' + ', '.join(map(str, incident.hardware)) if incident.device_fault else 'no'}\n"
        + (f"- **fields:** {', '.join(incident.fields)}\n" if incident.fields else "")
        + f"\n{incident.summary}")
    detail = views.incident_detail(store, incident, decided)

# %% [markdown]
# ## 4. Root-cause evidence

# %%
if incident is None:
    say("No incident: no root-cause evidence to show.")
else:
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
if incident is not None:
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
        every = max(1, wide.height // 16)
        ax.set_yticks([n + 0.5 for n in range(wide.height)][::every], [str(r) for r in ranks_lo][::every])
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
    else:
        say("No GPU telemetry for the subject ranks (no NVML on those hosts, or a subject without ranks).")
    display(g)

# %%
if incident is not None:
    for n, e in enumerate(incident.evidence, 1):
        say(f"**evidence {n} — `{e.source}`:** {e.summary}")
        if e.columns:
            display(pl.DataFrame([list(r) for r in e.rows], schema=list(e.columns), orient="row",
                                 strict=False))
    for name, frame, what in (
            ("arrivals", detail.arrivals, "the subject and its peers on the straggler leaderboard"),
            ("links", detail.links, "the inter-host links involved"),
            ("checkpoints", detail.checkpoints, "checkpoints around the onset"),
            ("fingerprints", detail.fingerprints, "fingerprints that disagree")):
        say(f"**{name}** — {what}: " + ("none" if frame.height == 0 else f"{frame.height} row(s)"))
        if frame.height:
            display(frame)

# %% [markdown]
# ## 5. The decision and its reasons

# %%
if incident is None:
    say("No incident: nothing was decided." if decided.height == 0 else
        f"No incident in the analysis, but {decided.height} recorded decision(s):")
    if decided.height:
        display(decided.select("record", "status", "incident", "action", "target", "outcome"))
elif detail.decisions.height == 0:
    say(f"**No decision was recorded for `{incident.id}`** (no `recovery/recovery-*.json` or "
        "`recovery/dry-run.json` names it).")
else:
    for d in detail.decisions.iter_rows(named=True):
        target = f" {d['target']}" if d["target"] else ""
        lines = [f"### {d['action']}{target} — {d['status']} ({d['record']}, outcome: {d['outcome']})", "",
                 "Path through the recovery gates:", ""]
        lines += [f"{n}. `{p}`" for n, p in enumerate(d["path"], 1)]
        lines += ["", "Reasons:", ""] + [f"- {r}" for r in d["reasons"]]
        if d["checkpoint"]:
            lines += ["", f"Checkpoint: `{d['checkpoint']}`"]
        if d["comparability"]:
            lines += ["", f"Lineage verdict: **{d['comparability']}**"
                      + (f" (changed: {', '.join(d['changed'])})" if d["changed"] else "")]
        say("\n".join(lines))

# %% [markdown]
# ## 6. Lineage and comparability

# %%
comp = views.comparability(RUN, incidents)
say(f"**{comp.line()}**")
if lineage.height:
    display(lineage.select("seq", "kind", "comparability", "reasons", "note", "attempt"))
else:
    say("No lineage entries (`lineage.jsonl`) in the run.")
attempts = steps.group_by("attempt").agg(pl.col("step").min().alias("first_step"),
                                         pl.col("step").max().alias("last_step"),
                                         pl.col("rank").n_unique().alias("ranks")).sort("attempt")
replayed = steps.group_by("rank", "step").agg(pl.col("attempt").n_unique().alias("n")).filter(pl.col("n") > 1)
display(attempts)
say(f"{attempts.height} attempt(s); "
    + (f"{replayed['step'].n_unique()} step(s) were trained more than once (replayed after a rollback)."
       if replayed.height else "no step was trained twice."))

# %% [markdown]
# ## 7. What to check next

# %%
todo = []
if store.stale():
    todo.append("The telemetry grew since the views were built: rerun `rankwatch analyze` before trusting this.")
todo += [f"Analysis warning: {w}" for w in summary.warnings]
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
    if detail.decisions.height == 0:
        todo.append(f"Nothing was decided for `{incident.id}`: run the recovery manager's plan on it.")
    elif (detail.decisions["status"] == "proposed").all():
        d = detail.decisions.row(-1, named=True)
        todo.append(f"The decision for `{incident.id}` ({d['action']}) was only proposed (a dry run): "
                    "apply it or record why not.")
    others = [i.id for i in incidents if i.id != incident.id]
    if others:
        todo.append(f"{len(others)} other incident(s): {', '.join(others)} — rerun with `--incident ID`.")
undecided = table.filter(pl.col("decision") == "none")
if undecided.height:
    todo.append(f"Undecided incidents: {', '.join(undecided['id'])}.")
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
    todo.append(f"Goodput was {summary.goodput:.1%}: {summary.wall_s - summary.effective_s:.1f} s of "
                f"{summary.wall_s:.1f} s went to lost or replayed steps, restarts and stalls.")
if not quarantined.is_empty():
    todo.append(f"Quarantined: {', '.join(f'{k} {i}' for k, i in quarantined.select('kind', 'id').iter_rows())}.")
say("\n".join(f"- {t}" for t in todo) if todo else "Nothing to check: the run was healthy and nothing is pending.")
