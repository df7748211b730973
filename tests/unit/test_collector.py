"""The collector facade against an in-memory sink: step decomposition, collectives, events, failure paths."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from rankwatch.base.schema import (
    CheckpointPhase, CollectiveStatus, Collectives, EventKind, Events, Fingerprints, GroupKind, Steps, Table,
    column_names,
)
from rankwatch.base.topology import GroupInfo
from rankwatch.collector import Collector, CollectorConfig, MemorySink, NullCollector
from rankwatch.collector.sink import Row, Sink

GROUP = object()
INFO = GroupInfo(name="tp.pp0.dp0", kind=GroupKind.TP, ranks=(0, 1), hosts=("host0", "host1"))


def _col(table: Table, rows: list[Row], name: str) -> list[object]:
    i = column_names(table).index(name)
    return [r[i] for r in rows]


def _collector(tmp_path: Path, sink: Sink | None = None, **kw: object) -> Collector:
    c = Collector(
        CollectorConfig(run_dir=tmp_path, heartbeat_interval_s=0.05, inflight_after_s=0.0, handle_sigterm=False, **kw),  # type: ignore[arg-type]
        rank=0,
        world_size=2,
        host="host0",
        sink=sink or MemorySink(),
    )
    c.register_group(GROUP, INFO)
    return c


def test_step_row_decomposes_time(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink).start()
    loader = c.wrap_loader(iter([1, 2, 3]), position=lambda: 96)
    with c.step(0) as s:
        time.sleep(0.02)  # compute
        next(loader)
        with c.collective("all_reduce", GROUP, torch.zeros(4)):
            time.sleep(0.03)  # blocked in the collective
        with c.checkpoint_phase(0, "step-0", CheckpointPhase.WRITE, nbytes=10):
            time.sleep(0.01)
        s.loss = torch.tensor(0.5)
        s.tokens = torch.tensor(4000)  # e.g. attention_mask.sum(): a 0-d tensor is taken as its count
    with c.step(1) as s:
        s.tokens = "many"  # type: ignore[assignment]  # not a count: null, never an error into training
    c.close(exit_code=0)
    row, second = sink.rows(Table.STEPS)
    get = dict(zip(column_names(Table.STEPS), row))
    assert get[Steps.DURATION_NS] >= 60e6
    assert 30e6 <= get[Steps.COLLECTIVE_WAIT_NS] < 45e6
    assert get[Steps.CHECKPOINT_NS] >= 10e6
    assert get[Steps.COMPUTE_NS] == (
        get[Steps.DURATION_NS] - get[Steps.COLLECTIVE_WAIT_NS] - get[Steps.DATALOADER_WAIT_NS] - get[Steps.CHECKPOINT_NS]
    )
    assert 18e6 <= get[Steps.COMPUTE_NS] < 40e6
    assert get[Steps.LOSS] == 0.5 and get[Steps.ALL_FINITE] is True
    assert get[Steps.DATA_POSITION] == 96 and get[Steps.NUM_COLLECTIVES] == 1
    assert get[Steps.TOKENS] == 4000 and dict(zip(column_names(Table.STEPS), second))[Steps.TOKENS] is None
    (coll,) = sink.rows(Table.COLLECTIVES)
    assert dict(zip(column_names(Table.COLLECTIVES), coll))[Collectives.BYTES] == 16
    kinds = _col(Table.EVENTS, sink.rows(Table.EVENTS), Events.KIND)
    assert kinds[0] == EventKind.START and kinds[-1] == EventKind.EXIT


def test_fetch_before_step_counts_as_dataloader_wait(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)

    def slow_source():
        time.sleep(0.03)
        yield 1

    batches = c.wrap_loader(slow_source())
    next(batches)
    with c.step(3):
        pass
    (row,) = sink.rows(Table.STEPS)
    get = dict(zip(column_names(Table.STEPS), row))
    assert get[Steps.DATALOADER_WAIT_NS] >= 30e6
    assert get[Steps.DURATION_NS] >= get[Steps.DATALOADER_WAIT_NS]


def test_failed_collective_records_error_row_and_exception_event(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    with pytest.raises(RuntimeError, match="peer closed"):
        with c.step(7):
            with c.collective("all_reduce", GROUP, torch.zeros(2)):
                raise RuntimeError("peer closed the connection")
    (coll,) = sink.rows(Table.COLLECTIVES)
    get = dict(zip(column_names(Table.COLLECTIVES), coll))
    assert get[Collectives.STATUS] == CollectiveStatus.ERROR and "peer closed" in get[Collectives.ERROR]
    events = [dict(zip(column_names(Table.EVENTS), r)) for r in sink.rows(Table.EVENTS)]
    (exc,) = [e for e in events if e[Events.KIND] == EventKind.EXCEPTION]
    assert exc[Events.COLLECTIVE_OP] == "all_reduce" and exc[Events.COLLECTIVE_GROUP] == INFO.name
    assert exc[Events.STEP] == 7 and exc[Events.EXC_TYPE] == "RuntimeError"
    assert sink.rows(Table.STEPS) == []  # a step that raised writes no step row


def test_open_collective_is_snapshotted_in_flight(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    with c.step(1):
        with c.collective("all_reduce", GROUP, torch.zeros(2)):
            (table, row), = sink.snapshot_rows()
            get = dict(zip(column_names(Table.COLLECTIVES), row))
            assert table is Table.COLLECTIVES and get[Collectives.STATUS] == CollectiveStatus.IN_FLIGHT
            assert get[Collectives.EXIT_WALL_NS] is None and get[Collectives.STEP] == 1
    assert sink.snapshot_rows() == []


def test_heartbeats_continue_while_training_thread_is_blocked(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink).start()
    with c.step(0):
        with c.collective("all_reduce", GROUP, torch.zeros(2)):
            time.sleep(0.3)
    c.close()
    beats = [dict(zip(column_names(Table.EVENTS), r)) for r in sink.rows(Table.EVENTS)]
    beats = [b for b in beats if b[Events.KIND] == EventKind.HEARTBEAT]
    assert len(beats) >= 3
    assert any(b[Events.COLLECTIVE_OP] == "all_reduce" for b in beats)


class _BrokenSink(MemorySink):
    def append(self, table: Table, row: Row) -> None:
        raise OSError("disk on fire")


def test_collector_never_raises_into_training(tmp_path: Path) -> None:
    c = _collector(tmp_path, _BrokenSink())
    model = torch.nn.Linear(2, 2)
    with c.step(0) as s:
        s.loss = 1.0
        with c.phase("forward"):
            pass
    c.maybe_fingerprint(0, model, domain="d", domain_ranks=[0])
    c.event(EventKind.WARNING, message="x")
    c.record_topology()
    c.close()
    assert c.errors >= 4


def test_fingerprint_every_n_and_deterministic(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink, fingerprint_every=5)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    for step in range(11):
        c.maybe_fingerprint(step, model, domain="dp.pp0.tp0", domain_ranks=[0, 2], data_position=step * 8)
    rows = sink.rows(Table.FINGERPRINTS)
    assert _col(Table.FINGERPRINTS, rows, Fingerprints.STEP) == [0, 5, 10]
    assert len(set(_col(Table.FINGERPRINTS, rows, Fingerprints.PARAM_HASH))) == 1
    with torch.no_grad():
        model.weight.view(-1).view(torch.int32)[0] ^= 1  # one flipped bit
    c.maybe_fingerprint(11, model, domain="dp.pp0.tp0", domain_ranks=[0, 2], force=True)
    assert _col(Table.FINGERPRINTS, sink.rows(Table.FINGERPRINTS), Fingerprints.PARAM_HASH)[-1] \
        != _col(Table.FINGERPRINTS, rows, Fingerprints.PARAM_HASH)[0]


def test_null_collector_mirrors_the_public_surface() -> None:
    public = {n for n, v in inspect.getmembers(Collector) if not n.startswith("_") and callable(v)}
    assert public <= {n for n in dir(NullCollector) if not n.startswith("_")}


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="flush_interval_s"):
        CollectorConfig(run_dir=Path("."), flush_interval_s=0)
    with pytest.raises(ValueError, match="fingerprint_every"):
        CollectorConfig(run_dir=Path("."), fingerprint_every=-1)
    with pytest.raises(ValueError, match="max_pending_steps must be >= 2, got 1"):
        CollectorConfig(run_dir=Path("."), max_pending_steps=1)


def _rank3_after_a_step(tmp_path: Path, then: str) -> str:
    """A script: rank 3's collector started on `tmp_path` (part files only at close), one step, then `then`."""
    return textwrap.dedent(
        f"""
        import os, signal, sys, time
        from pathlib import Path
        from rankwatch.collector import Collector, CollectorConfig
        c = Collector(CollectorConfig(run_dir=Path({str(tmp_path)!r}), flush_interval_s=60), rank=3, world_size=4)
        c.start()
        with c.step(0):
            pass
        """
    ) + textwrap.dedent(then)


