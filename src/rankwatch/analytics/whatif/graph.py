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

import numpy as np

__all__ = ["Graph", "Instance", "Join", "Launch", "Mark", "Replay", "Work", "replay"]


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
        """Each instance's ideal transfer: the (lower) median over the instances sharing its key."""
        return _medians([i.key for i in self.instances], self.transfer_ns)


def _medians(keys: Sequence[tuple[object, ...]], values: np.ndarray) -> np.ndarray:
    by: dict[tuple[object, ...], list[int]] = {}
    for i, k in enumerate(keys):
        by.setdefault(k, []).append(i)
    out = np.array(values, dtype=np.float64, copy=True)
    for idx in by.values():
        if len(idx) > 1:
            out[idx] = float(np.sort(values[idx])[(len(idx) - 1) // 2])
    return out


@dataclass(frozen=True, slots=True)
class Replay:
    finish_ns: dict[int, float]
    """When each rank's program ended."""
    step_end_ns: dict[int, float]
    """When each step ended: its last rank's `Mark`."""

    @property
    def makespan_ns(self) -> float:
        return max(self.finish_ns.values(), default=0.0)


def replay(graph: Graph, work_ns: np.ndarray, transfer_ns: np.ndarray) -> Replay:
    """Run every rank's program from time 0 with these durations (event-driven: a rank runs until it joins an
    instance not yet complete, and resumes when it completes). Pure."""
    inst = graph.instances
    launched = np.zeros(len(inst), dtype=np.int64)
    last_launch = np.zeros(len(inst), dtype=np.float64)
    end = np.full(len(inst), np.nan)
    members = np.array([len(i.members) for i in inst], dtype=np.int64)
    following: dict[int, list[int]] = {}
    for x in inst:
        if x.after is not None:
            following.setdefault(x.after, []).append(x.id)
    waiting: dict[int, list[int]] = {}
    pos = dict.fromkeys(graph.programs, 0)
    clock = dict.fromkeys(graph.programs, 0.0)
    step_end: dict[int, float] = {}
    runnable = list(graph.programs)

    def complete(first: int) -> None:
        stack = [first]
        while stack:
            i = stack.pop()
            if not np.isnan(end[i]) or launched[i] < members[i]:
                continue
            before = inst[i].after
            if before is not None and np.isnan(end[before]):
                continue
            start = last_launch[i] if before is None else max(last_launch[i], end[before])
            end[i] = start + transfer_ns[i]
            runnable.extend(waiting.pop(i, ()))
            stack.extend(following.get(i, ()))

    while runnable:
        rank = runnable.pop()
        program, t, p = graph.programs[rank], clock[rank], pos[rank]
        while p < len(program):
            item = program[p]
            if isinstance(item, Work):
                t += work_ns[item.id]
            elif isinstance(item, Launch):
                i = item.instance
                launched[i] += 1
                if t > last_launch[i]:
                    last_launch[i] = t
                complete(i)
            elif isinstance(item, Join):
                pending = [i for i in item.instances if np.isnan(end[i])]
                if pending:
                    waiting.setdefault(pending[0], []).append(rank)
                    break
                t = max(t, *(float(end[i]) for i in item.instances))
            else:
                if t > step_end.get(item.step, 0.0):
                    step_end[item.step] = t
            p += 1
        clock[rank], pos[rank] = t, p
    stuck = [r for r, p in pos.items() if p < len(graph.programs[r])]
    if stuck:
        r = stuck[0]
        item = graph.programs[r][pos[r]]
        assert isinstance(item, Join)
        i = next(i for i in item.instances if np.isnan(end[i]))
        missing = "its members' launches" if launched[i] < members[i] else "the instance before it on its group"
        raise ValueError(f"what-if replay: rank {r} waits forever on {inst[i].op} #{i} of group {inst[i].group} at "
                         f"step {inst[i].step} (never completes: {missing} are missing); {len(stuck)} rank(s) stuck")
    return Replay(finish_ns=clock, step_end_ns=step_end)
