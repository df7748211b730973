"""What the job lost, and to whom: the what-if analysis over a replayed step graph (`graph.replay`).

Definitions (after Lin et al., "Understanding Stragglers in Large Model Training Using What-if Analysis", OSDI '25):

* T: the replay with every duration as measured; T_ideal: with every duration replaced by its ideal (the peers'
  median for the same operation, `Graph.ideal_work` / `ideal_transfer`). The job's slowdown S = T / T_ideal.
* For a subject X (a rank, a host, a pipeline stage, a kind of work, a collective op, a group): S_X = T(X as
  measured, the rest ideal) / T_ideal, the slowdown X alone causes; and what fixing X saves, T - T(X ideal, the
  rest as measured), as a share of T.
* A rank's (and a host's) part is its work and, of each transfer among members on one host, the share of the
  transfer's excess charged to it (`_charges`: no wire to blame there; a process that loses its CPU holds the
  ring). A transfer across hosts is its group's (a link). On device clocks (`Costing(shared_cpu=False)`) every
  transfer is its group's: GPUs on one host move data over their own links (NVLink, PCIe), not their processes'
  CPUs.
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
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.analytics.whatif.graph import Graph, Instance, Schedule, Work

__all__ = ["Costing", "Share", "Spec", "StepSavings", "WhatIf", "analyze_graph"]


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
    by_host: tuple[Share, ...]
    """Every rank of a host made ideal at once (jobs on several hosts)."""
    by_kind: tuple[Share, ...]
    by_op: tuple[Share, ...]
    by_group: tuple[Share, ...]
    stage_partition: Share | None
    """Saving of an even re-partition of the stages' compute (pipelines only)."""
    last_rank: tuple[int, float] | None
    """(the rank most often with the most own work over its stage's median, the share of steps it was)."""
    rotation: tuple[int, int] = (0, 0)
    """(how many different ranks had the most own work over their stage's median in some step, over how many
    steps): one worker's issue keeps it at one; random per-step imbalance spreads it over many."""
    step_ns: tuple[tuple[int, float], ...] = ()
    """(step, its replayed duration as measured), in step order: what an incident's span is measured against."""
    warnings: tuple[str, ...] = field(default=())
    clock: str = "cpu"
    """Whose clock the durations are: 'cpu' (each rank's training thread) or 'device' (its GPU's, a CUDA run:
    the CPU's times there are enqueueing)."""

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
                f"measured on the {self.clock} clock, ideal {self.ideal_ns / 1e6:.1f} ms; {self.lost_share:.1%} of the time lost to slowness)")
        lines = [head]
        for title, shares in (("rank", self.by_rank), ("stage", self.by_stage), ("host", self.by_host),
                              ("kind", self.by_kind),
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
            "clock": self.clock, "slowdown": round(self.slowdown, 4), "lost_share": round(self.lost_share, 4),
            "measured_ms": round(self.measured_ns / 1e6, 3), "replayed_ms": round(self.actual_ns / 1e6, 3),
            "ideal_ms": round(self.ideal_ns / 1e6, 3), "fidelity": round(self.fidelity, 4),
            "by_rank": [s.to_dict() for s in self.by_rank], "by_stage": [s.to_dict() for s in self.by_stage],
            "by_host": [s.to_dict() for s in self.by_host],
            "by_kind": [s.to_dict() for s in self.by_kind], "by_op": [s.to_dict() for s in self.by_op],
            "by_group": [s.to_dict() for s in self.by_group],
            "stage_partition": self.stage_partition.to_dict() if self.stage_partition is not None else None,
            "last_rank": ({"rank": self.last_rank[0], "share_of_steps": round(self.last_rank[1], 4)}
                          if self.last_rank is not None else None),
            "ranks_ever_last": self.rotation[0],
            "warnings": list(self.warnings),
        }


Spec = tuple[str, np.ndarray, np.ndarray]
"""A subject to cost: its name, which work items it fixes (bool per work item), and what share of each transfer's
excess (0..1 per instance)."""


@dataclass(frozen=True, slots=True)
class StepSavings:
    """What making each of some subjects ideal saved, step by step over the window: summed over the steps, a
    subject's `Share.saved_ns` (what a step saves may show in the next: a rank's work overlaps its step's end)."""

    steps: tuple[int, ...]
    step_ns: np.ndarray
    """(S,) each step's replayed duration as measured."""
    saved_ns: np.ndarray
    """(S, K) what making subject k ideal saved in each step."""


