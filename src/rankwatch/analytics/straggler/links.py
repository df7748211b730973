"""Slow links: an inter-host link whose crossing groups transfer slower than the other groups of their kind (point to
point sends and ring collectives), judged step by step."""

from __future__ import annotations

import math
from dataclasses import replace

import polars as pl

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.straggler.config import StragglerConfig, _GROUP, _KIND, _LINKS, _R, _RANKS, _S, _TRANSFER_NS
from rankwatch.base.schema import Steps, Topology


def _slow_links(frames: Frames, config: StragglerConfig) -> list[Incident]:
    """Slow inter-host links: first those point-to-point traffic pins down exactly (a send/recv pair crosses one
    link), then those the ring collectives point to (a ring crosses several links at once)."""
    exact = _slow_p2p_links(frames, config)
    return exact + _slow_ring_links(frames, config, known={i.subject.id for i in exact})


def _transfer_jitter(df: pl.DataFrame, key: str) -> float:
    """Robust step-to-step spread of log transfer time within each `key` (1.4826 x MAD)."""
    j = df.with_columns((pl.col(_TRANSFER_NS) / pl.col(_TRANSFER_NS).rolling_median(9, min_samples=1, center=True)
                         .over(key)).log().alias("j")).get_column("j")
    mad = (j - j.median()).abs().median()
    return 1.4826 * float(mad) if isinstance(mad, (int, float)) else 0.0


def _slow_p2p_links(frames: Frames, config: StragglerConfig) -> list[Incident]:
    """Links whose point-to-point transfers (per byte) are persistently slower than the other links'."""
    lk = frames.links.filter((pl.col(_KIND) == "pp") & (pl.col(_TRANSFER_NS) > 0) & (pl.col("bytes") > 0))
    if lk.get_column("link").n_unique() < 2:
        return []
    g = (
        lk.with_columns((pl.col(_TRANSFER_NS).cast(pl.Float64) * pl.col("ops") / pl.col("bytes")).alias("_nspb"))
        .with_columns((pl.col("_nspb") / pl.col("_nspb").quantile(0.25, "nearest").over(_S)).alias("q"))
        .sort("link", _S)
        .with_columns(pl.col("q").rolling_median(config.link_window, min_samples=config.link_window)
                      .over("link").alias("qs"))
    )
    excess = config.link_excess * max(1.0, _transfer_jitter(g, "link") / config.nominal_transfer_noise)
    slow = (g.filter(pl.col("qs") > 1 + excess).group_by("link")
            .agg(pl.col(_S).min().alias("first"), pl.col("qs").median().alias("ratio"), pl.len().alias("n"))
            .join(g.group_by("link").agg(pl.len().alias("total")), on="link")
            .filter(pl.col("n") >= pl.max_horizontal(pl.lit(config.link_window), 0.2 * pl.col("total"))))
    out: list[Incident] = []
    hosts = frames.topology.select(_R, Topology.HOST.value)
    for link, first, ratio in slow.sort("link").select("link", "first", "ratio").iter_rows():
        ends = str(link).split("<->")
        ranks = hosts.filter(pl.col(Topology.HOST.value).is_in(ends)).get_column(_R).sort().to_list()
        rows = g.filter(pl.col("link") == link)
        onset = int(first) - config.link_window + 1
        up = rows.filter((pl.col(_S) >= onset) & (pl.col("q") > 1 + excess))
        onset = int(up.get_column(_S).min()) if up.height else int(first)  # type: ignore[arg-type]
        wall = frames.steps.filter(pl.col(_S) == first).get_column(Steps.END_WALL_NS.value).max()
        out.append(Incident(
            klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.LINK, id=str(link)), ranks=tuple(ranks),
            onset_step=onset, detection_step=int(first),
            detection_wall_ns=int(wall) if wall is not None else None,  # type: ignore[arg-type]
            confidence=min(0.99, 0.6 + 0.39 * math.tanh((float(ratio) - 1) / (2 * excess))), cause=Cause.SLOW_LINK,
            summary=f"link {link}: point-to-point transfers across it take {float(ratio):.2f}x the time per byte of "
                    "the other links' from step " + str(onset),
            fields=("transfer_ns",),
            evidence=(Evidence(
                source="links", summary="per-step point-to-point transfer time per byte against the other links",
                columns=("link", "step", "transfer_ns", "bytes", "ratio"),
                rows=tuple((str(a), int(st), int(t), int(b), round(float(q), 3)) for a, st, t, b, q in
                           rows.filter(pl.col(_S) >= onset).select("link", _S, _TRANSFER_NS, "bytes", "q")
                           .head(20).iter_rows()),
            ),),
        ))
    return out


