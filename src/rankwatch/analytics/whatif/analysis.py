"""What the job lost, and to whom: the what-if analysis over a replayed step graph (`graph.replay`).

Definitions (after Lin et al., "Understanding Stragglers in Large Model Training Using What-if Analysis", OSDI '25):

* T: the replay with every duration as measured; T_ideal: with every duration replaced by its ideal (the peers'
  median for the same operation, `Graph.ideal_work` / `ideal_transfer`). The job's slowdown S = T / T_ideal.
* For a subject X (a rank, a pipeline stage, a kind of work, a collective op, a group): S_X = T(X as measured, the
  rest ideal) / T_ideal, the slowdown X alone causes; and what fixing X saves, T - T(X ideal, the rest as
  measured), as a share of T.
* Stage partitioning: T_ideal against T_ideal with each stage's compute scaled to the mean stage's (the work
  re-partitioned evenly), as a share of T; a whole stage slower than the others is no single worker's issue and
  no median over the stage's own ranks removes it (and a straggler, made ideal first, does not pass for one).
* Rotation: in how many steps the rank with the most own work over its stage's median was the same rank. One
  worker's issue keeps the same rank last; random per-step imbalance across replicas (data skew) changes it
  step to step, and its cost is spread over the ranks.

`fidelity` = T / the window's measured span (the slowest rank's first step start to last step end): near 1 when
the graph holds what the run did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.analytics.whatif.graph import Graph, Instance, Work, replay

__all__ = ["Share", "WhatIf", "analyze_graph"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Share:
    subject: str
    """'rank:3', 'stage:1', 'kind:compute', 'op:all_reduce', 'group:dp.pp0.tp0'."""
    slowdown: float
    """S_X: the job's slowdown with only X as measured."""
    saved_ns: float
    """What making X ideal saves the job (T - T with X ideal)."""
    saved_share: float
    """`saved_ns` / T."""

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "slowdown": round(self.slowdown, 4), "saved_ms": round(self.saved_ns / 1e6, 3),
                "saved_share": round(self.saved_share, 4)}


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIf:
    attempt: int | None
    first_step: int
    last_step: int
    ranks: int
    measured_ns: float
    actual_ns: float
    """T: the replay with the measured durations."""
    ideal_ns: float
    by_rank: tuple[Share, ...]
    by_stage: tuple[Share, ...]
    by_kind: tuple[Share, ...]
    by_op: tuple[Share, ...]
    by_group: tuple[Share, ...]
    stage_partition: Share | None
    """Saving of an even re-partition of the stages' compute (pipelines only)."""
    last_rank: tuple[int, float] | None
    """(the rank most often with the most own work over its stage's median, the share of steps it was)."""
    warnings: tuple[str, ...] = field(default=())

    @property
    def slowdown(self) -> float:
        return self.actual_ns / self.ideal_ns if self.ideal_ns > 0 else 1.0

    @property
    def fidelity(self) -> float:
        return self.actual_ns / self.measured_ns if self.measured_ns > 0 else float("nan")

    @property
    def lost_share(self) -> float:
        """The share of T the job lost to slowness: 1 - T_ideal / T."""
        return 1.0 - self.ideal_ns / self.actual_ns if self.actual_ns > 0 else 0.0

    def describe(self) -> list[str]:
        head = (f"steps {self.first_step}..{self.last_step}"
                + (f" of attempt {self.attempt}" if self.attempt is not None else "") + f", {self.ranks} ranks: "
                f"S = {self.slowdown:.3f} (T {self.actual_ns / 1e6:.1f} ms replayed, {self.measured_ns / 1e6:.1f} ms "
                f"measured, ideal {self.ideal_ns / 1e6:.1f} ms; {self.lost_share:.1%} of the time lost to slowness)")
        lines = [head]
        for title, shares in (("rank", self.by_rank), ("stage", self.by_stage), ("kind", self.by_kind),
                              ("op", self.by_op), ("group", self.by_group)):
            top = [s for s in shares if s.saved_share >= 0.005][:4]
            if top:
                lines.append(f"  by {title}: " + "; ".join(
                    f"{s.subject} S={s.slowdown:.3f}, fixing it saves {s.saved_share:.1%}" for s in top))
        if self.stage_partition is not None and self.stage_partition.saved_share >= 0.005:
            lines.append(f"  stage partitioning: evening out the stages' compute saves "
                         f"{self.stage_partition.saved_share:.1%}")
        if self.last_rank is not None:
            rank, share = self.last_rank
            lines.append(f"  the rank with the most own work over its peers: rank {rank} in {share:.0%} of steps")
        lines += [f"  warning: {w}" for w in self.warnings]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt, "first_step": self.first_step, "last_step": self.last_step, "ranks": self.ranks,
            "slowdown": round(self.slowdown, 4), "lost_share": round(self.lost_share, 4),
            "measured_ms": round(self.measured_ns / 1e6, 3), "replayed_ms": round(self.actual_ns / 1e6, 3),
            "ideal_ms": round(self.ideal_ns / 1e6, 3), "fidelity": round(self.fidelity, 4),
            "by_rank": [s.to_dict() for s in self.by_rank], "by_stage": [s.to_dict() for s in self.by_stage],
            "by_kind": [s.to_dict() for s in self.by_kind], "by_op": [s.to_dict() for s in self.by_op],
            "by_group": [s.to_dict() for s in self.by_group],
            "stage_partition": self.stage_partition.to_dict() if self.stage_partition is not None else None,
            "last_rank": ({"rank": self.last_rank[0], "share_of_steps": round(self.last_rank[1], 4)}
                          if self.last_rank is not None else None),
            "warnings": list(self.warnings),
        }


