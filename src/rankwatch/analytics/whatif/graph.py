"""A job's steps as a dependency graph, and its replay with chosen durations: the core of the what-if analysis.

Each rank runs a program: an ordered list of items.

* `Work`: time the rank spends on its own (compute, dataloader wait, a checkpoint's blocking part, what it does
  between steps), `ns` long.
* `Launch`: the rank issues one member's part of a communication `Instance` and goes on at once.
* `Join`: the rank cannot go on before the instances named have completed (a blocking collective is a `Launch` then
  its `Join`; DDP's bucket all-reduces are launched during the backward pass and joined where the last one was
  issued, as the collector counts their exposed wait, `collector.collectives._Step.waits`).
* `Mark`: a step ends here (its time is recorded).

An instance completes `transfer_ns` after it can start, and it can start when every member has launched it (a
synchronous collective ends when its last member arrives) and the instance before it on the same communicator has
completed (NCCL runs a communicator's operations in issue order on its stream; gloo runs a process group's in
order). A point-to-point send and its receive are one instance of two members, matched in order per pair (NCCL's
point-to-point semantics; gloo's per-pair, per-tag matching), and both join it (`build` says why).

`replay` runs the programs with the durations given (arrays indexed by work and instance id) and returns when
each rank finished and each step ended: with the measured durations it reproduces the run (a check on the model,
`WhatIf.fidelity`); with some of them replaced by their ideal (the peers' median for the same operation) it says
what the run would have taken without the slowness replaced. Pure; ValueError when the programs cannot all run to
their end (a join on an instance some member never launches), naming the rank and the instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Graph", "Instance", "Join", "Launch", "Mark", "Replay", "Schedule", "Work", "replay"]


@dataclass(frozen=True, slots=True)
class Work:
    id: int
    """Index into the work durations."""
    kind: str
    """compute, dataloader, checkpoint, outside (between steps)."""
    step: int
    key: tuple[object, ...]
    """Work with equal keys is the same work on peers (same stage, step and place in the step): its ideal is their
    median."""


@dataclass(frozen=True, slots=True)
class Launch:
    instance: int


@dataclass(frozen=True, slots=True)
class Join:
    instances: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Mark:
    step: int


Item = Work | Launch | Join | Mark


@dataclass(frozen=True, slots=True)
class Instance:
    id: int
    op: str
    """all_reduce, all_gather, reduce_scatter, broadcast, send/recv (p2p), ..."""
    group: str
    members: tuple[int, ...]
    after: int | None
    """The instance before it on the same communicator (it starts only after that one completed); None: first."""
    step: int
    key: tuple[object, ...]
    """Instances with equal keys move the same data over the same kind of group: their ideal transfer is the
    median of theirs."""


@dataclass(frozen=True, slots=True)
class Graph:
    programs: dict[int, tuple[Item, ...]]
    """Each rank's program, by rank."""
    instances: tuple[Instance, ...]
    work: tuple[Work, ...]
    """Every work item, by id."""
    work_ns: np.ndarray
    """Measured duration of each work item (float64 ns)."""
    transfer_ns: np.ndarray
    """Measured transfer time of each instance (float64 ns)."""

    def ideal_work(self) -> np.ndarray:
        """Each work item's ideal: the median of the measured durations of the work sharing its key, the lower one
        of the two middle values when they are even in number (a duration a peer achieved: of two replicas, one
        slow, the midpoint would charge only half its excess)."""
        return _medians([w.key for w in self.work], self.work_ns)

    def ideal_transfer(self) -> np.ndarray:
        """Each instance's ideal transfer: the (lower) median over the instances sharing its key, or, where at least
        half of them were held (`_held_mode`), the median of the ones that were not."""
        return _medians([i.key for i in self.instances], self.transfer_ns, held=True)