def _slow_ring_links(frames: Frames, config: StragglerConfig, *, known: set[str]) -> list[Incident]:
    """Links whose crossing groups are persistently slower than the other groups of the same kind."""
    gt, groups = frames.group_transfer, frames.groups
    if gt.height == 0 or groups.height == 0:
        return []
    # Baseline: the lower quartile of the kind's groups at that step, not the median, because on a small job a slow
    # link can slow half of a kind's groups (two of four data-parallel rings) and drag the median with it.
    # Groups are compared per byte (stages hold different parameter counts, so their rings move different sizes)
    # and only with groups of their kind that also cross hosts (an intra-host ring is faster by design).
    crosses = groups.select(_GROUP, (pl.col(_LINKS).list.len() > 0).alias("_x"))
    g = (
        gt.filter((pl.col(_TRANSFER_NS) > 0) & (pl.col("bytes") > 0))
        .join(crosses, on=_GROUP, how="left")
        .with_columns((pl.col(_TRANSFER_NS).cast(pl.Float64) * pl.col("ops") / pl.col("bytes")).alias("_nspb"))
        .with_columns((pl.col("_nspb") / pl.col("_nspb").quantile(0.25, "nearest").over(_KIND, "_x", _S)).alias("q"))
        .sort(_GROUP, _S)
    )
    g = _own_history(g, config.baseline_steps).with_columns(
        pl.max_horizontal("q", "q_own").alias("q")).with_columns(
        pl.col("q").rolling_median(config.link_window, min_samples=config.link_window).over(_GROUP).alias("qs"))
    # Step-to-step spread of each group's own log transfer time: how noisy transfers are on this job.
    excess = config.link_excess * max(1.0, _transfer_jitter(g, _GROUP) / config.nominal_transfer_noise)
    config = replace(config, link_excess=excess)
    slow_steps = g.filter(pl.col("qs") > 1 + config.link_excess)
    if slow_steps.height == 0:
        return []
    slow_groups = slow_steps.group_by(_GROUP).agg(pl.col(_S).min().alias("first"), pl.col("qs").median().alias("q"),
                                                  pl.len().alias("n"))
    # A group is slow when it is slow for a sizeable part of the steps it reports (an on-off link: in episodes
    # adding up to a tenth of the run), not once.
    reports = g.group_by(_GROUP).agg(pl.len().alias("total"))
    slow_groups = slow_groups.join(reports, on=_GROUP).filter(pl.col("n") >= pl.max_horizontal(
        pl.lit(config.link_window), 0.1 * pl.col("total")))
    if slow_groups.height == 0:
        return []
    present = groups.filter(pl.col(_GROUP).is_in(g.get_column(_GROUP).unique().implode()))
    pairs = present.select(_GROUP, _KIND, _LINKS).explode(_LINKS).drop_nulls(_LINKS)
    slow_set = set(slow_groups.get_column(_GROUP).to_list())
    pairs = pairs.with_columns(pl.col(_GROUP).is_in(sorted(slow_set)).alias("slow"))
    # "The other groups of their kind" are the kind's groups that cross some link (see the baseline above).
    crossing_any = present.filter(pl.col(_LINKS).list.len() > 0)
    per_link = (
        pairs.group_by(_LINKS, _KIND).agg(pl.len().alias("cross"), pl.col("slow").sum().alias("cross_slow"))
        .group_by(_LINKS).agg(pl.col("cross").sum(), pl.col("cross_slow").sum(), pl.col(_KIND))
        .filter(pl.col("cross_slow") >= 0.8 * pl.col("cross"))
    )
    crossing_of = {str(k): set(v) for k, v in pairs.group_by(_LINKS).agg(pl.col(_GROUP)).iter_rows()}
    # A link is one physical thing: while it is slow every group crossing it is slow at the same steps (an on-off
    # link too), and the other groups of their kinds are not. Noise (a preempted rank, a busy host) slows groups one
    # at a time at steps of their own, and a group slow by noise for a tenth of the run is common on a crowded host.
    # So the rule is judged step by step: the link's slow steps are those where at least 80 % of its crossing groups
    # are slow; it needs as many as a slow group needs slow steps, and on them the share of its slow crossing groups
    # must exceed the share of slow other groups of their kinds by more than one half.
    flags = g.filter(pl.col("qs").is_not_null()).select(_GROUP, _S, (pl.col("qs") > 1 + config.link_excess).alias("slow"))
    kind_of = dict(crossing_any.select(_GROUP, _KIND).iter_rows())
    scored: list[tuple[str, int, int, float, int]] = []
    for link, cross, cross_slow, kinds in per_link.select(_LINKS, "cross", "cross_slow", _KIND).iter_rows():
        crossing = crossing_of[str(link)]
        others = {grp for grp, k in kind_of.items() if k in set(kinds) and grp not in crossing}
        per_step = (
            flags.filter(pl.col(_GROUP).is_in(sorted(crossing | others)))
            .with_columns(pl.col(_GROUP).is_in(sorted(crossing)).alias("_c"))
            .group_by(_S).agg(pl.col("slow").filter(pl.col("_c")).mean().alias("fc"),
                              pl.col("slow").filter(~pl.col("_c")).mean().fill_null(0.0).alias("fo"))
            .drop_nulls("fc")
        )
        joint = per_step.filter(pl.col("fc") >= 0.8)
        if joint.height < max(config.link_window, 0.1 * per_step.height):
            continue
        score = float((joint.get_column("fc") - joint.get_column("fo")).mean())  # type: ignore[arg-type]
        if score > 0.5:
            scored.append((str(link), int(cross), int(cross_slow), score, int(joint.get_column(_S).min())))  # type: ignore[arg-type]
    scored.sort(key=lambda r: (-r[3], -r[2], r[0]))
    out: list[Incident] = []
    # Groups that cross a link already found exactly are explained by it.
    explained: set[str] = {grp for link in known for grp in crossing_of.get(link, ())}
    for link, cross, cross_slow, score, det in scored:
        crossing = crossing_of[link]
        newly = (crossing & slow_set) - explained
        if not newly:
            continue
        explained |= crossing & slow_set
        # A ring crosses several links; links crossed by exactly the same groups cannot be told apart.
        tied = sorted(other for other, gs in crossing_of.items() if gs == crossing and other != link)
        members = sorted({int(r) for rs in present.filter(pl.col(_GROUP).is_in(sorted(crossing)))
                         .get_column(_RANKS).to_list() for r in rs})
        sg = slow_groups.filter(pl.col(_GROUP).is_in(sorted(crossing)))
        # Detected at the link's first slow step (a trailing rolling median: up to a window after the onset); the
        # onset is the first step from a window before it where the crossing groups' median ratio is above the bar.
        onset = max(det - config.link_window + 1, int(g.get_column(_S).min()))  # type: ignore[arg-type]
        onset = _first_slow(g, sorted(crossing), onset, config)
        ratio = float(sg.get_column("q").median())  # type: ignore[arg-type]
        wall = frames.steps.filter(pl.col(_S) == det).get_column(Steps.END_WALL_NS.value).max()
        ev_rows = g.filter(pl.col(_GROUP).is_in(sorted(crossing)) & (pl.col(_S) >= onset)).sort(_S, _GROUP).head(20)
        out.append(Incident(
            # Links the data cannot tell apart are named together ('a<->b | c<->d'): one of them is slow.
            klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.LINK, id=" | ".join(sorted([str(link), *tied]))),
            ranks=tuple(members), onset_step=onset, detection_step=det, detection_wall_ns=int(wall) if wall is not None else None,  # type: ignore[arg-type]
            confidence=min(0.99 if not tied else 0.5,
                           0.5 + 0.45 * float(score) * min(1.0, (ratio - 1) / (2 * config.link_excess))),
            cause=Cause.SLOW_LINK,
            summary=f"link {link}: {cross_slow} of the {cross} groups crossing it transfer {ratio:.2f}x slower than "
                    "the other groups of their kind"
                    + (f"; the same groups also cross {', '.join(tied)}, which the data cannot tell apart from it"
                       if tied else ""),
            fields=("transfer_ns",),
            evidence=(Evidence(
                source="group_transfer",
                summary="per-step transfer time of groups crossing the link against the median of their kind",
                columns=("group", "kind", "step", "transfer_ns", "ratio"),
                rows=tuple((str(a), str(b), int(s), int(t), round(float(q), 3)) for a, b, s, t, q in
                           ev_rows.select(_GROUP, _KIND, _S, _TRANSFER_NS, "q").iter_rows()),
            ),),
        ))
    return out


