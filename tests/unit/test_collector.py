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

from rankwatch.collector import Collector, CollectorConfig, MemorySink, NullCollector
from rankwatch.collector.collectives import GroupInfo
from rankwatch.collector.schema import (
    CheckpointPhase,
    CollectiveStatus,
    Collectives,
    EventKind,
    Events,
    Fingerprints,
    GroupKind,
    Steps,
    Table,
    column_names,
)
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
    c.close(exit_code=0)
    (row,) = sink.rows(Table.STEPS)
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
    assert _col(Table.FINGERPRINTS, sink.rows(Table.FINGERPRINTS), Fingerprints.PARAM_HASH)[-1] != rows[0][5]


def test_null_collector_mirrors_the_public_surface() -> None:
    public = {n for n, v in inspect.getmembers(Collector) if not n.startswith("_") and callable(v)}
    assert public <= {n for n in dir(NullCollector) if not n.startswith("_")}


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="flush_interval_s"):
        CollectorConfig(run_dir=Path("."), flush_interval_s=0)
    with pytest.raises(ValueError, match="fingerprint_every"):
        CollectorConfig(run_dir=Path("."), fingerprint_every=-1)


@pytest.mark.timeout(60)
def test_sigterm_records_signal_and_flushes(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from rankwatch.collector import Collector, CollectorConfig
        c = Collector(CollectorConfig(run_dir=Path({str(tmp_path)!r}), flush_interval_s=60), rank=3, world_size=4)
        c.start()
        with c.step(0):
            pass
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    events = pq.read_table(next((tmp_path / "telemetry" / "events" / "rank=3").glob("part-*.parquet"))).to_pylist()
    kinds = [e["kind"] for e in events]
    assert EventKind.SIGNAL in kinds and kinds[-1] == EventKind.EXIT
    assert [e["signal"] for e in events if e["kind"] == EventKind.SIGNAL] == [signal.SIGTERM]
    assert list((tmp_path / "telemetry" / "steps" / "rank=3").glob("part-*.parquet"))


class _FakeEvent:
    """Stands in for torch.cuda.Event: completes when told, records whether anyone synchronized."""

    def __init__(self, done: bool, ms: float = 0.0) -> None:
        self.done = done
        self.ms = ms
        self.synchronized = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = True
        self.done = True

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return end.ms


def test_cuda_rows_are_resolved_later_without_synchronizing(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, sink)
    tracker = c.tracker
    with c.step(0):
        o1 = tracker.enter("all_reduce", GROUP, torch.zeros(2))
        o2 = tracker.enter("all_reduce", GROUP, torch.zeros(2))
    done, pending = _FakeEvent(True, 1.5), _FakeEvent(False, 2.0)
    for o, end in ((o1, done), (o2, pending)):
        o.cuda_start = _FakeEvent(True)
        row = tracker._row(o, 1, 1, 1, None, CollectiveStatus.OK, None)
        o.cuda_end = end
        tracker._pending_cuda.append((o, row))
    tracker.resolve_cuda()
    idx = column_names(Table.COLLECTIVES).index(Collectives.DEVICE_DURATION_NS)
    assert [r[idx] for r in sink.rows(Table.COLLECTIVES)] == [1_500_000]
    assert not pending.synchronized and len(tracker._pending_cuda) == 1
    tracker.resolve_cuda(wait=True)  # at close: wait for the rest
    assert [r[idx] for r in sink.rows(Table.COLLECTIVES)] == [1_500_000, 2_000_000]
    assert pending.synchronized


def test_topology_row_without_gpu_has_pid_host_and_process_numa_node(tmp_path: Path) -> None:
    from rankwatch.collector.collector import _process_numa_node
    from rankwatch.collector.schema import Topology

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
