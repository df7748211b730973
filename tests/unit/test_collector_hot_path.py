"""The per-collective hot path's records: reused from a pool once written (so the garbage collector does not track one
more object per collective), never while a row or a snapshot may still need them, and device marks always returned."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from rankwatch.base.schema import CollectiveStatus, Collectives, GroupKind, Table, column_names
from rankwatch.base.topology import GroupInfo
from rankwatch.collector import Collector, CollectorConfig, FakeDeviceTimer, MemorySink

GROUP = object()
INFO = GroupInfo(name="dp", kind=GroupKind.DP, ranks=(0, 1), hosts=("host0", "host0"))
COLS = column_names(Table.COLLECTIVES)


def _collector(tmp_path: Path, sink: MemorySink, **kw: object) -> Collector:
    config = CollectorConfig(
        run_dir=tmp_path, handle_sigterm=False, inflight_after_s=0.0, **kw  # type: ignore[arg-type]
    )
    c = Collector(config, rank=0, world_size=2, host="host0", sink=sink)
    c.register_group(GROUP, INFO)
    return c


def _steps(c: Collector, first: int, steps: int, collectives: int, t: torch.Tensor) -> None:
    for i in range(first, first + steps):
        with c.step(i):
            for _ in range(collectives):
                with c.collective("all_reduce", GROUP, t):
                    pass


def test_records_are_reused_once_written_and_tracked_objects_do_not_grow_per_collective(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    t = torch.zeros(4)
    _steps(c, 0, 2, 500, t)
    assert len(sink.rows(Table.COLLECTIVES)) == 1000  # the writer drained them: back to the pool
    pool = c.tracker._pool
    assert len(pool) == 1000
    ids = {id(o) for o in pool}
    gc.collect()
    before = len(gc.get_objects())
    _steps(c, 2, 2, 500, t)
    grown = len(gc.get_objects()) - before
    assert grown < 100, f"{grown} more tracked objects after 1,000 collectives"  # two steps' records and lists
    assert {id(o) for o in c.tracker._pool} == set() and len(sink.rows(Table.COLLECTIVES)) == 2000
    assert {id(o) for o in c.tracker._pool} == ids  # the same records, reused
    rows = [dict(zip(COLS, r)) for r in sink.rows(Table.COLLECTIVES)]
    assert [r[Collectives.SEQ] for r in rows] == list(range(500)) * 4
    assert [r[Collectives.GROUP_SEQ] for r in rows] == list(range(2000))
    assert [r[Collectives.STEP] for r in rows] == [s for s in range(4) for _ in range(500)]
    assert all(r[Collectives.ENTER_MONO_NS] <= r[Collectives.EXIT_MONO_NS] for r in rows)
    assert all(r[Collectives.STATUS] == CollectiveStatus.OK and r[Collectives.BYTES] == 16 for r in rows)


def test_a_record_is_not_reused_while_its_step_or_row_still_needs_it(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    t = torch.zeros(2)
    _steps(c, 0, 1, 3, t)
    assert len(sink.rows(Table.COLLECTIVES)) == 3 and len(c.tracker._pool) == 3
    with c.step(1) as s:
        for _ in range(3):
            with c.collective("all_reduce", GROUP, t):
                pass
        late = c.tracker.enter("all_reduce", GROUP, t, async_op=True)  # exits after the step ends
        assert len(sink.rows(Table.COLLECTIVES)) == 6  # written mid-step: the step row still needs them
        assert c.tracker._pool == [] and s.written == 3
    assert {id(o) for o in c.tracker._pool} == set()
    assert len(sink.rows(Table.STEPS)) == 2 and len(c.tracker._pool) == 3  # step row built: back to the pool
    in_flight = [dict(zip(COLS, r)) for _, r in sink.snapshot_rows()]
    assert [r[Collectives.STATUS] for r in in_flight] == [CollectiveStatus.IN_FLIGHT]
    assert in_flight[0][Collectives.SEQ] == 3 and in_flight[0][Collectives.STEP] == 1
    assert all(o is not late for o in c.tracker._pool)
    c.tracker.exit(late)
    (row,) = sink.rows(Table.COLLECTIVES)[6:]
    assert dict(zip(COLS, row))[Collectives.ASYNC_OP] is True and any(o is late for o in c.tracker._pool)


def test_an_in_flight_snapshot_of_a_reused_record_shows_its_new_entry(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    _steps(c, 0, 1, 1, torch.zeros(2))
    assert len(sink.rows(Table.COLLECTIVES)) == 1
    (old,) = c.tracker._pool
    with c.step(1):
        with c.collective("broadcast", GROUP, torch.zeros(8)) as info:
            assert info == INFO
            ((_, row),) = sink.snapshot_rows()
            oldest = c.tracker.oldest_open()
    get = dict(zip(COLS, row))
    assert get[Collectives.OP] == "broadcast" and get[Collectives.BYTES] == 32 and get[Collectives.STEP] == 1
    assert get[Collectives.EXIT_MONO_NS] is None and get[Collectives.GROUP_SEQ] == 1
    assert oldest is not None and oldest is not old and oldest.op == "broadcast" and oldest.exit_mono is None
    (final,) = sink.rows(Table.COLLECTIVES)[1:]
    assert dict(zip(COLS, final))[Collectives.ENTER_MONO_NS] == get[Collectives.ENTER_MONO_NS]


def test_failed_and_loose_records_are_never_reused(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    with pytest.raises(RuntimeError):
        with c.step(0):
            with c.collective("all_reduce", GROUP, torch.zeros(2)):
                raise RuntimeError("peer closed")
    with c.collective("barrier", GROUP):
        pass
    rows = [dict(zip(COLS, r)) for r in sink.rows(Table.COLLECTIVES)]
    assert sorted((r[Collectives.OP], r[Collectives.STATUS]) for r in rows) == [
        ("all_reduce", CollectiveStatus.ERROR), ("barrier", CollectiveStatus.OK)]
    assert c.tracker._pool == []  # the collector's last failed operation keeps its record
    assert c._last_failed is not None and c._last_failed.op == "all_reduce"


def test_an_end_mark_taken_while_the_writer_gives_up_is_returned(tmp_path: Path) -> None:
    sink = MemorySink()
    dev = FakeDeviceTimer(capacity=16)
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False, inflight_after_s=60.0, device_resolve_s=0.0),
                  rank=0, world_size=2, host="host0", sink=sink, device_timer=dev)
    c.register_group(GROUP, INFO)
    with c.step(0):
        o = c.tracker.enter("all_reduce", GROUP, torch.zeros(2), async_op=True)
    dev.run_all()
    assert sink.rows(Table.STEPS) != [] and o._dev == -1  # the step was written; the writer gave up on `o`
    o.dev_end = dev.mark()  # what an exit that checked `_dev` just before the give-up records
    c.tracker.exit(o)
    assert len(sink.rows(Table.COLLECTIVES)) == 1
    assert dev.pending == 0


def test_end_marks_of_a_dropped_steps_open_operations_are_returned(tmp_path: Path) -> None:
    sink = MemorySink()
    dev = FakeDeviceTimer(capacity=64)
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False, max_pending_steps=2), rank=0, world_size=2,
                  host="host0", sink=sink, device_timer=dev)
    c.register_group(GROUP, INFO)
    opened = []
    for i in range(3):  # nothing drains meanwhile: the third step is dropped
        with c.step(i):
            opened.append(c.tracker.enter("all_reduce", GROUP, torch.zeros(2), async_op=True))
    assert c.dropped[Table.STEPS] == 1
    o = opened[-1]
    o.dev_end = dev.mark()  # an exit racing the drop took its end mark
    for op in opened:
        c.tracker.exit(op)
    dev.run_all()
    c.close(exit_code=0)
    assert len(sink.rows(Table.COLLECTIVES)) == 2 and dev.pending == 0


def test_instrumented_calls_find_their_arguments_as_bind_partial_does() -> None:
    import inspect

    import torch.distributed as dist

    from rankwatch.collector.instrument import _binder

    names = ("tensor", "group", "", "async_op")
    bind = _binder(dist.all_reduce, names)
    sig = inspect.signature(dist.all_reduce)
    t, g = torch.zeros(1), object()
    for args, kwargs in [((t,), {}), ((t,), {"group": g}), ((t, dist.ReduceOp.SUM, g, True), {}),
                         ((), {"tensor": t, "async_op": True}), ((t, dist.ReduceOp.SUM), {"group": g})]:
        bound = sig.bind_partial(*args, **kwargs).arguments
        assert bind(args, kwargs) == [bound.get(n) for n in names]
    for args, kwargs in [((t,), {"tensor": t}), ((t,), {"bogus": 1}), ((t, 1, 2, 3, 4), {})]:
        with pytest.raises(TypeError):
            bind(args, kwargs)