def _own_history(g: pl.DataFrame, baseline_steps: int) -> pl.DataFrame:
    """`g` with `q_own`: each group's transfer time per byte against its own baseline (the lower of the median of
    its first `baseline_steps` steps and its lower quartile over the run), divided by the job-wide factor of the
    step (the median of that ratio over every group: a network hiccup slows every group at once, a slow link only
    those crossing it). It finds a slow link that every group of a kind crosses (a ring spanning all hosts), where
    comparing the kind's groups with each other cannot."""
    base = g.group_by(_GROUP).agg(pl.min_horizontal(pl.col("_nspb").head(baseline_steps).median(),
                                                    pl.col("_nspb").quantile(0.25, "nearest")).alias("_base"))
    g = g.join(base, on=_GROUP, how="left").with_columns((pl.col("_nspb") / pl.col("_base")).alias("_qh"))
    job = g.group_by(_S).agg(pl.col("_qh").median().alias("_h"), pl.len().alias("_hn"))
    return (g.join(job, on=_S, how="left")
            .with_columns((pl.col("_qh") / pl.when(pl.col("_hn") >= 3).then(pl.col("_h")).otherwise(1.0)).alias("q_own"))
            .drop("_base", "_qh", "_h", "_hn").sort(_GROUP, _S))


def _first_slow(g: pl.DataFrame, groups: list[str], lo: int, config: StragglerConfig) -> int:
    """First step at or after `lo` where the crossing groups' median transfer ratio is above the threshold."""
    per = (g.filter(pl.col(_GROUP).is_in(groups) & (pl.col(_S) >= lo)).group_by(_S).agg(pl.col("q").median())
           .filter(pl.col("q") > 1 + config.link_excess))
    return int(per.get_column(_S).min()) if per.height else lo  # type: ignore[arg-type]
