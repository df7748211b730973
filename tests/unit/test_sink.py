"""The sink: parquet round trip, atomic part files, part numbering, bounded buffers under a stalled writer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rankwatch.base.rundir import TELEMETRY_DIR
from rankwatch.base.schema import (
    LOW_PRIORITY, PARTITION_KEY, SCHEMA_VERSION, SCHEMA_VERSION_KEY, EventKind, Events, Gpu, Table,
    column_names, storage_schema,
)
from rankwatch.collector import sink as sink_mod
from rankwatch.collector.sink import MemorySink, ParquetSink, Row, SinkConfig, partition_dir, rows_to_table
from schema_support import schema_row as _row

FAST = SinkConfig(flush_interval_s=0.02)
#: Only explicit flushes (or a full part) wake the writer.
MANUAL = SinkConfig(flush_interval_s=60.0)


def _event(i: int, *, rank: int = 0, kind: EventKind = EventKind.HEARTBEAT) -> Row:
    return _row(
        Table.EVENTS,
        **{
            Events.RANK: rank,
            Events.ATTEMPT: 0,
            Events.WALL_NS: 1_700_000_000_000_000_000 + i,
            Events.MONO_NS: 5_000_000 + i,
            Events.KIND: str(kind),
            Events.STEP: i,
            Events.MESSAGE: f"event {i}",
        },
    )


def _gpu(i: int, *, rank: int = 0) -> Row:
    return _row(
        Table.GPU,
        **{
            Gpu.RANK: rank,
            Gpu.DEVICE_INDEX: rank,
            Gpu.DEVICE_UUID: f"GPU-{rank:08d}-0000-0000-0000-000000000000",
            Gpu.PCI_BUS_ID: f"00000000:{rank:02X}:00.0",
            Gpu.SOURCE: "replay",
            Gpu.WALL_NS: 1_700_000_000_000_000_000 + i,
            Gpu.MONO_NS: 5_000_000 + i,
            Gpu.STEP: i,
            Gpu.SM_CLOCK_MHZ: 1980,
            Gpu.POWER_W: 612.5,
            Gpu.TEMPERATURE_C: 61.0,
            Gpu.THROTTLE_REASONS: 0x40 if i % 2 else 0,
            Gpu.XID_EVENTS: [79] if i == 3 else [],
        },
    )


def _dicts(table: Table, rows: list[Row]) -> list[dict[str, object]]:
    return [dict(zip(column_names(table), r)) for r in rows]


def _parts(run_dir: Path, table: Table, rank: int) -> list[Path]:
    d = partition_dir(run_dir, table, rank)
    return sorted(d.glob("part-*.parquet")) if d.exists() else []


def _read(run_dir: Path, table: Table, rank: int = 0) -> list[dict[str, object]]:
    """Every row of a rank's partition, parts in order, each part read by pyarrow on its own."""
    out: list[dict[str, object]] = []
    for p in _parts(run_dir, table, rank):
        out += pq.read_table(p).to_pylist()
    return out


def _hidden(run_dir: Path) -> list[Path]:
    return [p for p in Path(run_dir).rglob("*") if p.is_file() and not p.name.startswith("part-")]


@pytest.fixture
def sinks() -> Iterator[list[ParquetSink]]:
    """Sinks a test starts; closed at teardown so no writer thread outlives its test."""
    made: list[ParquetSink] = []
    yield made
    for s in made:
        s.close(timeout_s=5)


def _sink(sinks: list[ParquetSink], run_dir: Path, rank: int = 0, config: SinkConfig = FAST) -> ParquetSink:
    s = ParquetSink(run_dir, rank, config)
    sinks.append(s)
    s.start()
    return s


# -- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"flush_interval_s": 0},
        {"flush_interval_s": -1.0},
        {"max_buffered_rows": 0},
        {"low_priority_max_rows": 0},
        {"rows_per_part": 0},
    ],
)
def test_sink_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SinkConfig(**kwargs)


