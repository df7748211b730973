"""A run's recorded steps as the what-if `Graph`: each rank's program from its steps, collectives, dataloader waits and
checkpoint phases over a window of steps of one attempt.

Every time here is the rank's own monotonic clock (`*_mono_ns`), compared only with itself: work is the time between
the rank's program points, and an instance's transfer is clock-free, the shortest time any member spent inside it
(the last member to arrive waits for nobody: what it spent inside is the transfer; `frames.links` reads it the same
way).

* A blocking collective is a launch at its enter and a join at its exit, with no work of the rank between.
* Asynchronous ones issued in a run (DDP's buckets, launched during the backward pass) are joined where the last
  of the run was issued when they were all done by the rank's next point, as the collector counts their exposed
  wait (`collector.collectives._Step.waits`); one still in flight at the next point is joined where it was done,
  and the rank waited for it from its point before (within a step: torch waits for DDP's buckets at the end of the
  backward pass, before the optimizer); counted as its work, a replica's wait for the slow rank of another read as
  its own slowness. Across a step's end, where it was waited is unknown: the time before is the rank's.
* The k-th collective a rank issued on a group in the window is the k-th of every member (communicators run in
  issue order), the k-th send from a to b is matched by the k-th receive on b from a, and both complete when both
  were issued and the data moved: gloo's send waits for its receiver to be ready (measured here: a stage's send
  lasts as long as its receiver is late), and so does NCCL's beyond its eager size. Pipelines that would deadlock on
  that post their sends and receives together (`batch_isend_irecv`: launched, then joined).
* The time between two points is split by kind: the rank's dataloader waits (`phases` named ``data``) and the
  checkpoint phases of steps that counted checkpoint time (a save on a thread of its own counts none) are their
  own kinds; the rest of a step is compute, and the time between steps is ``outside``.
* Where an instance's members share a host (one wall clock), a member that left it later than the transfer was
  done (the median member's end) was late to see it: stopped or descheduled as the result arrived. That lag is
  the member's own work (``exit``) after its join, so the replay keeps it and a what-if can fix it.
* Peers for the ideal: work of the ranks of the same pipeline stage at the same place of the same step; transfers of
  the same operation and size over groups of the same kind, across the window.

On CUDA the host's times are enqueueing: the caller (`whatif_of`) then lays each rank's steps on its device's clock
(every operation's device start and duration, `collectives.device_start_ns` / `device_duration_ns`) and builds with
`shared_clock=False`: device clocks are never one clock across ranks, so no member's lateness is read from a shared
clock, and an instance's transfer is the least device time inside (the last kernel to start waits for no peer).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from rankwatch.analytics.whatif.graph import Graph, Instance, Item, Join, Launch, Mark, Work
from rankwatch.base.topology import group_kind

__all__ = ["P2P_OPS", "RankSteps", "WhatIfInputError", "build_graph"]

P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


class WhatIfInputError(ValueError):
    """The run cannot be replayed over the window asked (steps missing on some rank, nothing recorded, ...)."""


@dataclass(frozen=True, slots=True)
class RankSteps:
    """What the builder reads of one rank over the window (polars frames of its own rows)."""

    rank: int
    stage: int
    host: str
    steps: pl.DataFrame
    """step, start_mono_ns, end_mono_ns, checkpoint_ns; one row per step of the window, in order."""
    collectives: pl.DataFrame
    """op, group, group_ranks, peer, bytes, async_op, enter_mono_ns, exit_mono_ns, enter_wall_ns, exit_wall_ns
    (completed ones)."""
    data: list[tuple[int, int]]
    """(start, end) of its dataloader waits."""
    checkpoint: list[tuple[int, int]]
    """(start, end) of its checkpoint phases."""


@dataclass(slots=True)
class _Point:
    before: int
    """Where the rank's work before this point ends (its arrival)."""
    after: int
    """Where its work after this point begins."""
    order: int
    item: Item | None
    """None: a step's start (splits the time between steps from the step's own)."""
    step: int
    waited: bool = False
    """A join the rank was blocked in from its previous point on (an asynchronous run still in flight there, done
    inside its step): the time before it is the rank's wait, not its work."""