def _medians(keys: Sequence[tuple[object, ...]], values: np.ndarray, *, held: bool = False) -> np.ndarray:
    by: dict[tuple[object, ...], list[int]] = {}
    for i, k in enumerate(keys):
        by.setdefault(k, []).append(i)
    out = np.array(values, dtype=np.float64, copy=True)
    for idx in by.values():
        if len(idx) > 1:
            v = np.sort(values[idx])
            lower = _held_mode(v) if held else None
            out[idx] = float(v[(len(v) - 1) // 2] if lower is None else v[: lower][(lower - 1) // 2])
    return out


def _held_mode(v: np.ndarray) -> int | None:
    """How many of the sorted transfers `v` form the mode of the ones not held, when at least half were held; else
    None. Transfers of one size over one kind of group are peers over time, and a delay only adds to a transfer:
    a member stopped or descheduled while it runs holds it for as long (`analysis._charges`). Where that happens to
    at least half of them (a stop phase-locked to the step), their median is a held transfer and measures the fault,
    not the norm: the median's breakdown point. They are told apart by a gap: the widest gap between consecutive
    sorted values, wider than the whole spread of the values below it (at least 3 of them), splits the held from
    the rest; without one (a link slow all run, or noise) the median stands."""
    n = len(v)
    if n < 6:
        return None
    gaps = np.diff(v)
    cut = int(np.argmax(gaps)) + 1  # values [0, cut) below the widest gap
    if cut < 3 or n - cut < (n + 1) // 2:
        return None
    return cut if gaps[cut - 1] > v[cut - 1] - v[0] else None


@dataclass(frozen=True, slots=True)
class Replay:
    finish_ns: dict[int, float]
    """When each rank's program ended."""
    step_end_ns: dict[int, float]
    """When each step ended: its last rank's `Mark`."""

    @property
    def makespan_ns(self) -> float:
        return max(self.finish_ns.values(), default=0.0)


_ADD, _LAUNCH, _DONE, _JOIN, _MARK = range(5)


@dataclass(frozen=True, slots=True)
class Schedule:
    """The order a replay computes in: which rank adds which work, launches, waits for, marks; when each instance
    completes. Every time in a replay is a max or a sum of earlier ones over the same dependencies (max-plus), so
    the order does not depend on the durations: one schedule evaluates any number of duration sets at once
    (`evaluate`)."""

    ops: tuple[tuple[int, int, Any], ...]
    """(code, rank index, argument): ADD (work ids), LAUNCH (instance), DONE (instance), JOIN (instances), MARK
    (step)."""
    ranks: tuple[int, ...]
    """The rank of each rank index."""
    after: np.ndarray
    """Each instance's predecessor on its communicator, -1 for none."""

    @classmethod
    def of(cls, graph: Graph) -> Schedule:
        """The schedule of `graph`, from one event-driven pass over its structure. ValueError (one line, naming the
        rank and the instance) when the programs cannot all run to their end."""
        inst = graph.instances
        launched = np.zeros(len(inst), dtype=np.int64)
        done = np.zeros(len(inst), dtype=bool)
        members = [len(i.members) for i in inst]
        following: dict[int, list[int]] = {}
        for x in inst:
            if x.after is not None:
                following.setdefault(x.after, []).append(x.id)
        ranks = tuple(graph.programs)
        index = {r: n for n, r in enumerate(ranks)}
        waiting: dict[int, list[int]] = {}
        pos = dict.fromkeys(ranks, 0)
        runnable = list(ranks)
        ops: list[tuple[int, int, Any]] = []

        def complete(first: int) -> None:
            stack = [first]
            while stack:
                i = stack.pop()
                if done[i] or launched[i] < members[i]:
                    continue
                before = inst[i].after
                if before is not None and not done[before]:
                    continue
                done[i] = True
                ops.append((_DONE, -1, i))
                runnable.extend(waiting.pop(i, ()))
                stack.extend(following.get(i, ()))

        while runnable:
            rank = runnable.pop()
            program, p, r = graph.programs[rank], pos[rank], index[rank]
            adds: list[int] = []
            while p < len(program):
                item = program[p]
                if isinstance(item, Work):
                    adds.append(item.id)
                    p += 1
                    continue
                if adds:
                    ops.append((_ADD, r, np.array(adds, dtype=np.int64)))
                    adds = []
                if isinstance(item, Launch):
                    launched[item.instance] += 1
                    ops.append((_LAUNCH, r, item.instance))
                    complete(item.instance)
                elif isinstance(item, Join):
                    pending = [i for i in item.instances if not done[i]]
                    if pending:
                        waiting.setdefault(pending[0], []).append(rank)
                        break
                    ops.append((_JOIN, r, item.instances))
                else:
                    ops.append((_MARK, r, item.step))
                p += 1
            if adds:
                ops.append((_ADD, r, np.array(adds, dtype=np.int64)))
            pos[rank] = p
        stuck = [r for r, p in pos.items() if p < len(graph.programs[r])]
        if stuck:
            r = stuck[0]
            item = graph.programs[r][pos[r]]
            assert isinstance(item, Join)
            i = next(i for i in item.instances if not done[i])
            missing = "its members' launches" if launched[i] < members[i] else "the instance before it on its group"
            raise ValueError(f"what-if replay: rank {r} waits forever on {inst[i].op} #{i} of group {inst[i].group} at "
                             f"step {inst[i].step} (never completes: {missing} are missing); {len(stuck)} rank(s) stuck")
        after = np.array([-1 if x.after is None else x.after for x in inst], dtype=np.int64)
        return cls(ops=tuple(ops), ranks=ranks, after=after)

    def evaluate(self, work_ns: np.ndarray, transfer_ns: np.ndarray) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Replay K duration sets at once: `work_ns` (W, K), `transfer_ns` (I, K). Returns each rank's finish (R, K,
        ranks in `ranks` order) and each step's end ({step: (K,)})."""
        k = work_ns.shape[1]
        t = np.zeros((len(self.ranks), k))
        last = np.zeros((len(self.after), k))
        end = np.zeros((len(self.after), k))
        steps: dict[int, np.ndarray] = {}
        for code, r, arg in self.ops:
            if code == _ADD:
                t[r] += work_ns[arg].sum(axis=0)
            elif code == _LAUNCH:
                np.maximum(last[arg], t[r], out=last[arg])
            elif code == _DONE:
                i = int(arg)
                b = self.after[i]
                end[i] = (last[i] if b < 0 else np.maximum(last[i], end[b])) + transfer_ns[i]
            elif code == _JOIN:
                ids = arg
                np.maximum(t[r], end[ids[0]] if len(ids) == 1 else end[list(ids)].max(axis=0),
                           out=t[r])
            else:
                s = int(arg)
                if s in steps:
                    np.maximum(steps[s], t[r], out=steps[s])
                else:
                    steps[s] = t[r].copy()
        return t, steps


def replay(graph: Graph, work_ns: np.ndarray, transfer_ns: np.ndarray) -> Replay:
    """Run every rank's program from time 0 with these durations (a rank runs until it joins an instance not yet
    complete, and resumes when it completes; `Schedule`). Pure."""
    schedule = Schedule.of(graph)
    t, steps = schedule.evaluate(np.asarray(work_ns, dtype=np.float64)[:, None],
                                 np.asarray(transfer_ns, dtype=np.float64)[:, None])
    return Replay(finish_ns={r: float(t[n, 0]) for n, r in enumerate(schedule.ranks)},
                  step_end_ns={s: float(v[0]) for s, v in steps.items()})