def test_sink_config_capacity_is_smaller_for_low_priority_tables() -> None:
    cfg = SinkConfig(max_buffered_rows=100, low_priority_max_rows=7)
    assert LOW_PRIORITY == {Table.GPU, Table.PHASES}
    for t in Table:
        assert cfg.capacity(t) == (7 if t in LOW_PRIORITY else 100)


# -- helpers --------------------------------------------------------------------------------------------


def test_partition_dir_is_hive_layout(tmp_path: Path) -> None:
    assert partition_dir(tmp_path, Table.EVENTS, 3) == tmp_path / TELEMETRY_DIR / "events" / f"{PARTITION_KEY}=3"
    assert partition_dir(str(tmp_path), Table.GPU, 0) == tmp_path / "telemetry" / "gpu" / "rank=0"


def test_rows_to_table_uses_storage_schema() -> None:
    rows = [_event(0), _event(1)]
    t = rows_to_table(Table.EVENTS, rows)
    assert t.schema.equals(storage_schema(Table.EVENTS), check_metadata=True)
    assert t.to_pylist() == _dicts(Table.EVENTS, rows)
    empty = rows_to_table(Table.GPU, [])
    assert empty.num_rows == 0 and empty.schema.equals(storage_schema(Table.GPU))


def test_rows_to_table_rejects_a_value_of_the_wrong_type() -> None:
    bad = list(_event(0))
    bad[column_names(Table.EVENTS).index(Events.WALL_NS)] = "not a clock"
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        rows_to_table(Table.EVENTS, [tuple(bad)])


# -- memory sink ----------------------------------------------------------------------------------------


def test_memory_sink_keeps_rows_counts_drops_and_snapshots() -> None:
    s = MemorySink(capacity=2)
    for i in range(3):
        s.append(Table.EVENTS, _event(i))
    assert s.rows(Table.EVENTS) == [_event(0), _event(1)]
    assert s.table(Table.EVENTS).to_pylist() == _dicts(Table.EVENTS, [_event(0), _event(1)])
    assert s.dropped[Table.EVENTS] == 1 and s.dropped_total == 1
    assert s.snapshot_rows() == []
    s.set_snapshot(lambda: [(Table.GPU, _gpu(0))])
    assert s.snapshot_rows() == [(Table.GPU, _gpu(0))]
    assert s.flush(0.0) is True
    s.close()
    s.append(Table.GPU, _gpu(1))
    assert s.rows(Table.GPU) == [] and s.dropped[Table.GPU] == 1


# -- parquet round trip ---------------------------------------------------------------------------------


def test_rows_round_trip_through_part_files(tmp_path: Path, sinks: list[ParquetSink]) -> None:
    written: dict[int, tuple[list[Row], list[Row]]] = {}
    for rank in (0, 1):
        s = _sink(sinks, tmp_path, rank, MANUAL)
        events = [_event(i, rank=rank) for i in range(5)]
        gpus = [_gpu(i, rank=rank) for i in range(4)]
        for r in events[:3]:
            s.append(Table.EVENTS, r)
        for r in gpus:
            s.append(Table.GPU, r)
        assert s.flush(timeout_s=10) is True
        for r in events[3:]:
            s.append(Table.EVENTS, r)
        s.close()
        written[rank] = (events, gpus)
        assert s.write_errors == 0 and s.dropped_total == 0
        assert s.parts_written == 3 and s.bytes_written > 0

    for rank, (events, gpus) in written.items():
        parts = _parts(tmp_path, Table.EVENTS, rank)
        assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet"]
        assert [p.name for p in _parts(tmp_path, Table.GPU, rank)] == ["part-000000.parquet"]
        assert _read(tmp_path, Table.EVENTS, rank) == _dicts(Table.EVENTS, events)
        assert _read(tmp_path, Table.GPU, rank) == _dicts(Table.GPU, gpus)
        for p in parts:
            assert pq.read_schema(p).metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert _hidden(tmp_path) == []
    assert not partition_dir(tmp_path, Table.STEPS, 0).exists()  # nothing buffered, no empty part

    con = duckdb.connect()
    try:
        for table, idx in ((Table.EVENTS, 0), (Table.GPU, 1)):
            glob = tmp_path / TELEMETRY_DIR / str(table) / "*" / "*.parquet"
            cols = ", ".join(column_names(table))
            got = con.execute(
                f"SELECT {cols} FROM read_parquet('{glob}', hive_partitioning=true) ORDER BY rank, wall_ns"
            ).fetchall()
            expected = [r for rank in (0, 1) for r in written[rank][idx]]
            assert [tuple(r) for r in got] == [tuple(r) for r in expected]
        per_rank = con.execute(
            f"SELECT rank, count(*) FROM read_parquet('{tmp_path}/telemetry/events/*/*.parquet', "
            "hive_partitioning=true) GROUP BY rank ORDER BY rank"
        ).fetchall()
        assert per_rank == [(0, 5), (1, 5)]
    finally:
        con.close()