_MakeInstance = Callable[[tuple[object, ...], str, str, tuple[int, ...], int, int, bool], int]
"""(key, op, group, group_ranks, step, bytes, point-to-point) -> the instance's id."""


class _Spans:
    """A rank's (start, end) spans, sorted, for the time of [a, b) inside them (`overlap`), in log time."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans = sorted(spans)
        self.starts = [s for s, _ in self.spans]
        self.longest = max((e - s for s, e in self.spans), default=0)

    def overlap(self, a: int, b: int) -> int:
        total = 0
        i = bisect.bisect_left(self.starts, b) - 1  # spans starting before b; none ending after a starts before
        while i >= 0 and self.starts[i] > a - self.longest:
            s, e = self.spans[i]
            total += max(0, min(b, e) - max(a, s))
            i -= 1
        return total


def build_graph(ranks: list[RankSteps], group_kinds: dict[str, str], *, shared_clock: bool = True) -> Graph:
    """The graph of the window (module docstring). WhatIfInputError when a rank has no steps or the ranks' windows
    differ. `shared_clock`: the ranks' wall times are their hosts' clocks (CPU timing), so members on one host share
    one; False on device clocks, where no two ranks' times compare."""
    if not ranks:
        raise WhatIfInputError("what-if: no rank has steps in the window")
    windows = {r.rank: tuple(r.steps["step"].to_list()) for r in ranks}
    first = next(iter(windows.values()))
    odd = [r for r, w in windows.items() if w != first]
    if not first or odd:
        raise WhatIfInputError(f"what-if: ranks {sorted(odd)} did not complete the same steps as rank "
                               f"{ranks[0].rank} in the window ({len(first)} steps): replay needs every rank's steps")
    instances: list[Instance] = []
    by_key: dict[tuple[object, ...], int] = {}
    members: defaultdict[int, list[tuple[int, int, int, int, int]]] = defaultdict(list)
    # instance -> (rank, enter, exit on its monotonic clock, enter, exit on the wall clock)
    last_on_group: dict[str, int] = {}
    programs: dict[int, list[_Point]] = {}
    host_of = {r.rank: r.host for r in ranks}

    def instance(key: tuple[object, ...], op: str, group: str, group_ranks: tuple[int, ...], step: int, nbytes: int,
                 p2p: bool) -> int:
        if key in by_key:
            return by_key[key]
        i = len(instances)
        kind = "p2p" if p2p else group_kinds.get(group, str(group_kind(group.split(".")[0])))
        after = None if p2p else last_on_group.get(group)
        instances.append(Instance(id=i, op="send/recv" if p2p else op, group=group, members=group_ranks,
                                  after=after, step=step, key=("send/recv" if p2p else op, kind, nbytes)))
        if not p2p:
            last_on_group[group] = i
        by_key[key] = i
        return i

    # instances in a global order every member agrees on: per group, ranks' k-th op; built rank by rank, a later
    # rank's k-th op on a group finds the instance an earlier rank created
    for r in ranks:
        programs[r.rank] = _program(r, instance, members)
    transfers = np.zeros(len(instances))
    end_wall: dict[int, float] = {}  # one-host instances: when the transfer was done, on the host's clock
    for i, inst in enumerate(instances):
        seen = members[i]
        ranks_seen = tuple(sorted({m[0] for m in seen}))
        before = members[inst.after] if inst.after is not None else []
        transfers[i] = _transfer(seen, before, host_of if shared_clock else None)
        if shared_clock and len(seen) > 1 and len({host_of.get(m[0]) for m in seen}) == 1:
            prev = {m[0]: m[4] for m in before}
            end_wall[i] = max(max(ew, prev.get(rank, ew)) for rank, _, _, ew, _ in seen) + transfers[i]
        if ranks_seen != tuple(sorted(inst.members)):
            instances[i] = Instance(id=i, op=inst.op, group=inst.group, members=ranks_seen, after=inst.after,
                                    step=inst.step, key=inst.key)
    exits = {(m[0], i): float(m[4]) for i, seen in members.items() for m in seen}
    work: list[Work] = []
    durations: list[float] = []
    out: dict[int, tuple[Item, ...]] = {}
    stage_of = {r.rank: r.stage for r in ranks}
    spans = {r.rank: (_Spans(r.data), _Spans(r.checkpoint),
                      dict(zip(r.steps["step"].to_list(), r.steps["checkpoint_ns"].to_list()))) for r in ranks}
    for rank, points in programs.items():
        points.sort(key=lambda p: (p.before, p.order))
        items: list[Item] = []
        data, ckpt, ckpt_ns = spans[rank]
        index = 0
        inside = False
        prev_after: int | None = None
        step = points[0].step
        for p in points:
            if prev_after is not None:
                a, b = prev_after, prev_after if p.waited else max(prev_after, p.before)
                parts: list[tuple[str, int]]
                if inside:
                    d = data.overlap(a, b)
                    c = ckpt.overlap(a, b) if ckpt_ns.get(step) else 0
                    parts = [("dataloader", d), ("checkpoint", c), ("compute", max(0, b - a - d - c))]
                else:
                    parts = [("outside", b - a)]
                for kind, ns in parts:  # every kind, zero too: the peers' median counts the ranks that had none
                    work.append(Work(id=len(work), kind=kind, step=step,
                                     key=(stage_of[rank], step, index, kind, _signature(p.item))))
                    durations.append(float(ns))
                    items.append(work[-1])
                index += 1
            if p.item is None:  # a step starts
                inside, step, index = True, p.step, 0
            else:
                if isinstance(p.item, Mark):
                    inside = False
                items.append(p.item)
                if isinstance(p.item, Join) and all(i in end_wall for i in p.item.instances):
                    # the rank's own delay in seeing the instances done: its last exit after the transfers ended
                    lag = max(exits[(rank, i)] for i in p.item.instances) - max(end_wall[i] for i in p.item.instances)
                    work.append(Work(id=len(work), kind="exit", step=step,
                                     key=(stage_of[rank], step, index, "exit", "Join")))
                    durations.append(float(max(0.0, lag)))
                    items.append(work[-1])
            prev_after = p.after
        out[rank] = tuple(items)
    return Graph(programs=out, instances=tuple(instances), work=tuple(work), work_ns=np.array(durations),
                 transfer_ns=transfers)


