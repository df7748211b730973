"""The what-if replay and its figures on small hand-built step graphs with answers worked out by hand: data parallel
with one slow rank, a 1F1B pipeline with an unevenly partitioned stage, a slow link; and the damaged cases."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.analytics.whatif import Graph, WhatIf, analyze_graph, parse_steps, replay
from rankwatch.analytics.whatif.graph import Instance, Item, Join, Launch, Mark, Work


class _Builder:
    """Programs written by hand: `work(rank, ns, key)`, `sync(i)` (launch and join), `mark(step)`."""

    def __init__(self) -> None:
        self.programs: dict[int, list[Item]] = {}
        self.work: list[Work] = []
        self.ns: list[float] = []
        self.instances: list[Instance] = []
        self.transfer: list[float] = []

    def instance(self, op: str, members: tuple[int, ...], transfer: float, *, group: str = "g", step: int = 0,
                 after: int | None = None, key: tuple[object, ...] | None = None) -> int:
        i = len(self.instances)
        self.instances.append(Instance(id=i, op=op, group=group, members=members, after=after, step=step,
                                       key=key or (op, group)))
        self.transfer.append(transfer)
        return i

    def do(self, rank: int, *items: object) -> None:
        prog = self.programs.setdefault(rank, [])
        for it in items:
            if isinstance(it, tuple) and it[0] == "w":  # ("w", ns, key, kind)
                _, ns, key, *kind = it
                w = Work(id=len(self.work), kind=kind[0] if kind else "compute", step=0, key=key)
                self.work.append(w)
                self.ns.append(float(ns))
                prog.append(w)
            elif isinstance(it, tuple) and it[0] == "sync":
                prog += [Launch(it[1]), Join((it[1],))]
            else:
                prog.append(it)  # type: ignore[arg-type]

    def graph(self) -> Graph:
        return Graph(programs={r: tuple(p) for r, p in self.programs.items()}, instances=tuple(self.instances),
                     work=tuple(self.work), work_ns=np.array(self.ns), transfer_ns=np.array(self.transfer))


def _analyze(g: Graph, stage_of: dict[int, int]) -> WhatIf:
    return analyze_graph(g, stage_of=stage_of, measured_ns=0.0, first_step=0, last_step=0)


def _share(shares: tuple, subject: str):  # type: ignore[no-untyped-def]
    return next(s for s in shares if s.subject == subject)


def test_data_parallel_one_slow_rank() -> None:
    """4 replicas: 10 ns of work each (rank 3: 20), then an all-reduce of 2. The step ends when the last member
    arrives plus the transfer: T = 22; the ideal work is the replicas' median, 10: T_ideal = 12, S = 22/12. Rank 3
    alone causes all of it (S_3 = S, fixing it saves 10 of 22); the others cause none."""
    b = _Builder()
    ar = b.instance("all_reduce", (0, 1, 2, 3), 2.0)
    for r in range(4):
        b.do(r, ("w", 20 if r == 3 else 10, ("fwd",)), ("sync", ar), Mark(0))
    g = b.graph()
    assert replay(g, g.work_ns, g.transfer_ns).makespan_ns == 22.0
    w = _analyze(g, dict.fromkeys(range(4), 0))
    assert (w.actual_ns, w.ideal_ns) == (22.0, 12.0) and w.slowdown == pytest.approx(22 / 12)
    assert w.lost_share == pytest.approx(10 / 22)
    slow = w.by_rank[0]
    assert slow.subject == "rank:3" and slow.slowdown == pytest.approx(22 / 12)
    assert slow.saved_ns == 10.0 and slow.saved_share == pytest.approx(10 / 22)
    assert all(s.saved_ns == 0.0 and s.slowdown == 1.0 for s in w.by_rank[1:])
    assert _share(w.by_kind, "kind:compute").saved_ns == 10.0
    assert _share(w.by_op, "op:all_reduce").saved_ns == 0.0  # one instance: its own median
    assert w.last_rank == (3, 1.0)
    assert w.stage_partition is None and w.by_stage == ()


def test_a_1f1b_pipeline_with_an_unevenly_partitioned_stage() -> None:
    """Two stages, two microbatches, 1F1B, one rank per stage, transfers 0; a send and its receive complete together,
    and where a stage sends and receives at once it posts both and waits for both (batch_isend_irecv). Stage 0: F 1,
    B 2; stage 1: F 3, B 6. Worked by hand: activation 0 moves at 1; stage 1 runs F0 to 4 and B0 to 10, then
    exchanges (gradient 0 out, activation 1 in, which stage 0 posted at 2): both at 10; stage 1 runs F1 to 13, B1 to
    19 and sends gradient 1; stage 0 runs B0 to 12 and waits for gradient 1 until 19, B1 to 21. T = 21. Each stage
    is its own only peer, so T_ideal = T (no worker is slower than its peers); the even re-partition (each stage's
    compute scaled to 12 of the 24: F 2, B 4 on both) gives 18: 3 of 21 saved."""
    b = _Builder()
    act = [b.instance("send/recv", (0, 1), 0.0, key=("p2p",)) for _ in range(2)]
    grad = [b.instance("send/recv", (0, 1), 0.0, key=("p2p",)) for _ in range(2)]

    def both(*pairs: int) -> list[object]:
        return [*(Launch(p) for p in pairs), Join(tuple(pairs))]

    b.do(0, ("w", 1, ("s0", "F0")), *both(act[0]), ("w", 1, ("s0", "F1")), *both(act[1], grad[0]),
         ("w", 2, ("s0", "B0")), *both(grad[1]), ("w", 2, ("s0", "B1")), Mark(0))
    b.do(1, *both(act[0]), ("w", 3, ("s1", "F0")), ("w", 6, ("s1", "B0")), *both(grad[0], act[1]),
         ("w", 3, ("s1", "F1")), ("w", 6, ("s1", "B1")), *both(grad[1]), Mark(0))
    g = b.graph()
    run = replay(g, g.work_ns, g.transfer_ns)
    assert run.finish_ns == {0: 21.0, 1: 19.0} and run.step_end_ns == {0: 21.0}
    w = _analyze(g, {0: 0, 1: 1})
    assert w.slowdown == 1.0 and all(s.saved_ns == 0.0 for s in w.by_rank)
    assert w.stage_partition is not None
    assert w.stage_partition.saved_ns == pytest.approx(3.0) and w.stage_partition.saved_share == pytest.approx(3 / 21)
    # the first activation taking 1 to move: everything after it moves on by 1
    slow = replay(g, g.work_ns, np.where(np.arange(len(g.transfer_ns)) == act[0], 1.0, 0.0))
    assert slow.makespan_ns == 22.0


def test_a_slow_link_is_the_group_whose_transfers_exceed_its_kinds() -> None:
    """Three data-parallel groups of two, 10 of work each, one all-reduce per step for two steps (each waits for
    the group's previous one). Group g2's link moves the same bytes in 10 instead of 2. T = 2 * (10 + 10) = 40; the
    ideal transfer is the median over the groups' instances of the same op and size, 2: T_ideal = 24; fixing g2
    saves 16 of 40, and no rank is to blame."""
    b = _Builder()
    key = ("all_reduce", "dp", 4096)
    for gi, ranks in enumerate([(0, 1), (2, 3), (4, 5)]):
        transfer = 10.0 if gi == 2 else 2.0
        first = b.instance("all_reduce", ranks, transfer, group=f"g{gi}", key=key)
        second = b.instance("all_reduce", ranks, transfer, group=f"g{gi}", key=key, after=first, step=1)
        for r in ranks:
            b.do(r, ("w", 10, ("s", 0)), ("sync", first), Mark(0), ("w", 10, ("s", 1)), ("sync", second), Mark(1))
    g = b.graph()
    w = _analyze(g, dict.fromkeys(range(6), 0))
    assert (w.actual_ns, w.ideal_ns) == (40.0, 24.0)
    link = w.by_group[0]
    assert link.subject == "group:g2" and link.saved_ns == 16.0 and link.slowdown == pytest.approx(40 / 24)
    assert all(s.saved_ns == 0.0 for s in w.by_rank)


def test_an_operation_queues_behind_the_one_before_it_on_its_communicator() -> None:
    """Two asynchronous all-reduces on one group, launched at 1 and 2, 5 each: the second starts when the first
    ends (6), not at its launch: both joined at 2, the rank goes on at 11."""
    b = _Builder()
    first = b.instance("all_reduce", (0,), 5.0)
    second = b.instance("all_reduce", (0,), 5.0, after=first)
    b.do(0, ("w", 1, ("a",)), Launch(first), ("w", 1, ("b",)), Launch(second), Join((first, second)), Mark(0))
    g = b.graph()
    assert replay(g, g.work_ns, g.transfer_ns).makespan_ns == 11.0


def test_a_join_no_member_can_complete_is_a_one_line_error() -> None:
    b = _Builder()
    ar = b.instance("all_reduce", (0, 1), 1.0)
    b.do(0, ("w", 1, ("a",)), ("sync", ar), Mark(0))
    b.do(1, ("w", 1, ("a",)), Mark(0))  # rank 1's part of the all-reduce was never recorded
    g = b.graph()
    with pytest.raises(ValueError, match=r"rank 0 waits forever on all_reduce #0 of group g at step 0 .*members' "
                                         r"launches are missing"):
        replay(g, g.work_ns, g.transfer_ns)


def test_steps_argument() -> None:
    assert parse_steps("3:9") == (3, 9)
    for bad in ("9:3", "x", "1:2:3", "-1:4"):
        with pytest.raises(ValueError, match="--steps"):
            parse_steps(bad)


def test_a_transfer_held_in_most_steps_is_measured_against_the_ones_not_held() -> None:
    """Seven all-reduces of one size: four held by a stopped member (40 ns), three not (2, 2.5, 3). The median would
    be a held one; the ideal is the median of the ones not held. Transfers with no gap wider than the spread below
    it keep their median (noise), and so do ones all slow (a slow link); fewer than 3 below the gap is no mode."""
    from rankwatch.analytics.whatif.graph import _medians

    seven = np.array([2.0, 40.0, 3.0, 41.0, 40.0, 42.0, 2.5])
    assert _medians([("all_reduce", "dp", 8)] * 7, seven, held=True).tolist() == [2.5] * 7
    assert _medians([("all_reduce", "dp", 8)] * 7, seven).tolist() == [40.0] * 7  # work: the plain median
    keys = [("all_reduce", "dp", 8)] * 6
    assert _medians(keys, np.array([2.0, 40.0, 3.0, 41.0, 40.0, 42.0]), held=True).tolist() == [40.0] * 6
    assert _medians(keys, np.array([2.0, 5.0, 3.0, 7.0, 4.0, 9.0]), held=True).tolist() == [4.0] * 6
    assert _medians(keys, np.array([40.0, 41.0, 40.5, 42.0, 40.0, 41.5]), held=True).tolist() == [40.5] * 6
    assert _medians(keys, np.array([2.0, 3.0, 4.0, 40.0, 41.0, 42.0]), held=True).tolist() == [3.0] * 6


def test_a_saves_own_group_is_left_out_of_the_training_program() -> None:
    """DCP's async save runs collectives on a group of its own from a thread beside training: most of them inside
    the rank's checkpoint phases. That group is left out (with a warning naming it); a group with a collective inside
    a (synchronous) save now and then stays."""
    import polars as pl

    from rankwatch.analytics.whatif import _without_save_groups

    colls = pl.DataFrame({"rank": [0, 0, 0, 0, 1, 1], "group": ["pg1", "pg1", "world", "world", "pg1", "world"],
                          "enter_mono_ns": [10, 20, 30, 55, 12, 40], "exit_mono_ns": [15, 25, 35, 58, 14, 45]})
    warnings: list[str] = []
    kept = _without_save_groups(colls, {0: [(5, 50)], 1: [(10, 20)]}, warnings)
    assert kept["group"].to_list() == ["world", "world", "world"]
    assert warnings == ["group pg1's 3 collectives left out: 100% of them ran inside checkpoint saves (the save's own "
                        "group, beside training)"]
    assert _without_save_groups(colls, {}, []).height == 6


def test_an_async_operation_still_in_flight_is_waited_for_not_worked_for() -> None:
    """Two replicas issue their data-parallel all-reduce asynchronously (as DDP does its buckets), then a blocking
    operation of their own, and wait for the all-reduce (DDP: at the end of the backward pass). Rank 1 computes 50
    before issuing it, rank 0 10: rank 0's all-reduce is still in flight after its own operation and done at 60,
    when rank 1's arrived. Rank 0 waited for it from its operation's end on: none of that is rank 0's work, so fixing
    rank 0 saves nothing. Fixing rank 1 (10 to its launch) ends the all-reduce at 20 (launched at 10, 10 to move):
    rank 0 ends at 30 (its own operation to 25, 5 after), 35 sooner than 65; counted as rank 0's work, the wait
    would have kept it at 65 and hidden rank 1."""
    import polars as pl

    from rankwatch.analytics.whatif import Costing
    from rankwatch.analytics.whatif.build import RankSteps, build_graph

    def rank(r: int, launch: int, own: tuple[int, int]) -> RankSteps:
        ops = pl.DataFrame({
            "op": ["all_reduce", "all_reduce"], "group": ["dp", f"solo{r}"], "group_ranks": [[0, 1], [r]],
            "peer": [None, None], "bytes": [8, 8], "async_op": [True, False],
            "enter_mono_ns": [launch, own[0]], "exit_mono_ns": [60, own[1]],
            "enter_wall_ns": [launch, own[0]], "exit_wall_ns": [60, own[1]]},
            schema_overrides={"peer": pl.Int64})
        return RankSteps(rank=r, stage=0, host="h", steps=pl.DataFrame(
            {"step": [0], "start_mono_ns": [0], "end_mono_ns": [65], "checkpoint_ns": [0]}),
            collectives=ops, data=[], checkpoint=[])

    g = build_graph([rank(0, 10, (20, 25)), rank(1, 50, (52, 55))], {"dp": "dp"})
    zero = [w for w in g.programs[0] if isinstance(w, Work) and w.kind == "compute"]
    # to the launch, to its operation, inside it, waiting (none), after
    assert [g.work_ns[w.id] for w in zero] == [10.0, 10.0, 0.0, 0.0, 5.0]
    c = Costing(g, stage_of={0: 0, 1: 0}, host_of={0: "h", 1: "h"})
    zero_fix, one_fix = c.shares([c.rank_spec("rank:0", [0], own=True), c.rank_spec("rank:1", [1], own=True)])
    assert zero_fix.saved_ns == 0.0
    assert one_fix.saved_ns == 35.0


def test_on_device_clocks_no_clock_is_shared_and_the_transfer_is_the_least_time_inside() -> None:
    """Two ranks of one host meet in an all-reduce: rank 0 inside from 0 to 30, rank 1 from 20 to 25. On their host's
    clock (CPU timing) the transfer is the median member's time from the last start (7.5: rank 0 took longer to see
    it done) and rank 0's 2.5 past the transfer's end is its own lateness (an `exit` item). On device clocks no two
    ranks' times compare: the transfer is the least device time inside (5, the last kernel to start waited for no
    peer) and no lateness is read."""
    import polars as pl

    from rankwatch.analytics.whatif.build import RankSteps, build_graph

    def rank(r: int, enter: int, exit_: int) -> RankSteps:
        ops = pl.DataFrame({"op": ["all_reduce"], "group": ["dp"], "group_ranks": [[0, 1]], "peer": [None],
                            "bytes": [8], "async_op": [False], "enter_mono_ns": [enter], "exit_mono_ns": [exit_],
                            "enter_wall_ns": [enter], "exit_wall_ns": [exit_]}, schema_overrides={"peer": pl.Int64})
        return RankSteps(rank=r, stage=0, host="h", steps=pl.DataFrame(
            {"step": [0], "start_mono_ns": [0], "end_mono_ns": [35], "checkpoint_ns": [0]}),
            collectives=ops, data=[], checkpoint=[])

    ranks = [rank(0, 0, 30), rank(1, 20, 25)]
    host = build_graph(ranks, {"dp": "dp"})
    device = build_graph(ranks, {"dp": "dp"}, shared_clock=False)
    assert host.transfer_ns.tolist() == [7.5] and device.transfer_ns.tolist() == [5.0]
    lateness = [host.work_ns[w.id] for w in host.work if w.kind == "exit"]
    assert lateness == [2.5, 0.0]
    assert not [w for w in device.work if w.kind == "exit"]