def _rank3_events(tmp_path: Path) -> list[dict[str, object]]:
    parts = sorted((tmp_path / "telemetry" / "events" / "rank=3").glob("part-*.parquet"))
    return sorted((e for p in parts for e in pq.read_table(p).to_pylist()), key=lambda e: e["wall_ns"])


@pytest.mark.timeout(60)
def test_sigterm_records_signal_and_flushes(tmp_path: Path) -> None:
    script = _rank3_after_a_step(tmp_path, """
        print("ready", flush=True)
        time.sleep(60)
        """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    events = _rank3_events(tmp_path)
    kinds = [e["kind"] for e in events]
    assert EventKind.SIGNAL in kinds and kinds[-1] == EventKind.EXIT
    assert [e["signal"] for e in events if e["kind"] == EventKind.SIGNAL] == [signal.SIGTERM]
    assert list((tmp_path / "telemetry" / "steps" / "rank=3").glob("part-*.parquet"))


@pytest.mark.timeout(60)
def test_a_sigterm_while_closing_on_its_own_lets_the_close_finish(tmp_path: Path) -> None:
    """A rank that raised is closing (its exception recorded) when the manager's stop SIGTERMs it: the close it is in
    finishes and flushes — the exception stays its last word — instead of the signal ending it mid-flush."""
    script = _rank3_after_a_step(tmp_path, """
        c.exception(RuntimeError("CUDA error: unspecified launch failure"))
        flush = c.sink.close
        def stopped_mid_close(**kw):
            os.kill(os.getpid(), signal.SIGTERM)  # the manager's stop, while the sink has not flushed yet
            time.sleep(0.2)
            flush(**kw)
        c.sink.close = stopped_mid_close
        c.close(exit_code=1)
        print("closed", flush=True)
        os._exit(1)
        """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "closed"
        assert proc.wait(timeout=30) == 1
    kinds = [e["kind"] for e in _rank3_events(tmp_path)]
    assert EventKind.EXCEPTION in kinds and EventKind.SIGNAL not in kinds and kinds[-1] == EventKind.EXIT


def test_device_rows_are_resolved_later_without_waiting(tmp_path: Path) -> None:
    from rankwatch.collector import FakeDeviceTimer

    sink = MemorySink()
    device = FakeDeviceTimer(capacity=16)
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False, inflight_after_s=0.0, device_resolve_s=60.0),
                  rank=0, world_size=2, host="host0", sink=sink, device_timer=device)
    c.register_group(GROUP, INFO)
    idx = column_names(Table.COLLECTIVES).index(Collectives.DEVICE_DURATION_NS)
    with c.step(0):
        for ns in (1_500_000, 2_000_000):
            with c.collective("all_reduce", GROUP, torch.zeros(2)):
                device.enqueue(ns)
        assert sink.rows(Table.COLLECTIVES) == []  # a flush mid-step: the device has run neither yet
        device.run_until(1_500_000)
        assert [r[idx] for r in sink.rows(Table.COLLECTIVES)] == [1_500_000]  # the done one only
        assert [r[idx] for r in sink.rows(Table.COLLECTIVES)] == [1_500_000]  # still pending, not written twice
    assert [r[idx] for r in sink.rows(Table.COLLECTIVES)] == [1_500_000] and sink.rows(Table.STEPS) == []
    device.run_all()
    assert [r[idx] for r in sink.rows(Table.COLLECTIVES)] == [1_500_000, 2_000_000]
    assert device.pending == 0