def _durations(ends: np.ndarray) -> np.ndarray:
    """Per step, its end less the previous step's end (the first: less 0): (S, K) ends to (S, K) durations."""
    return np.diff(ends, axis=0, prepend=np.zeros((1, ends.shape[1]))) if len(ends) else ends


_BATCH = 64
"""Duration sets replayed together (memory: work items x this many floats)."""


class Costing:
    """What making any part of a replayed window ideal saves: the graph with its measured and ideal durations, its
    replay schedule (compiled once), and replays on demand, batched (two per subject). `analyze_graph` asks it for
    the standard subjects; an incident's impact (`analytics.impact`) for the incident's own (its ranks, its link's
    groups). Pure."""

    def __init__(self, graph: Graph, *, stage_of: Mapping[int, int], host_of: Mapping[int, str] | None = None,
                 shared_cpu: bool = True) -> None:
        """`shared_cpu`: a transfer among ranks of one host runs on their CPUs (CPU timing: its excess is charged to
        a member showing lost CPU, `_charges`); False on device clocks, where it is the group's."""
        self.graph = graph
        self.schedule = Schedule.of(graph)
        self.stage_of = dict(stage_of)
        self.host_of = dict(host_of or {})
        size = Counter(self.stage_of.get(r) for r in graph.programs)
        self.alone = frozenset(r for r in graph.programs if size[self.stage_of.get(r)] == 1)
        """Ranks that are their stage's only rank: no peer does their work, so their ideal is their own (a pipeline
        of one replica without tensor parallelism): making one ideal saves nothing by construction, not by
        measurement."""
        self.actual_w, self.actual_t = graph.work_ns, graph.transfer_ns
        self.ideal_w, self.ideal_t = graph.ideal_work(), graph.ideal_transfer()
        self.owner = np.empty(len(graph.work), dtype=np.int64)
        for rank, program in graph.programs.items():
            for item in program:
                if isinstance(item, Work):
                    self.owner[item.id] = rank
        self.own = np.array([w.kind in _OWN_KINDS for w in graph.work], dtype=bool)
        excess_w = np.maximum(0.0, self.actual_w - self.ideal_w)
        self.own_excess = {r: float(excess_w[self.own & (self.owner == r)].sum()) for r in graph.programs}
        self.charges = _charges(graph, self.own_excess, self.host_of) if shared_cpu else {}
        self.delta_t = self.actual_t - self.ideal_t
        t, steps = self.schedule.evaluate(np.stack([self.actual_w, self.ideal_w], axis=1),
                                          np.stack([self.actual_t, self.ideal_t], axis=1))
        span = t.max(axis=0) if len(t) else np.zeros(2)
        self.actual_ns, self.ideal_ns = float(span[0]), float(span[1])
        self.step_end_ns = {s: float(v[0]) for s, v in steps.items()}
        """When each step ended in the replay as measured."""
        self.steps = tuple(sorted(steps))
        self.step_ns = np.diff(np.array([steps[s][0] for s in self.steps], dtype=float), prepend=0.0)
        """Each step's replayed duration as measured (its end less the previous step's end), in `steps` order."""

    def makespans(self, durations: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        """The replayed makespan of each (work, transfer) duration set, `_BATCH` at a time."""
        return self._replay(durations)[0]

    def _replay(self, durations: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[list[float], np.ndarray]:
        """Each duration set's makespan and its steps' ends ((steps, sets), the steps in `steps` order)."""
        out: list[float] = []
        ends: list[np.ndarray] = []
        for lo in range(0, len(durations), _BATCH):
            chunk = durations[lo: lo + _BATCH]
            t, steps = self.schedule.evaluate(np.stack([w for w, _ in chunk], axis=1),
                                              np.stack([x for _, x in chunk], axis=1))
            out.extend(float(v) for v in (t.max(axis=0) if len(t) else np.zeros(len(chunk))))
            ends.append(np.stack([steps[s] for s in self.steps]) if self.steps
                        else np.zeros((0, len(chunk))))
        return out, (np.concatenate(ends, axis=1) if ends else np.zeros((len(self.steps), 0)))

    def shares(self, specs: Sequence[Spec]) -> list[Share]:
        """Each subject's `Share`: the replay with only it as measured, and with only it made ideal."""
        return self.costs(specs)[0]

    def costs(self, specs: Sequence[Spec]) -> tuple[list[Share], StepSavings]:
        """`shares`, and what making each subject ideal saved step by step (`StepSavings`), from the same replays."""
        sets: list[tuple[np.ndarray, np.ndarray]] = []
        for _, work, transfer in specs:
            sets.append((np.where(work, self.actual_w, self.ideal_w), self.ideal_t + transfer * self.delta_t))
            sets.append((np.where(work, self.ideal_w, self.actual_w), self.actual_t - transfer * self.delta_t))
        spans, ends = self._replay(sets)
        out = []
        for n, (subject, _, _) in enumerate(specs):
            alone, fixed = spans[2 * n], spans[2 * n + 1]
            saved = self.actual_ns - fixed
            out.append(Share(subject=subject, slowdown=alone / self.ideal_ns if self.ideal_ns > 0 else 1.0,
                             saved_ns=saved, saved_share=saved / self.actual_ns if self.actual_ns > 0 else 0.0))
        fixed_ns = _durations(ends[:, 1::2])
        return out, StepSavings(steps=self.steps, step_ns=self.step_ns, saved_ns=self.step_ns[:, None] - fixed_ns)

    def share(self, subject: str, work: np.ndarray, transfer: np.ndarray) -> Share:
        return self.shares([(subject, work, transfer)])[0]

    def rank_spec(self, subject: str, ranks: Collection[int], *, own: bool = False) -> Spec:
        """Every work item of these ranks (`own`: only their own work, `_OWN_KINDS`, no checkpoint or time between
        steps), and their part of transfers on one host (`_charges`)."""
        t = np.zeros(len(self.actual_t))
        for r in ranks:
            if r in self.charges:
                t += self.charges[r]
        work = np.isin(self.owner, list(ranks))
        return subject, work & self.own if own else work, np.minimum(t, 1.0)

    def group_spec(self, subject: str, groups: Collection[str]) -> Spec:
        """Every transfer over these groups."""
        t = np.array([1.0 if i.group in groups else 0.0 for i in self.graph.instances])
        return subject, np.zeros(len(self.actual_w), bool), t

    def own_spec(self, subject: str) -> Spec:
        """Every rank's own work (compute, dataloader waits, lateness to see a collective done) at once."""
        return subject, self.own, np.zeros(len(self.actual_t))

    def excess_order(self) -> list[int]:
        """The ranks, the most excess (own, and charged transfers) first."""
        pos = np.maximum(self.delta_t, 0.0)
        return sorted(self.graph.programs, key=lambda r: (-(self.own_excess[r] + float(
            (self.charges[r] * pos).sum() if r in self.charges else 0.0)), r))

    def span_ns(self, first: int, last: int) -> float:
        """The replayed time (as measured) of steps first..last."""
        ends = self.step_end_ns
        before = [t for s, t in ends.items() if s < first]
        inside = [t for s, t in ends.items() if first <= s <= last]
        return max(inside, default=0.0) - max(before, default=0.0)


def analyze_graph(graph: Graph, *, stage_of: Mapping[int, int], measured_ns: float, first_step: int, last_step: int,
                  attempt: int | None = None, warnings: Sequence[str] = (), host_of: Mapping[int, str] | None = None,
                  rank_subjects: int | None = None, named: Sequence[int] = (), costing: Costing | None = None,
                  clock: str = "cpu") -> WhatIf:
    """The what-if of a built graph (module docstring). Pure. `host_of` (rank -> host) says which transfers ran on
    one host (charged to their members, `_charges`) and adds the hosts as subjects where there are several.
    `rank_subjects` bounds the ranks costed one by one (two replays each) to that many, the ranks with the most
    excess first, and every rank in `named`, and the groups to that many with the most transfer excess (every host
    is costed); None costs every rank and group. `costing`: the graph's, when already made."""
    c = costing if costing is not None else Costing(graph, stage_of=stage_of, host_of=host_of)
    no_w = np.zeros(len(c.actual_w), bool)
    no_t = np.zeros(len(c.actual_t))
    specs: dict[str, list[Spec]] = {"rank": [], "stage": [], "host": [], "kind": [], "op": [], "group": []}

    def by(what: str, items: Sequence[Work] | Sequence[Instance], name: Callable[[Any], str], is_work: bool) -> None:
        groups: dict[str, list[int]] = {}
        for x in items:
            groups.setdefault(name(x), []).append(x.id)
        for subject, ids in groups.items():
            w, t = no_w.copy(), no_t.copy()
            if is_work:
                w[ids] = True
            else:
                t[ids] = 1.0
            specs[what].append((subject, w, t))

    ordered = c.excess_order()
    costed = ordered if rank_subjects is None else sorted(
        set(ordered[:rank_subjects]) | {r for r in named if r in graph.programs})
    specs["rank"] = [c.rank_spec(f"rank:{r}", [r]) for r in sorted(costed)]
    stages = sorted(set(stage_of.values()))
    if len(stages) > 1:
        specs["stage"] = [(f"stage:{s}", np.isin(c.owner, [r for r, st in stage_of.items() if st == s]), no_t)
                          for s in stages]
    every_host = sorted({c.host_of[r] for r in graph.programs if r in c.host_of})
    if len(every_host) > 1:  # every host: what a typical host saves is the measure of an unusual one
        specs["host"] = [c.rank_spec(f"host:{h}", [r for r in graph.programs if c.host_of.get(r) == h])
                         for h in every_host]
    by("kind", graph.work, lambda w: f"kind:{w.kind}", True)
    by("op", graph.instances, lambda i: f"op:{i.op}", False)
    instances: Sequence[Instance] = graph.instances
    if rank_subjects is not None:  # the groups with the most transfer excess
        excess: dict[str, float] = {}
        for i in graph.instances:
            excess[i.group] = excess.get(i.group, 0.0) + max(0.0, float(c.delta_t[i.id]))
        top = set(sorted(excess, key=lambda g: (-excess[g], g))[:rank_subjects])
        instances = [i for i in graph.instances if i.group in top]
    by("group", instances, lambda i: f"group:{i.group}", False)
    flat = [x for v in specs.values() for x in v]
    found = iter(c.shares(flat))
    shares = {what: tuple(sorted((next(found) for _ in v), key=lambda s: (-s.saved_ns, s.subject)))
              for what, v in specs.items()}
    partition = _stage_partition(c, stage_of) if len(stages) > 1 else None
    winners, steps = _winners(graph, c.owner, stage_of)
    if c.alone:
        alone = sorted(c.alone)
        warnings = (*warnings, f"rank(s) {', '.join(map(str, alone))} are each their stage's only rank: no peer does "
                    "their work, so their ideal is their own and S leaves their slowness out (a pipeline of one "
                    "replica without tensor parallelism; a stage slower than the others is in 'stage partitioning')")
    return WhatIf(attempt=attempt, first_step=first_step, last_step=last_step, ranks=len(graph.programs),
                  measured_ns=measured_ns, actual_ns=c.actual_ns, ideal_ns=c.ideal_ns, by_rank=shares["rank"],
                  by_stage=shares["stage"], by_host=shares["host"], by_kind=shares["kind"], by_op=shares["op"],
                  by_group=shares["group"], stage_partition=partition, last_rank=_last_rank(winners, steps),
                  rotation=(len(winners), steps), step_ns=_step_times(c.step_end_ns), warnings=tuple(warnings),
                  clock=clock)


_OWN_KINDS = frozenset({"compute", "dataloader", "exit"})
"""A rank's own work: what it does alone (not waiting, not saving), and its lateness in seeing a collective done."""


_LOST_CPU = 2.0
"""A member shows lost CPU when its own excess work over the window is more than this many times its fellow members'
median. Measured on the canary (`benchmarks/whatif_duty_cycle.py`, 4 ranks on 2 cores): in 12 untouched runs the
largest member's excess was at most 1.37 times the others' median; a rank stopped from outside 35 ms in every 100
showed 3.7 to 8 times. Charging in proportion to the whole excess instead under-charged the stopped rank by 13 % on
average; charging what exceeds the others' median (a factor 1) handed one member all of a jittery untouched run's
transfer excess (6 % of its time, an incident)."""


def _charges(graph: Graph, own_excess: Mapping[int, float], hosts: Mapping[int, str]) -> dict[int, np.ndarray]:
    """For each rank, the part of each instance's transfer excess that is its own: on one host there is no wire to
    blame (a loopback transfer runs on its members' CPUs), so a transfer slower than its peers' is a member's process
    losing its CPU during it (stopped, descheduled). The transfer alone cannot tell which member (every member of a
    ring waits for the slowest), so the excess goes to the members whose own excess work over the window shows lost
    CPU, in proportion to it: what a member's own excess exceeds `_LOST_CPU` times the other members' median (a rank
    above its peers' median work is, step by step, also the upper half of symmetric jitter, which every member
    has). A transfer crossing hosts, or whose members show no lost CPU, stays with its group (a link, `by_group`)."""
    out: dict[int, np.ndarray] = {}
    for inst in graph.instances:
        if len(inst.members) < 2 or not all(m in hosts for m in inst.members):
            continue
        if len({hosts[m] for m in inst.members}) != 1:
            continue
        x = {m: own_excess.get(m, 0.0) for m in inst.members}
        above = {m: max(0.0, x[m] - _LOST_CPU * float(np.median([v for o, v in x.items() if o != m])))
                 for m in inst.members}
        total = sum(above.values())
        if total <= 0:
            continue
        for m, lost in above.items():
            if lost > 0:
                out.setdefault(m, np.zeros(len(graph.instances)))[inst.id] = lost / total
    return out


def _step_times(ends: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    """(step, replayed duration as measured): each step's end less the previous step's end (the first: from 0)."""
    out, prev = [], 0.0
    for s in sorted(ends):
        out.append((s, ends[s] - prev))
        prev = ends[s]
    return tuple(out)


def _stage_partition(c: Costing, stage_of: Mapping[int, int]) -> Share:
    """The ideal run (no worker slower than its peers) against the same with each stage's compute scaled to the mean
    stage's (per rank of the stage): what partitioning alone costs, apart from any straggler (a slow rank makes its
    stage's measured compute look heavy; its stage's ideal does not)."""
    compute = np.array([w.kind == "compute" for w in c.graph.work])
    stage = np.array([stage_of[int(r)] for r in c.owner])
    per_stage = {s: c.ideal_w[compute & (stage == s)].sum() / max(1, sum(1 for st in stage_of.values() if st == s))
                 for s in set(stage_of.values())}
    mean = float(np.mean(list(per_stage.values())))
    scaled = c.ideal_w.copy()
    for s, total in per_stage.items():
        if total > 0:
            mask = compute & (stage == s)
            scaled[mask] *= mean / total
    balanced = c.makespans([(scaled, c.ideal_t)])[0]
    saved = c.ideal_ns - balanced
    return Share(subject="stage_partition", slowdown=c.ideal_ns / balanced if balanced > 0 else 1.0, saved_ns=saved,
                 saved_share=saved / c.actual_ns if c.actual_ns > 0 else 0.0)


def _winners(graph: Graph, owner: np.ndarray, stage_of: Mapping[int, int]) -> tuple[Counter[int], int]:
    """In how many steps each rank had the most own work (compute and dataloader) over its stage's median, and over
    how many steps (ranks alone in their stage are not candidates)."""
    own: dict[tuple[int, int], float] = {}
    for w in graph.work:
        if w.kind in _OWN_KINDS:
            key = (int(owner[w.id]), w.step)
            own[key] = own.get(key, 0.0) + float(graph.work_ns[w.id])
    steps = sorted({s for _, s in own})
    winners: Counter[int] = Counter()
    for s in steps:
        excess: dict[int, float] = {}
        for st in set(stage_of.values()):
            ranks = [r for r in graph.programs if stage_of.get(r) == st and (r, s) in own]
            if len(ranks) < 2:  # a rank alone in its stage has no peer to be over
                continue
            median = float(np.median([own[(r, s)] for r in ranks]))
            for r in ranks:
                excess[r] = own[(r, s)] - median
        if excess:
            winners[max(excess, key=lambda r: (excess[r], -r))] += 1
    return winners, len(steps)


def _last_rank(winners: Counter[int], steps: int) -> tuple[int, float] | None:
    """The rank most often with the most own work over its stage's median in a step, and the share of steps."""
    if not winners:
        return None
    rank, count = winners.most_common(1)[0]
    return rank, count / steps