def test_a_full_buffer_wakes_the_writer_before_the_interval(tmp_path: Path, sinks: list[ParquetSink]) -> None:
    s = _sink(sinks, tmp_path, 0, SinkConfig(flush_interval_s=60.0, rows_per_part=10))
    for i in range(10):
        s.append(Table.EVENTS, _event(i))
    deadline = time.monotonic() + 5
    while not _parts(tmp_path, Table.EVENTS, 0) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _parts(tmp_path, Table.EVENTS, 0), "a buffer reaching rows_per_part did not wake the writer"


def test_an_unstarted_sink_writes_inline(tmp_path: Path) -> None:
    s = ParquetSink(tmp_path, 2, MANUAL)
    s.append(Table.EVENTS, _event(0, rank=2))
    assert s.flush() is True
    assert _read(tmp_path, Table.EVENTS, 2) == _dicts(Table.EVENTS, [_event(0, rank=2)])
    s.close()


def test_part_numbering_continues_after_existing_parts(tmp_path: Path, sinks: list[ParquetSink]) -> None:
    first = _sink(sinks, tmp_path, 0, MANUAL)
    for i in range(2):
        first.append(Table.EVENTS, _event(i))
        assert first.flush(timeout_s=10)
    first.close()

    second = _sink(sinks, tmp_path, 0, MANUAL)  # e.g. the rank restarted into the same run
    second.append(Table.EVENTS, _event(2))
    second.append(Table.GPU, _gpu(0))
    other_rank = _sink(sinks, tmp_path, 1, MANUAL)
    other_rank.append(Table.EVENTS, _event(0, rank=1))
    second.close()
    other_rank.close()

    assert [p.name for p in _parts(tmp_path, Table.EVENTS, 0)] == [
        "part-000000.parquet",
        "part-000001.parquet",
        "part-000002.parquet",
    ]
    assert _read(tmp_path, Table.EVENTS, 0) == _dicts(Table.EVENTS, [_event(i) for i in range(3)])
    assert [p.name for p in _parts(tmp_path, Table.GPU, 0)] == ["part-000000.parquet"]
    assert [p.name for p in _parts(tmp_path, Table.EVENTS, 1)] == ["part-000000.parquet"]


# -- failures -------------------------------------------------------------------------------------------