def _signature(item: Item | None) -> str:
    return type(item).__name__ if item is not None else "start"


def _transfer(seen: list[tuple[int, int, int, int, int]], before: list[tuple[int, int, int, int, int]],
              host_of: dict[int, str] | None) -> float:
    """An instance's transfer time. A member's time inside counts from when it could start: its enter, or its end of
    the operation before it on the communicator (an asynchronous bucket queued behind the previous one). Clock-free,
    the last to start waits for nobody, so the least time inside is the transfer. Where every member is on one host,
    their wall clocks are one clock: the transfer is then the median member's time from the instance's start (the
    last member's start) to its own end, which also holds the time a member took to see the result (on a busy CPU,
    milliseconds the least time leaves out). `host_of` None: no clock is shared (device clocks)."""
    prev = {m[0]: (m[2], m[4]) for m in before}
    least = min(x - max(e, prev.get(rank, (e, 0))[0]) for rank, e, x, _, _ in seen)
    if host_of is None or len({host_of.get(m[0]) for m in seen}) != 1 or len(seen) < 2:
        return float(max(0, least))
    start = max(max(ew, prev.get(rank, (0, ew))[1]) for rank, _, _, ew, _ in seen)
    return float(max(0, least, float(np.median([xw - start for _, _, _, _, xw in seen]))))