def test_close_polls_outstanding_device_marks_only_briefly(tmp_path: Path) -> None:
    from rankwatch.collector import FakeDeviceTimer

    sink = MemorySink()
    device = FakeDeviceTimer(capacity=16)
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False, device_resolve_s=0.2),
                  rank=0, world_size=2, host="host0", sink=sink, device_timer=device)
    c.register_group(GROUP, INFO)
    with c.step(0):
        with c.collective("all_reduce", GROUP, torch.zeros(2)):
            device.enqueue(2_000_000)  # never run: the fake device is stuck
    start = time.monotonic()
    c.close(exit_code=0)
    assert time.monotonic() - start < 2.0
    idx = column_names(Table.COLLECTIVES).index(Collectives.DEVICE_DURATION_NS)
    assert [r[idx] for r in sink.rows(Table.COLLECTIVES)] == [None] and c.device_dropped == 1
    assert device.pending == 0


def test_topology_row_without_gpu_has_pid_host_and_process_numa_node(tmp_path: Path) -> None:
    from rankwatch.base.schema import Topology
    from rankwatch.collector.collector import _process_numa_node

    sink = MemorySink()
    c = _collector(tmp_path, sink)
    c.record_topology(dp=1, tp=0, pp=0, dp_size=2)
    (row,) = sink.rows(Table.TOPOLOGY)
    get = dict(zip(column_names(Table.TOPOLOGY), row))
    assert get[Topology.PID] == os.getpid() and get[Topology.HOST] == "host0"
    assert get[Topology.NUMA_NODE] == _process_numa_node()
    assert get[Topology.DEVICE_UUID] is None
    (group,) = get[Topology.GROUPS]
    assert group["name"] == INFO.name and group["links"] == ["host0<->host1"]