def test_a_failed_write_leaves_no_partial_part_and_retries(
    tmp_path: Path, sinks: list[ParquetSink], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = sink_mod.pq.write_table
    targets: list[Path] = []

    def half_write(table: pa.Table, where: Any, **kwargs: Any) -> None:
        targets.append(Path(where))
        Path(where).write_bytes(b"PAR1\x00\x01 half a parquet file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sink_mod.pq, "write_table", half_write)
    s = _sink(sinks, tmp_path, 0, MANUAL)
    before = [_event(i) for i in range(4)]
    for r in before:
        s.append(Table.EVENTS, r)
    assert s.flush(timeout_s=10) is True

    assert len(targets) == 1
    assert not targets[0].name.startswith("part-")  # the bytes went to a hidden name readers never glob
    assert s.write_errors == 1
    assert _parts(tmp_path, Table.EVENTS, 0) == []
    assert _hidden(tmp_path) == []  # the temporary file was removed
    assert s.buffered_rows() == len(before)  # requeued, not lost
    assert s.dropped_total == 0 and s.parts_written == 0

    monkeypatch.setattr(sink_mod.pq, "write_table", real_write)
    after = [_event(i) for i in range(4, 6)]
    for r in after:
        s.append(Table.EVENTS, r)
    assert s.flush(timeout_s=10) is True
    assert s.write_errors == 1 and s.buffered_rows() == 0
    assert _read(tmp_path, Table.EVENTS) == _dicts(Table.EVENTS, before + after)  # order kept
    assert _hidden(tmp_path) == []


def test_requeue_after_a_failure_respects_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = ParquetSink(tmp_path, 0, SinkConfig(flush_interval_s=60.0, max_buffered_rows=10))
    real_write = sink_mod.pq.write_table
    first = [_event(i) for i in range(10)]
    meanwhile = [_event(i) for i in range(100, 105)]

    def fail_while_rows_arrive(table: pa.Table, where: Any, **kwargs: Any) -> None:
        for r in meanwhile:  # the training thread keeps appending while the write fails
            s.append(Table.EVENTS, r)
        raise OSError("I/O error")

    monkeypatch.setattr(sink_mod.pq, "write_table", fail_while_rows_arrive)
    for r in first:
        s.append(Table.EVENTS, r)
    s.flush()
    assert s.write_errors == 1
    assert s.buffered_rows() == 10
    assert s.dropped[Table.EVENTS] == 5  # 10 failed + 5 new, room for 10

    monkeypatch.setattr(sink_mod.pq, "write_table", real_write)
    s.close()
    got = _read(tmp_path, Table.EVENTS)
    assert len(got) == 10
    assert got[-5:] == _dicts(Table.EVENTS, meanwhile)


# -- a stalled writer -----------------------------------------------------------------------------------


def test_stalled_writer_keeps_buffers_bounded_and_appends_fast(
    tmp_path: Path, sinks: list[ParquetSink], monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = threading.Event()
    release = threading.Event()
    real_write_part = ParquetSink._write_part

    def stalled(self: ParquetSink, table: Table, rows: list[Row]) -> None:
        entered.set()
        release.wait(30)
        real_write_part(self, table, rows)

    monkeypatch.setattr(ParquetSink, "_write_part", stalled)
    cfg = SinkConfig(flush_interval_s=0.01, max_buffered_rows=5_000, low_priority_max_rows=500, rows_per_part=1_000)
    s = _sink(sinks, tmp_path, 0, cfg)
    try:
        s.append(Table.EVENTS, _event(-1))
        assert entered.wait(5), "writer never picked up the first row"
        assert s.flush(timeout_s=0.05) is False  # the writer holds that row and is stuck

        n = 200_000
        template = _event(0)
        k = column_names(Table.EVENTS).index(Events.STEP)
        events = [template[:k] + (i,) + template[k + 1 :] for i in range(n)]
        gpu = _gpu(0)
        cap = cfg.max_buffered_rows + cfg.low_priority_max_rows
        peak = 0
        t0 = time.monotonic()
        for i, ev in enumerate(events):
            s.append(Table.EVENTS, ev)
            s.append(Table.GPU, gpu)
            if i % 10_000 == 0:
                peak = max(peak, s.buffered_rows())
        elapsed = time.monotonic() - t0
        peak = max(peak, s.buffered_rows())

        assert elapsed < 5.0, f"{2 * n} appends took {elapsed:.2f}s with the writer stalled"
        assert peak <= cap
        assert s.buffered_rows() == cap
        assert s.dropped[Table.EVENTS] == n - cfg.max_buffered_rows
        assert s.dropped[Table.GPU] == n - cfg.low_priority_max_rows
        assert s.dropped_total == 2 * n - cap
        assert s.flush(timeout_s=0.05) is False
    finally:
        release.set()

    assert s.flush(timeout_s=10) is True
    s.close()
    assert s.write_errors == 0
    got = _read(tmp_path, Table.EVENTS)
    assert len(got) == 1 + cfg.max_buffered_rows
    assert got[0] == _dicts(Table.EVENTS, [_event(-1)])[0]
    assert [r[Events.STEP] for r in got[1:]] == list(range(cfg.max_buffered_rows))  # the newest were dropped
    assert len(_read(tmp_path, Table.GPU)) == cfg.low_priority_max_rows


# -- close ----------------------------------------------------------------------------------------------


def test_close_flushes_everything_and_later_appends_are_dropped(tmp_path: Path) -> None:
    s = ParquetSink(tmp_path, 0, MANUAL)
    s.start()
    rows = [_event(i) for i in range(7)]
    for r in rows:
        s.append(Table.EVENTS, r)
    s.append(Table.GPU, _gpu(0))
    s.close(timeout_s=10)
    assert _read(tmp_path, Table.EVENTS) == _dicts(Table.EVENTS, rows)
    assert _read(tmp_path, Table.GPU) == _dicts(Table.GPU, [_gpu(0)])

    s.append(Table.EVENTS, _event(99))
    s.append(Table.GPU, _gpu(99))
    assert s.dropped == {**{t: 0 for t in Table}, Table.EVENTS: 1, Table.GPU: 1}
    assert s.buffered_rows() == 0
    s.close()  # idempotent
    s.flush()
    assert len(_read(tmp_path, Table.EVENTS)) == len(rows)


def test_rows_appended_while_close_joins_the_writer_are_not_lost_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = ParquetSink(tmp_path, 0, MANUAL)
    s.start()
    late = _gpu(7)
    real_join = threading.Thread.join

    def join_then_append(self: threading.Thread, timeout: float | None = None) -> None:
        real_join(self, timeout)
        if self.name.startswith("rankwatch-sink"):
            s.append(Table.GPU, late)  # e.g. the GPU monitor thread samples during close

    monkeypatch.setattr(threading.Thread, "join", join_then_append)
    s.close(timeout_s=10)
    monkeypatch.setattr(threading.Thread, "join", real_join)
    written = len(_read(tmp_path, Table.GPU))
    assert written + s.dropped[Table.GPU] == 1


# -- snapshots ------------------------------------------------------------------------------------------


def test_snapshot_rows_are_added_at_each_flush(tmp_path: Path, sinks: list[ParquetSink]) -> None:
    calls = 0

    def in_flight() -> list[tuple[Table, Row]]:
        nonlocal calls
        calls += 1
        return [(Table.EVENTS, _event(1000 + calls, kind=EventKind.WARNING))]

    s = _sink(sinks, tmp_path, 0, MANUAL)
    s.set_snapshot(in_flight)
    s.append(Table.EVENTS, _event(0))
    assert s.flush(timeout_s=10)
    assert s.flush(timeout_s=10)  # nothing buffered: the snapshot alone is written

    got = _read(tmp_path, Table.EVENTS)
    assert got == _dicts(Table.EVENTS, [_event(0), _event(1001, kind=EventKind.WARNING)]) + _dicts(
        Table.EVENTS, [_event(1002, kind=EventKind.WARNING)]
    )
    assert len(_parts(tmp_path, Table.EVENTS, 0)) == 2
    s.set_snapshot(None)
    s.close()
    assert len(_read(tmp_path, Table.EVENTS)) == 3


def test_a_failing_snapshot_does_not_stop_the_writer(tmp_path: Path, sinks: list[ParquetSink]) -> None:
    def broken() -> list[tuple[Table, Row]]:
        raise RuntimeError("snapshot exploded")

    s = _sink(sinks, tmp_path, 0, MANUAL)
    s.set_snapshot(broken)
    s.append(Table.EVENTS, _event(0))
    assert s.flush(timeout_s=10) is True
    assert s.write_errors == 1
    assert _read(tmp_path, Table.EVENTS) == _dicts(Table.EVENTS, [_event(0)])

    s.append(Table.EVENTS, _event(1))
    assert s.flush(timeout_s=10) is True  # the writer thread is still alive and serving flushes
    assert s.write_errors == 2
    assert _read(tmp_path, Table.EVENTS) == _dicts(Table.EVENTS, [_event(0), _event(1)])


def test_the_writer_flushes_on_its_own_interval(tmp_path: Path, sinks: list[ParquetSink]) -> None:
    s = _sink(sinks, tmp_path, 0, FAST)
    s.append(Table.GPU, _gpu(0))
    deadline = time.monotonic() + 5
    while not _parts(tmp_path, Table.GPU, 0) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _read(tmp_path, Table.GPU) == _dicts(Table.GPU, [_gpu(0)])


# -- a full disk ----------------------------------------------------------------------------------------


def _enospc(calls: list[Path], *, failures: int | None = None, real: Any = None) -> Any:
    """A `pq.write_table` that fails with ENOSPC (the first `failures` calls, or always), recording each target."""

    def write(table: pa.Table, where: Any, **kwargs: Any) -> None:
        calls.append(Path(where))
        if failures is None or len(calls) <= failures:
            raise OSError(28, "No space left on device")
        real(table, where, **kwargs)

    return write


def test_evidence_tables_are_written_before_low_priority_ones(
    tmp_path: Path, sinks: list[ParquetSink], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(sink_mod.pq, "write_table", _enospc(calls, failures=0, real=sink_mod.pq.write_table))
    s = _sink(sinks, tmp_path, 0, MANUAL)
    s.append(Table.GPU, _gpu(0))  # appended first, written last: on a full disk the evidence fits first
    s.append(Table.EVENTS, _event(0))
    assert s.flush(timeout_s=10)
    assert [p.parent.parent.name for p in calls] == [str(Table.EVENTS), str(Table.GPU)]
    assert LOW_PRIORITY and Table.GPU in LOW_PRIORITY


def test_a_full_disk_keeps_rows_until_space_frees_and_says_so(
    tmp_path: Path, sinks: list[ParquetSink], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(sink_mod.pq, "write_table", _enospc(calls, failures=3, real=sink_mod.pq.write_table))
    s = _sink(sinks, tmp_path, 0, MANUAL)
    rows = [_event(i) for i in range(5)]
    with caplog.at_level("WARNING", logger="rankwatch.collector"):
        for r in rows[:3]:
            s.append(Table.EVENTS, r)
        for _ in range(3):  # three flushes on a full disk: the rows stay buffered, nothing half-written is left
            assert s.flush(timeout_s=10)
            assert s.buffered_rows() == 3 and _parts(tmp_path, Table.EVENTS, 0) == [] and _hidden(tmp_path) == []
        assert s.write_errors == 3 and s.last_write_error is not None and "No space left" in s.last_write_error
        for r in rows[3:]:
            s.append(Table.EVENTS, r)
        assert s.flush(timeout_s=10)  # space freed: everything lands, in order
    assert _read(tmp_path, Table.EVENTS) == _dicts(Table.EVENTS, rows)
    assert s.dropped_total == 0
    logged = [r.getMessage() for r in caplog.records]
    assert len([m for m in logged if "write failed" in m]) == 1  # once per spell, not once per retry
    assert any("writing again after 3 failed flush(es)" in m for m in logged), logged


def test_close_retries_a_full_disk_then_counts_and_names_the_rows_it_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(sink_mod.pq, "write_table", _enospc(calls))
    s = ParquetSink(tmp_path, 0, SinkConfig(flush_interval_s=60.0, close_retry_s=0.3))
    s.start()
    for i in range(5):
        s.append(Table.EVENTS, _event(i))
    s.append(Table.GPU, _gpu(0))
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="rankwatch.collector"):
        s.close(timeout_s=10)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert len(calls) > 4  # the flush, the final write and the retries, two tables each
    assert s.dropped == {**{t: 0 for t in Table}, Table.EVENTS: 5, Table.GPU: 1}
    assert s.buffered_rows() == 0 and _hidden(tmp_path) == []
    assert any("6 row(s) could not be written and are dropped" in r.getMessage() for r in caplog.records)


def test_close_writes_the_rows_once_space_frees_within_its_retry_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(sink_mod.pq, "write_table", _enospc(calls, failures=3, real=sink_mod.pq.write_table))
    s = ParquetSink(tmp_path, 0, SinkConfig(flush_interval_s=60.0, close_retry_s=5.0))
    s.start()
    rows = [_event(i) for i in range(4)]
    for r in rows:
        s.append(Table.EVENTS, r)
    s.close(timeout_s=10)
    assert _read(tmp_path, Table.EVENTS) == _dicts(Table.EVENTS, rows)
    assert s.dropped_total == 0 and s.write_errors == 3


def test_sink_config_rejects_a_negative_close_retry() -> None:
    with pytest.raises(ValueError, match="close_retry_s"):
        SinkConfig(close_retry_s=-1.0)


def test_a_part_that_does_not_fit_is_halved_until_what_fits_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write, room = sink_mod.pq.write_table, [200]  # the disk holds 200 more rows, then is full

    def small_disk(table: pa.Table, where: Any, **kwargs: Any) -> None:
        if table.num_rows > room[0]:
            raise OSError(28, "No space left on device")
        room[0] -= table.num_rows
        real_write(table, where, **kwargs)

    monkeypatch.setattr(sink_mod.pq, "write_table", small_disk)
    s = ParquetSink(tmp_path, 0, MANUAL)
    rows = [_event(i) for i in range(300)]
    for r in rows:
        s.append(Table.EVENTS, r)
    s.flush()
    assert len(_read(tmp_path, Table.EVENTS)) == 150 and s.buffered_rows() == 150  # the oldest half fitted
    assert s.last_write_error == "events: disk full: 150 of 300 rows written" and _hidden(tmp_path) == []
    room[0] = 1000  # space frees
    s.close()
    assert _read(tmp_path, Table.EVENTS) == _dicts(Table.EVENTS, rows) and s.dropped_total == 0


@pytest.mark.timeout(60)
def test_the_writer_pays_pyarrows_first_conversion_as_it_starts_not_at_the_first_flush(tmp_path: Path) -> None:
    """pyarrow 26 imports pandas (when installed) at its first `pa.array`, whatever the input: ~0.2 s of CPU, which
    the first flush spent in the middle of training (benchmarks/collector_cost.py counted it: the writer's CPU over
    a 60-step run fell from 3.9 to 0.15 ms a step). A fresh interpreter: starting the sink, with no flush, imports
    it on the writer thread."""
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from rankwatch.collector.sink import ParquetSink\n"
        "assert 'pandas' not in sys.modules, 'imported before the sink started'\n"
        f"s = ParquetSink({str(tmp_path)!r}, rank=0)\n"
        "s.start()\n"
        "deadline = time.monotonic() + 10\n"
        "while 'pandas' not in sys.modules and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print('warm' if 'pandas' in sys.modules else 'cold')\n"
        "s.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=40)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "warm", out.stdout