def analyze_graph(graph: Graph, *, stage_of: Mapping[int, int], measured_ns: float, first_step: int, last_step: int,
                  attempt: int | None = None, warnings: Sequence[str] = ()) -> WhatIf:
    """The what-if of a built graph (module docstring). Pure."""
    actual_w, actual_t = graph.work_ns, graph.transfer_ns
    ideal_w, ideal_t = graph.ideal_work(), graph.ideal_transfer()
    owner = np.empty(len(graph.work), dtype=np.int64)
    for rank, program in graph.programs.items():
        for item in program:
            if isinstance(item, Work):
                owner[item.id] = rank

    def makespan(keep_w: np.ndarray, keep_t: np.ndarray) -> float:
        return replay(graph, np.where(keep_w, actual_w, ideal_w), np.where(keep_t, actual_t, ideal_t)).makespan_ns

    all_w, no_w = np.ones(len(actual_w), bool), np.zeros(len(actual_w), bool)
    all_t, no_t = np.ones(len(actual_t), bool), np.zeros(len(actual_t), bool)
    t_actual = makespan(all_w, all_t)
    t_ideal = makespan(no_w, no_t)

    def share(subject: str, work: np.ndarray, transfer: np.ndarray) -> Share:
        alone = makespan(work, transfer)
        fixed = makespan(~work, ~transfer)
        saved = t_actual - fixed
        return Share(subject=subject, slowdown=alone / t_ideal if t_ideal > 0 else 1.0, saved_ns=saved,
                     saved_share=saved / t_actual if t_actual > 0 else 0.0)

    def ranked(shares: list[Share]) -> tuple[Share, ...]:
        return tuple(sorted(shares, key=lambda s: (-s.saved_ns, s.subject)))

    def by(items: Sequence[Work] | Sequence[Instance], name: Callable[[Any], str], is_work: bool) -> tuple[Share, ...]:
        groups: dict[str, list[int]] = {}
        for x in items:
            groups.setdefault(name(x), []).append(x.id)
        out = []
        for subject, ids in groups.items():
            w, t = no_w.copy(), no_t.copy()
            (w if is_work else t)[ids] = True
            out.append(share(subject, w, t))
        return ranked(out)

    by_rank = ranked([share(f"rank:{r}", owner == r, no_t) for r in sorted(graph.programs)])
    stages = sorted(set(stage_of.values()))
    by_stage = ranked([share(f"stage:{s}", np.isin(owner, [r for r, st in stage_of.items() if st == s]), no_t)
                       for s in stages]) if len(stages) > 1 else ()
    by_kind = by(graph.work, lambda w: f"kind:{w.kind}", True)
    by_op = by(graph.instances, lambda i: f"op:{i.op}", False)
    by_group = by(graph.instances, lambda i: f"group:{i.group}", False)
    partition = (_stage_partition(graph, owner, stage_of, ideal_w, ideal_t, t_ideal, t_actual)
                 if len(stages) > 1 else None)
    return WhatIf(attempt=attempt, first_step=first_step, last_step=last_step, ranks=len(graph.programs),
                  measured_ns=measured_ns, actual_ns=t_actual, ideal_ns=t_ideal, by_rank=by_rank, by_stage=by_stage,
                  by_kind=by_kind, by_op=by_op, by_group=by_group, stage_partition=partition,
                  last_rank=_last_rank(graph, owner, stage_of), warnings=tuple(warnings))


def _stage_partition(graph: Graph, owner: np.ndarray, stage_of: Mapping[int, int], ideal_w: np.ndarray,
                     ideal_t: np.ndarray, as_is: float, t_actual: float) -> Share:
    """The ideal run (no worker slower than its peers) against the same with each stage's compute scaled to the mean
    stage's (per rank of the stage): what partitioning alone costs, apart from any straggler (a slow rank makes its
    stage's measured compute look heavy; its stage's ideal does not)."""
    compute = np.array([w.kind == "compute" for w in graph.work])
    stage = np.array([stage_of[int(r)] for r in owner])
    per_stage = {s: ideal_w[compute & (stage == s)].sum() / max(1, sum(1 for st in stage_of.values() if st == s))
                 for s in set(stage_of.values())}
    mean = float(np.mean(list(per_stage.values())))
    scaled = ideal_w.copy()
    for s, total in per_stage.items():
        if total > 0:
            mask = compute & (stage == s)
            scaled[mask] *= mean / total
    balanced = replay(graph, scaled, ideal_t).makespan_ns
    saved = as_is - balanced
    return Share(subject="stage_partition", slowdown=as_is / balanced if balanced > 0 else 1.0, saved_ns=saved,
                 saved_share=saved / t_actual if t_actual > 0 else 0.0)


def _last_rank(graph: Graph, owner: np.ndarray, stage_of: Mapping[int, int]) -> tuple[int, float] | None:
    """The rank most often with the most own work (compute and dataloader) over its stage's median in a step."""
    own: dict[tuple[int, int], float] = {}
    for w in graph.work:
        if w.kind in ("compute", "dataloader"):
            key = (int(owner[w.id]), w.step)
            own[key] = own.get(key, 0.0) + float(graph.work_ns[w.id])
    steps = sorted({s for _, s in own})
    if not steps:
        return None
    winners: Counter[int] = Counter()
    for s in steps:
        excess: dict[int, float] = {}
        for st in set(stage_of.values()):
            ranks = [r for r in graph.programs if stage_of.get(r) == st and (r, s) in own]
            if not ranks:
                continue
            median = float(np.median([own[(r, s)] for r in ranks]))
            for r in ranks:
                excess[r] = own[(r, s)] - median
        if excess:
            winners[max(excess, key=lambda r: (excess[r], -r))] += 1
    rank, count = winners.most_common(1)[0]
    return rank, count / len(steps)