def test_rows_are_built_by_the_writer_once_each_even_mid_step(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    with c.step(4):
        with c.phase("forward"):
            with c.collective("all_reduce", GROUP, torch.zeros(2)):
                pass
        with c.collective("broadcast", GROUP, torch.zeros(2)):
            # a flush while the step runs (a hung step): the exited collective is written now, the open one is not
            assert _col(Table.COLLECTIVES, sink.rows(Table.COLLECTIVES), Collectives.OP) == ["all_reduce"]
            assert sink.rows(Table.STEPS) == [] and sink.rows(Table.PHASES) == []
    rows = sink.rows(Table.COLLECTIVES)
    assert _col(Table.COLLECTIVES, rows, Collectives.OP) == ["all_reduce", "broadcast"]
    assert _col(Table.COLLECTIVES, rows, Collectives.SEQ) == [0, 1]
    assert _col(Table.COLLECTIVES, rows, Collectives.GROUP_SEQ) == [0, 1]
    (step,) = sink.rows(Table.STEPS)
    get = dict(zip(column_names(Table.STEPS), step))
    for r in rows:  # wall-clock times derived from the step's wall - monotonic offset
        coll = dict(zip(column_names(Table.COLLECTIVES), r))
        offset = get[Steps.START_WALL_NS] - get[Steps.START_MONO_NS]
        assert coll[Collectives.ENTER_WALL_NS] - coll[Collectives.ENTER_MONO_NS] == offset
        assert coll[Collectives.EXIT_WALL_NS] - coll[Collectives.EXIT_MONO_NS] == offset
        assert coll[Collectives.DURATION_NS] == coll[Collectives.EXIT_MONO_NS] - coll[Collectives.ENTER_MONO_NS]
        assert coll[Collectives.STEP] == 4 and coll[Collectives.STATUS] == CollectiveStatus.OK
    assert abs(get[Steps.START_WALL_NS] - time.time_ns()) < 60e9
    assert _col(Table.PHASES, sink.rows(Table.PHASES), "phase") == ["forward"]


def test_collective_and_phase_outside_a_step_are_written_at_exit(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    with c.phase("setup"):
        with c.collective("barrier", GROUP):
            assert c.tracker.oldest_open() is not None
    assert c.tracker.oldest_open() is None
    (coll,) = sink.rows(Table.COLLECTIVES)
    get = dict(zip(column_names(Table.COLLECTIVES), coll))
    assert get[Collectives.STEP] == -1 and get[Collectives.OP] == "barrier" and get[Collectives.BYTES] == 0
    assert abs(get[Collectives.ENTER_WALL_NS] - time.time_ns()) < 60e9
    assert _col(Table.PHASES, sink.rows(Table.PHASES), "step") == [-1]


def test_a_writer_behind_drops_phases_first_then_steps_and_counts_them(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink, max_pending_steps=4)
    for i in range(6):  # nothing drains meanwhile: the writer is stalled
        with c.step(i):
            with c.phase("forward"):
                pass
            with c.collective("all_reduce", GROUP, torch.zeros(2)):
                pass
    assert c.dropped[Table.PHASES] == 4 and c.dropped[Table.STEPS] == 2 and c.dropped[Table.COLLECTIVES] == 2
    assert _col(Table.STEPS, sink.rows(Table.STEPS), Steps.STEP) == [0, 1, 2, 3]
    assert _col(Table.PHASES, sink.rows(Table.PHASES), "step") == [0, 1]
    c.close(exit_code=0)
    drops = [r for r in sink.rows(Table.EVENTS) if dict(zip(column_names(Table.EVENTS), r))[Events.KIND] == EventKind.DROPS]
    assert drops and dict(zip(column_names(Table.EVENTS), drops[-1]))[Events.DROPPED_ROWS] == 8


class _Work:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        f: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        f.set_result([self.t])
        return f


class _Bucket:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def buffer(self) -> torch.Tensor:
        return self.t


def test_ddp_hook_records_the_local_gradient_norm_before_the_all_reduce(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, async_op=False: _Work(t))
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    hook = c.ddp_comm_hook(GROUP)
    buckets = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]  # the rank's own gradients: norm 13
    with c.step(0):
        out = [hook(None, _Bucket(b)).wait() for b in buckets]
    assert torch.allclose(out[0], torch.tensor([1.0, 4.0 / 3]))  # averaged over the 3 ranks, as DDP's own hook
    (row,) = sink.rows(Table.STEPS)
    assert dict(zip(column_names(Table.STEPS), row))[Steps.LOCAL_GRAD_NORM] == pytest.approx(13.0, rel=1e-6)
    ops = _col(Table.COLLECTIVES, sink.rows(Table.COLLECTIVES), Collectives.ASYNC_OP)
    assert ops == [True, True]


def test_a_training_thread_crash_on_a_full_disk_keeps_its_rows_for_when_space_frees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rankwatch.collector import sink as sink_mod
    from rankwatch.collector.sink import ParquetSink, SinkConfig, partition_dir

    real_write, calls = sink_mod.pq.write_table, [0]

    def full_for_a_while(table: object, where: object, **kwargs: object) -> None:
        calls[0] += 1
        if calls[0] <= 12:  # the exception's flush and the first close attempts fail: the disk is full
            raise OSError(28, "No space left on device")
        real_write(table, where, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sink_mod.pq, "write_table", full_for_a_while)
    sink = ParquetSink(tmp_path, 0, SinkConfig(flush_interval_s=60.0, close_retry_s=10.0))
    c = _collector(tmp_path, sink)
    with pytest.raises(RuntimeError, match="training thread died"):
        with c:
            for i in range(3):
                with c.step(i):
                    with c.collective("all_reduce", GROUP, torch.zeros(2)):
                        pass
            raise RuntimeError("training thread died")
    assert calls[0] > 12 and sink.write_errors == 12

    def read(table: Table) -> list[dict[str, object]]:
        return [r for part in sorted(partition_dir(tmp_path, table, 0).glob("part-*.parquet"))
                for r in pq.read_table(part).to_pylist()]

    assert [r[Steps.STEP] for r in read(Table.STEPS)] == [0, 1, 2]
    assert len(read(Table.COLLECTIVES)) == 3
    events = {r[Events.KIND]: r for r in read(Table.EVENTS)}
    assert events[EventKind.EXCEPTION][Events.EXC_TYPE] == "RuntimeError"
    assert events[EventKind.EXIT][Events.EXIT_CODE] == 1 and events[EventKind.EXIT][Events.DROPPED_ROWS] == 0
    assert "telemetry writes failed" in events[EventKind.WARNING][Events.MESSAGE]
    assert sink.dropped_total == 0
