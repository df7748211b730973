"""Device-side timing against the in-memory fake device: late and out-of-order marks, rows held until the device
ran, bounded pool, give-up past the bound, and the device columns of a step with phases and collectives."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rankwatch.base.schema import Collectives, EventKind, Events, GroupKind, Phases, Steps, Table, column_names
from rankwatch.base.topology import GroupInfo
from rankwatch.collector import Collector, CollectorConfig, CudaDeviceTimer, DeviceTimer, FakeDeviceTimer, MemorySink
from rankwatch.collector.collector import DEVICE_WARNING_PREFIX
from rankwatch.collector.sink import Row

GROUP = object()
INFO = GroupInfo(name="dp", kind=GroupKind.DP, ranks=(0, 1), hosts=("host0", "host0"))


def _get(table: Table, row: Row) -> dict[str, object]:
    return dict(zip(column_names(table), row))


def _collector(tmp_path: Path, timer: DeviceTimer | None, sink: MemorySink, **kw: object) -> Collector:
    config = CollectorConfig(run_dir=tmp_path, handle_sigterm=False, inflight_after_s=60.0, **kw)  # type: ignore[arg-type]
    c = Collector(config, rank=0, world_size=2, host="host0", sink=sink, device_timer=timer)
    c.register_group(GROUP, INFO)
    return c


@pytest.mark.timeout(10)
def test_fake_marks_complete_late_and_out_of_order() -> None:
    dev = FakeDeviceTimer(capacity=8)
    dev.enqueue(1_000)
    a = dev.mark()  # after 1 µs of compute work
    with dev.stream("comm"):
        b = dev.mark()  # an idle stream: completes as soon as the device runs at all
    assert a is not None and b is not None
    assert dev.done(b) and not dev.done(a)  # recorded later, completed first
    assert dev.elapsed_ns(b, a) is None  # never waits: not complete yet
    dev.run_until(999)
    assert not dev.done(a)
    dev.advance(1)
    assert dev.done(a) and dev.elapsed_ns(b, a) == 1_000 and dev.resolved == 1
    dev.release(a, b, None)
    assert dev.pending == 0 and dev.settled()


@pytest.mark.timeout(10)
def test_rows_wait_for_the_device_and_the_training_thread_never_does(tmp_path: Path) -> None:
    sink = MemorySink()
    dev = FakeDeviceTimer(capacity=64)
    c = _collector(tmp_path, dev, sink, device_resolve_s=60.0)
    t0 = time.monotonic()
    with c.step(0):
        with c.phase("forward"):
            dev.enqueue(10_000_000_000)  # 10 s of device work the fake never runs by itself
        with c.collective("all_reduce", GROUP, torch.zeros(2)):
            dev.enqueue(1_000)
    assert c.flush()
    assert time.monotonic() - t0 < 1.0  # nothing above waited for the device
    assert sink.rows(Table.STEPS) == [] and sink.rows(Table.PHASES) == [] and sink.rows(Table.COLLECTIVES) == []
    dev.run_until(5_000_000_000)
    assert sink.rows(Table.STEPS) == []  # still running on the device
    dev.run_all()
    (step,) = sink.rows(Table.STEPS)
    assert _get(Table.STEPS, step)[Steps.DEVICE_NS] == 10_000_001_000
    (phase,) = sink.rows(Table.PHASES)
    assert _get(Table.PHASES, phase)[Phases.DEVICE_DURATION_NS] == 10_000_000_000
    (op,) = sink.rows(Table.COLLECTIVES)
    assert _get(Table.COLLECTIVES, op)[Collectives.DEVICE_DURATION_NS] == 1_000
    assert dev.pending == 0 and c.device_dropped == 0


@pytest.mark.timeout(10)
def test_marks_unresolved_past_the_bound_are_dropped_counted_and_warned(tmp_path: Path) -> None:
    sink = MemorySink()
    dev = FakeDeviceTimer(capacity=64)
    c = _collector(tmp_path, dev, sink, device_resolve_s=0.0).start()
    with c.step(0):
        with c.phase("forward"):
            dev.enqueue(1_000)
        with c.collective("all_reduce", GROUP, torch.zeros(2)):
            dev.enqueue(1_000)
    time.sleep(0.001)
    (step,) = sink.rows(Table.STEPS)  # past the bound at the first flush: written with null device columns
    get = _get(Table.STEPS, step)
    assert get[Steps.DEVICE_NS] is None and get[Steps.DEVICE_COMPUTE_NS] is None
    assert get[Steps.DEVICE_COLLECTIVE_NS] is None and get[Steps.DURATION_NS] is not None
    assert [_get(Table.PHASES, r)[Phases.DEVICE_DURATION_NS] for r in sink.rows(Table.PHASES)] == [None]
    assert [_get(Table.COLLECTIVES, r)[Collectives.DEVICE_DURATION_NS] for r in sink.rows(Table.COLLECTIVES)] == [None]
    assert c.device_dropped == 1 and dev.pending == 0  # the marks went back to the pool
    c.close(exit_code=0)
    warnings = [e for e in sink.rows(Table.EVENTS) if _get(Table.EVENTS, e)[Events.KIND] == EventKind.WARNING]
    (message,) = [_get(Table.EVENTS, e)[Events.MESSAGE] for e in warnings]
    assert isinstance(message, str) and message.startswith(DEVICE_WARNING_PREFIX) and "1 step(s)" in message


@pytest.mark.timeout(10)
def test_the_pool_is_bounded_and_exhaustion_is_counted(tmp_path: Path) -> None:
    sink = MemorySink()
    dev = FakeDeviceTimer(capacity=4)
    c = _collector(tmp_path, dev, sink, device_resolve_s=60.0)
    with c.step(0):  # wants 2 + 2 * 3 marks
        for _ in range(3):
            with c.collective("all_reduce", GROUP, torch.zeros(2)):
                dev.enqueue(100)
    assert dev.pending == 4 and dev.dropped > 0 and len(dev._free) == 0
    assert dev.marks_recorded == 4
    dev.run_all()
    (step,) = sink.rows(Table.STEPS)
    get = _get(Table.STEPS, step)
    assert get[Steps.DEVICE_COLLECTIVE_NS] is None and get[Steps.DEVICE_COMPUTE_NS] is None  # one op has no marks
    durations = [_get(Table.COLLECTIVES, r)[Collectives.DEVICE_DURATION_NS] for r in sink.rows(Table.COLLECTIVES)]
    assert durations[0] == 100 and durations[-1] is None
    assert dev.pending == 0 and len(dev._all) == 4  # nothing allocated beyond the pool
    dropped = dev.dropped
    with c.step(1):  # the pool serves the next step whole again
        with c.collective("all_reduce", GROUP, torch.zeros(2)):
            dev.enqueue(100)
    dev.run_all()
    assert dev.dropped == dropped
    assert _get(Table.STEPS, sink.rows(Table.STEPS)[-1])[Steps.DEVICE_COLLECTIVE_NS] == 100


@pytest.mark.timeout(10)
def test_device_columns_of_a_step_with_phases_a_blocking_and_two_async_collectives(tmp_path: Path) -> None:
    sink = MemorySink()
    dev = FakeDeviceTimer(capacity=64)
    c = _collector(tmp_path, dev, sink, device_resolve_s=60.0)
    t = c.tracker
    bucket = torch.zeros(4)

    def async_all_reduce(work_ns: int) -> None:
        o = t.enter("all_reduce", GROUP, bucket, async_op=True)  # start mark on the compute stream
        with dev.stream("nccl"):
            dev.wait_stream("compute")
            dev.enqueue(work_ns)
        with dev.stream("callback"):  # the future's callback runs on a stream synchronized with NCCL's
            dev.wait_stream("nccl")
            t.exit(o)

    with c.step(0):  # device clock: the step starts at 0
        with c.phase("forward"):
            dev.enqueue(1_000)  # 0 .. 1000
        with c.phase("backward"):  # 1000 ..
            dev.enqueue(500)
            async_all_reduce(2_000)  # 1500 .. 3500 on nccl
            dev.enqueue(500)
            async_all_reduce(1_000)  # 2000: nccl is busy until 3500, so .. 4500
        # backward's end mark at 2000; then DDP makes the current stream wait for the buckets
        dev.wait_stream("callback")
        with c.phase("optimizer"):
            dev.enqueue(300)  # 4500 .. 4800
        with c.collective("all_reduce", GROUP, torch.zeros(1)):  # blocking: 4800 .. 5500
            with dev.stream("nccl"):
                dev.wait_stream("compute")
                dev.enqueue(700)
            dev.wait_stream("nccl")
    assert sink.rows(Table.STEPS) == []
    dev.run_until(3_600)  # the first bucket's end mark (callback stream) completed; the step's end has not
    assert sink.rows(Table.STEPS) == [] and sink.rows(Table.COLLECTIVES) == []
    dev.run_all()

    (step,) = sink.rows(Table.STEPS)
    get = _get(Table.STEPS, step)
    # collectives' union: [1500, 3500] ∪ [2000, 4500] ∪ [4800, 5500] = 3000 + 700
    assert (get[Steps.DEVICE_NS], get[Steps.DEVICE_COLLECTIVE_NS], get[Steps.DEVICE_COMPUTE_NS]) == (5_500, 3_700, 1_800)
    phases = {_get(Table.PHASES, r)[Phases.PHASE]: _get(Table.PHASES, r)[Phases.DEVICE_DURATION_NS]
              for r in sink.rows(Table.PHASES)}
    assert phases == {"forward": 1_000, "backward": 1_000, "optimizer": 300}
    ops = [_get(Table.COLLECTIVES, r) for r in sink.rows(Table.COLLECTIVES)]
    assert [o[Collectives.ASYNC_OP] for o in ops] == [True, True, False]
    assert [o[Collectives.DEVICE_DURATION_NS] for o in ops] == [2_000, 2_500, 700]
    assert [o[Collectives.DEVICE_START_NS] for o in ops] == [1_500, 2_000, 4_800]
    assert dev.pending == 0 and c.device_dropped == 0


@pytest.mark.timeout(10)
def test_marks_outside_a_step(tmp_path: Path) -> None:
    sink = MemorySink()
    dev = FakeDeviceTimer(capacity=8)
    c = _collector(tmp_path, dev, sink, device_resolve_s=60.0)
    with c.phase("eval"):
        pass  # no device work: resolved at once
    with c.collective("broadcast", GROUP, torch.zeros(2)):
        dev.enqueue(400)
    assert sink.rows(Table.COLLECTIVES) == []
    dev.run_all()
    (op,) = sink.rows(Table.COLLECTIVES)
    assert _get(Table.COLLECTIVES, op)[Collectives.DEVICE_DURATION_NS] == 400
    assert _get(Table.COLLECTIVES, op)[Collectives.DEVICE_START_NS] is None  # no step to measure from
    (phase,) = sink.rows(Table.PHASES)
    assert _get(Table.PHASES, phase)[Phases.DEVICE_DURATION_NS] == 0
    assert dev.pending == 0


@pytest.mark.timeout(10)
def test_without_a_timer_every_device_column_is_null(tmp_path: Path) -> None:
    sink = MemorySink()
    c = _collector(tmp_path, None, sink)
    with c.step(0):
        with c.phase("forward"):
            with c.collective("all_reduce", GROUP, torch.zeros(2)):
                pass
    with c.step(1):
        pass
    c.close(exit_code=0)
    assert c.device_timer is None  # a CPU-only job: no timer is chosen at the first step
    assert c.tracker._dev_mode == 0
    for step in sink.rows(Table.STEPS):
        get = _get(Table.STEPS, step)
        assert (get[Steps.DEVICE_NS], get[Steps.DEVICE_COMPUTE_NS], get[Steps.DEVICE_COLLECTIVE_NS]) == (None,) * 3
    assert [_get(Table.PHASES, r)[Phases.DEVICE_DURATION_NS] for r in sink.rows(Table.PHASES)] == [None]
    (op,) = sink.rows(Table.COLLECTIVES)
    assert _get(Table.COLLECTIVES, op)[Collectives.DEVICE_DURATION_NS] is None
    assert _get(Table.COLLECTIVES, op)[Collectives.DEVICE_START_NS] is None


def test_config_validates_device_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device_events"):
        CollectorConfig(run_dir=tmp_path, device_events=0)
    with pytest.raises(ValueError, match="device_resolve_s"):
        CollectorConfig(run_dir=tmp_path, device_resolve_s=-1.0)
    with pytest.raises(ValueError, match="capacity"):
        FakeDeviceTimer(capacity=0)


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_timer_resolves_events_without_synchronizing() -> None:
    timer = CudaDeviceTimer(capacity=4)
    x = torch.randn(2048, 2048, device="cuda")
    a = timer.mark()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    b = timer.mark()
    assert a is not None and b is not None
    deadline = time.monotonic() + 30
    ns = timer.elapsed_ns(a, b)
    while ns is None and time.monotonic() < deadline:
        time.sleep(0.001)
        ns = timer.elapsed_ns(a, b)
    assert ns is not None and ns > 0
    timer.release(a, b)
    assert timer.pending == 0 and timer.settled()