def _program(r: RankSteps, make: _MakeInstance, members: defaultdict[int, list[tuple[int, int, int, int, int]]]
             ) -> list[_Point]:
    """One rank's points (unsorted): step starts and ends, launches and joins (module docstring). `make` gives the
    instance of a key, created at its first member."""
    points: list[_Point] = []
    order = 0
    steps = r.steps.rows(named=True)
    starts = [s["start_mono_ns"] for s in steps]
    for s in steps:
        points.append(_Point(s["start_mono_ns"], s["start_mono_ns"], order, None, s["step"]))
        points.append(_Point(s["end_mono_ns"], s["end_mono_ns"], order + 1, Mark(s["step"]), s["step"]))
        order += 2
    counts: defaultdict[tuple[object, ...], int] = defaultdict(int)
    ops = r.collectives.sort("enter_mono_ns").rows(named=True)
    run: list[tuple[int, int, int]] = []  # the async run in flight: (instance, enter, exit)

    def step_at(t: int) -> int:
        i = int(np.searchsorted(starts, t, side="right")) - 1
        return int(steps[max(i, 0)]["step"])

    ends = [s["end_mono_ns"] for s in steps]

    def step_end(t: int) -> int | None:
        i = int(np.searchsorted(starts, t, side="right")) - 1
        return int(ends[i]) if i >= 0 and t <= ends[i] else None

    def close_run(next_point: int | None) -> None:
        nonlocal order
        if not run:
            return
        last = max(e for _, e, _ in run)
        done = max(x for _, _, x in run)
        ids = tuple(i for i, _, _ in run)
        end = step_end(last)  # a step does not end with its own operations in flight
        if end is not None:
            next_point = end if next_point is None else min(next_point, end)
        if next_point is None or done <= next_point:
            points.append(_Point(last, done, order, Join(ids), step_at(last)))
        else:  # still in flight at the next point: joined where it was done, waited for from the point before it
            # when that was in its step (torch waits for DDP's buckets at the end of the backward pass, before the
            # optimizer: `Reducer::finalize_backward`); across a step's end, where it was waited is unknown
            points.append(_Point(done, done, order, Join(ids), step_at(done), waited=end is None or done <= end))
        order += 1
        run.clear()

    for o in ops:
        op, group, enter, exit_ = str(o["op"]), str(o["group"]), int(o["enter_mono_ns"]), int(o["exit_mono_ns"])
        walls = (int(o["enter_wall_ns"]), int(o["exit_wall_ns"]))
        p2p = op in P2P_OPS
        if p2p:
            peer = int(o["peer"])
            src, dst = (r.rank, peer) if op in ("send", "isend") else (peer, r.rank)
            base: tuple[object, ...] = ("p2p", src, dst)
            group_ranks: tuple[int, ...] = (src, dst)
        else:
            base = ("coll", group)
            group_ranks = tuple(int(x) for x in (o["group_ranks"] or [r.rank]))
        k = counts[base]
        counts[base] += 1
        if run and (end := step_end(run[-1][1])) is not None and enter > end:
            close_run(end)  # the run's step ended before this operation
        step = step_at(enter)
        nbytes = int(o["bytes"] or 0)
        i = make(base + (k,), op, group, group_ranks, step, nbytes, p2p)
        members[i].append((r.rank, enter, exit_, *walls))
        if o["async_op"]:
            points.append(_Point(enter, enter, order, Launch(i), step))
            order += 1
            run.append((i, enter, exit_))
            continue
        close_run(enter)
        points.append(_Point(enter, enter, order, Launch(i), step))
        points.append(_Point(enter, exit_, order + 1, Join((i,)), step))
        order += 2
    close_run(None)
    return points
