from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pynvml
import pytest

from rankwatch.base.schema import Gpu, Table, ThrottleReason, column_names, schema_for
from rankwatch.collector import gpu
from rankwatch.collector.gpu import (
    H100_SXM, DeviceInfo, GpuMonitor, GpuSample, GpuSampler, GpuUnavailable, NvmlSampler, ReplaySampler, open_sampler,
    replay_uuid,
)

UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND


class FakeNvml:
    """Stands in for the pynvml module: device 0 is a full H100, device 1 lacks many readings.

    Constants and NVMLError classes come from the real module; any NVML function not defined here is an
    AttributeError, so a misspelled or unexpected call fails the test instead of reading as None.
    """

    def __init__(self, *, init_error: int | None = None) -> None:
        self.init_error = init_error
        self.handles = [self._handle(i) for i in range(2)]
        self.pending_events: list[tuple[int, int]] = []
        self.registered: list[int] = []
        self.shutdowns = 0
        self.freed = 0

    def __getattr__(self, name: str) -> object:
        if name.startswith(("NVML", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    @staticmethod
    def _handle(index: int) -> object:
        # A fresh ctypes pointer each time, like the handle NVML puts into event data.
        return ctypes.cast(ctypes.c_void_p(0x1000 * (index + 1)), pynvml.c_nvmlDevice_t)

    @staticmethod
    def _index(handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        assert address is not None
        return address // 0x1000 - 1

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _err(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        if not 0 <= index < 2:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handles[index]

    def nvmlDeviceGetUUID(self, h: object) -> str:
        return f"GPU-{self._index(h):08x}-1111-2222-3333-444444444444"

    def nvmlDeviceGetPciInfo(self, h: object) -> SimpleNamespace:
        return SimpleNamespace(busId=b"00000000:18:00.0" if self._index(h) == 0 else "00000000:2A:00.0")

    def nvmlDeviceGetName(self, h: object) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetNumaNodeId(self, h: object) -> int:
        if self._index(h) == 1:
            raise _err(NOT_SUPPORTED)
        return 0

    def nvmlDeviceGetClockInfo(self, h: object, clock: int) -> int:
        if clock == pynvml.NVML_CLOCK_SM:
            return 1980 if self._index(h) == 0 else 1185
        assert clock == pynvml.NVML_CLOCK_MEM
        return 2619

    def nvmlDeviceGetMaxClockInfo(self, h: object, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetPowerUsage(self, h: object) -> int:
        if self._index(h) == 1:
            raise _err(NOT_SUPPORTED)
        return 612_345

    def nvmlDeviceGetEnforcedPowerLimit(self, h: object) -> int:
        return 700_000

    def nvmlDeviceGetTemperatureV(self, h: object, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        if self._index(h) == 1:
            raise _err(FUNCTION_NOT_FOUND)
        return 67

    def nvmlDeviceGetTemperature(self, h: object, sensor: int) -> int:
        return 71

    def nvmlDeviceGetUtilizationRates(self, h: object) -> SimpleNamespace:
        return SimpleNamespace(gpu=97, memory=41)

    def nvmlDeviceGetMemoryInfo(self, h: object) -> SimpleNamespace:
        return SimpleNamespace(total=80 * 2**30, free=20 * 2**30, used=60 * 2**30)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: object) -> int:
        if self._index(h) == 1:
            raise _err(FUNCTION_NOT_FOUND)
        return 0

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: object) -> int:
        return int(ThrottleReason.HW_THERMAL_SLOWDOWN)

    def nvmlDeviceGetTotalEccErrors(self, h: object, error_type: int, counter_type: int) -> int:
        if self._index(h) == 1:
            raise _err(NOT_SUPPORTED)
        corrected = error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        volatile = counter_type == pynvml.NVML_VOLATILE_ECC
        return {(True, True): 1, (False, True): 0, (True, False): 5, (False, False): 2}[(corrected, volatile)]

    def nvmlDeviceGetPcieReplayCounter(self, h: object) -> int:
        if self._index(h) == 1:
            raise _err(NOT_SUPPORTED)
        return 3

    def nvmlDeviceGetNvLinkState(self, h: object, link: int) -> int:
        assert 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS
        if self._index(h) == 1:
            raise _err(NOT_SUPPORTED)
        if link >= 18:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 0 if link == 3 else 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: object, link: int, counter: int) -> int:
        assert self._index(h) == 0 and link != 3
        values = {
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 1,
            pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: 2,
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 3,
        }
        if counter not in values:
            raise _err(NOT_SUPPORTED)
        return values[counter]

    def nvmlDeviceGetRetiredPages(self, h: object, cause: int) -> list[int]:
        if self._index(h) == 0:
            raise _err(NOT_SUPPORTED)
        if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
            return [0x1000, 0x2000]
        assert cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        return [0x3000]

    def nvmlDeviceGetRemappedRows(self, h: object) -> tuple[int, int, int, int]:
        if self._index(h) == 1:
            raise _err(NOT_SUPPORTED)
        return (1, 0, 1, 0)

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: object, types: int, event_set: str) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError and event_set == "event-set"
        self.registered.append(self._index(h))

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0
        if not self.pending_events:
            raise _err(pynvml.NVML_ERROR_TIMEOUT)
        index, code = self.pending_events.pop(0)
        return SimpleNamespace(
            device=self._handle(index), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=code
        )

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed += 1


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setattr(gpu, "pynvml", fake)
    (tmp_path / "0000:2a:00.0").mkdir()
    (tmp_path / "0000:2a:00.0" / "numa_node").write_text("1\n")
    monkeypatch.setattr(gpu, "_SYSFS_PCI_DEVICES", tmp_path)
    return fake


def _ticker(start: int, step: int) -> Callable[[], int]:
    counter = itertools.count(start, step)
    return lambda: next(counter)


# ------------------------------------------------------------------------------------------- GpuSample


def test_sample_fields_are_the_gpu_columns_without_rank_and_step() -> None:
    fields = [f.name for f in dataclasses.fields(GpuSample)]
    assert fields == [c for c in column_names(Table.GPU) if c not in (Gpu.RANK, Gpu.STEP)]


def test_row_follows_the_schema_order_and_builds_a_table() -> None:
    sample = ReplaySampler(host="h0", indices=[0]).sample(0)
    sample = dataclasses.replace(sample, xid_events=(79,), temperature_c=None)
    row = sample.row(rank=3, step=7)
    names = column_names(Table.GPU)
    by_name = dict(zip(names, row, strict=True))
    assert by_name[Gpu.RANK] == 3 and by_name[Gpu.STEP] == 7
    assert by_name[Gpu.XID_EVENTS] == [79]
    assert by_name[Gpu.SM_CLOCK_MHZ] == sample.sm_clock_mhz
    assert by_name[Gpu.DEVICE_UUID] == sample.device_uuid
    table = pa.Table.from_pylist([by_name], schema=schema_for(Table.GPU))
    assert table.num_rows == 1
    assert table.column(Gpu.TEMPERATURE_C).null_count == 1


# ------------------------------------------------------------------------------------------------ NVML


def test_nvml_absent_raises_gpu_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "pynvml", FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(GpuUnavailable, match="nvmlInit failed"):
        NvmlSampler()


def test_real_pynvml_without_driver_raises_gpu_unavailable() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")
    with pytest.raises(GpuUnavailable, match="NVML unavailable"):
        NvmlSampler()


def test_gpu_module_calls_only_names_the_installed_pynvml_has() -> None:
    source = Path(gpu.__file__).read_text()
    names = set(re.findall(r"\bpynvml\.(\w+)", source))
    assert names and not [n for n in sorted(names) if not hasattr(pynvml, n)]


def test_nvml_sampler_describes_devices(fake_nvml: FakeNvml) -> None:
    sampler = NvmlSampler()
    assert list(sampler.devices()) == [
        DeviceInfo(
            index=0,
            uuid="GPU-00000000-1111-2222-3333-444444444444",
            pci_bus_id="00000000:18:00.0",
            name="NVIDIA H100 80GB HBM3",
            numa_node=0,
        ),
        DeviceInfo(
            index=1,
            uuid="GPU-00000001-1111-2222-3333-444444444444",
            pci_bus_id="00000000:2A:00.0",
            name="NVIDIA H100 80GB HBM3",
            numa_node=1,  # from sysfs
        ),
    ]
    assert fake_nvml.registered == [0, 1]


def test_nvml_sampler_maps_readings(fake_nvml: FakeNvml) -> None:
    sampler = NvmlSampler(indices=[0])
    s = sampler.sample(0)
    assert (s.device_index, s.source, s.pci_bus_id) == (0, "nvml", "00000000:18:00.0")
    assert (s.sm_clock_mhz, s.mem_clock_mhz, s.sm_clock_max_mhz) == (1980, 2619, 1980)
    assert s.power_w == pytest.approx(612.345) and s.power_limit_w == pytest.approx(700.0)
    assert s.temperature_c == 67.0
    assert (s.gpu_util_pct, s.mem_util_pct, s.mem_used_bytes) == (97.0, 41.0, 60 * 2**30)
    assert s.throttle_reasons == 0
    assert (s.ecc_sbe_volatile, s.ecc_dbe_volatile, s.ecc_sbe_aggregate, s.ecc_dbe_aggregate) == (1, 0, 5, 2)
    assert s.pcie_replay == 3
    # 17 active links (link 3 down); CRC = flit + data; recovery unsupported on every link.
    assert (s.nvlink_crc_errors, s.nvlink_replay_errors, s.nvlink_recovery_errors) == (17 * 3, 17 * 3, None)
    assert (s.retired_pages_sbe, s.retired_pages_dbe) == (None, None)
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable, s.remapped_rows_pending) == (1, 0, True)
    assert s.xid_events == ()
    assert s.wall_ns > 0 and s.mono_ns > 0


def test_nvml_unsupported_readings_become_none(fake_nvml: FakeNvml) -> None:
    s = NvmlSampler().sample(1)
    assert s.power_w is None and s.power_limit_w == pytest.approx(700.0)
    assert s.temperature_c == 71.0  # legacy call when the versioned one is missing
    assert s.throttle_reasons == int(ThrottleReason.HW_THERMAL_SLOWDOWN)  # deprecated-name fallback
    assert s.sm_clock_mhz == 1185
    assert s.ecc_sbe_volatile is None and s.ecc_dbe_aggregate is None and s.pcie_replay is None
    assert (s.nvlink_crc_errors, s.nvlink_replay_errors, s.nvlink_recovery_errors) == (None, None, None)
    assert (s.retired_pages_sbe, s.retired_pages_dbe) == (2, 1)
    assert s.remapped_rows_correctable is None and s.remapped_rows_pending is None
    table = pa.Table.from_pylist(
        [dict(zip(column_names(Table.GPU), s.row(rank=0, step=-1), strict=True))], schema=schema_for(Table.GPU)
    )
    assert table.num_rows == 1


def test_nvml_xid_events_go_to_their_device_once(fake_nvml: FakeNvml) -> None:
    sampler = NvmlSampler()
    fake_nvml.pending_events += [(1, 79), (0, 48), (1, 94)]
    assert sampler.sample(0).xid_events == (48,)
    assert sampler.sample(1).xid_events == (79, 94)
    assert sampler.sample(0).xid_events == () and sampler.sample(1).xid_events == ()


def test_nvml_bad_index_is_unavailable_and_close_is_idempotent(fake_nvml: FakeNvml) -> None:
    with pytest.raises(GpuUnavailable, match=r"devices \[5\]"):
        NvmlSampler(indices=[5])
    assert fake_nvml.shutdowns == 1
    sampler = NvmlSampler(indices=[0])
    sampler.close()
    sampler.close()
    assert (fake_nvml.shutdowns, fake_nvml.freed) == (2, 1)


# ---------------------------------------------------------------------------------------------- replay


def test_replay_healthy_series_is_in_range() -> None:
    sampler = ReplaySampler(host="node07", indices=[0, 5], seed=3)
    p = H100_SXM
    for _ in range(200):
        for index in (0, 5):
            s = sampler.sample(index)
            assert s.source == "replay" and s.device_index == index
            assert s.sm_clock_max_mhz == 1980 and p.sm_clock_max_mhz - 60 <= (s.sm_clock_mhz or 0) <= 1980
            assert s.mem_clock_mhz == 2619 and s.power_limit_w == 700.0
            assert 55.0 <= (s.temperature_c or 0) <= 75.0
            assert 450.0 <= (s.power_w or 0) <= 650.0
            assert 85.0 <= (s.gpu_util_pct or 0) <= 100.0
            assert 0 < (s.mem_used_bytes or 0) < p.memory_total_bytes
            assert s.throttle_reasons == 0 and s.xid_events == ()
            assert (s.ecc_sbe_volatile, s.ecc_dbe_aggregate, s.pcie_replay, s.nvlink_crc_errors) == (0, 0, 0, 0)
            assert s.remapped_rows_pending is False and s.retired_pages_dbe is None


def test_replay_devices_have_stable_realistic_identity() -> None:
    a = ReplaySampler(host="node07", indices=[3], seed=1)
    b = ReplaySampler(host="node07", indices=[0, 3], seed=2)
    dev_a, dev_b = a.devices()[0], b.devices()[1]
    assert dev_a == dev_b
    assert dev_a.uuid == replay_uuid("node07", 3) and UUID_RE.match(dev_a.uuid)
    assert replay_uuid("node08", 3) != dev_a.uuid and replay_uuid("node07", 4) != dev_a.uuid
    assert re.match(r"^00000000:[0-9A-F]{2}:00\.0$", dev_a.pci_bus_id)
    assert len({d.pci_bus_id for d in ReplaySampler(host="x", indices=range(8)).devices()}) == 8


def test_replay_is_deterministic_by_seed() -> None:
    def series(seed: int) -> list[GpuSample]:
        sampler = ReplaySampler(
            host="node07", indices=[0, 1], seed=seed, wall_clock=_ticker(10**18, 10**9), mono_clock=_ticker(0, 10**9)
        )
        return [sampler.sample(i) for _ in range(20) for i in (0, 1)]

    assert series(5) == series(5)
    assert series(5) != series(6)


def test_replay_throttle_and_clear() -> None:
    sampler = ReplaySampler(host="h", indices=[0, 1])
    sampler.throttle(0)
    for _ in range(10):
        s = sampler.sample(0)
        assert 1100 <= (s.sm_clock_mhz or 0) <= 1200
        assert (s.throttle_reasons or 0) & ThrottleReason.HW_THERMAL_SLOWDOWN
        assert 88.0 <= (s.temperature_c or 0) <= 92.0
        assert sampler.sample(1).throttle_reasons == 0
    sampler.throttle(0, reason=ThrottleReason.SW_POWER_CAP, sm_clock_mhz=1500)
    s = sampler.sample(0)
    assert s.sm_clock_mhz == 1500 and s.throttle_reasons == ThrottleReason.SW_POWER_CAP
    assert 698.0 <= (s.power_w or 0) <= 700.0 and (s.temperature_c or 0) <= 75.0
    sampler.clear_throttle(0)
    s = sampler.sample(0)
    assert s.throttle_reasons == 0 and (s.sm_clock_mhz or 0) >= 1920
    with pytest.raises(ValueError):
        sampler.throttle(7)


def test_replay_ecc_xid_pcie_nvlink_injection() -> None:
    sampler = ReplaySampler(host="h", indices=[0, 1])
    sampler.add_ecc(0, sbe=2, dbe=1)
    sampler.add_xid(0, 79)
    sampler.add_pcie_replays(0, 4)
    sampler.add_nvlink_errors(0, crc=5, replay=1)
    s = sampler.sample(0)
    assert (s.ecc_sbe_volatile, s.ecc_dbe_volatile, s.ecc_sbe_aggregate, s.ecc_dbe_aggregate) == (2, 1, 2, 1)
    assert s.remapped_rows_uncorrectable == 1 and s.remapped_rows_pending is True
    assert s.xid_events == (79,)
    assert (s.pcie_replay, s.nvlink_crc_errors, s.nvlink_replay_errors, s.nvlink_recovery_errors) == (4, 5, 1, 0)
    again = sampler.sample(0)
    assert again.xid_events == () and again.ecc_dbe_aggregate == 1 and again.pcie_replay == 4
    sampler.add_ecc(0, sbe=1)
    assert sampler.sample(0).ecc_sbe_aggregate == 3
    other = sampler.sample(1)
    assert (other.ecc_sbe_volatile, other.xid_events, other.pcie_replay) == (0, (), 0)


def test_replay_controls_are_safe_from_another_thread() -> None:
    sampler = ReplaySampler(host="h", indices=[0])
    done = threading.Event()

    def inject() -> None:
        for _ in range(200):
            sampler.add_ecc(0, sbe=1)
            sampler.add_xid(0, 13)
        done.set()

    thread = threading.Thread(target=inject)
    thread.start()
    xids = 0
    while not done.is_set():
        xids += len(sampler.sample(0).xid_events)
    thread.join()
    last = sampler.sample(0)
    assert xids + len(last.xid_events) == 200 and last.ecc_sbe_aggregate == 200


def _record(sampler: GpuSampler, n: int) -> pa.Table:
    rows = [
        dict(zip(column_names(Table.GPU), sampler.sample(d.index).row(rank=0, step=step), strict=True))
        for step in range(n)
        for d in sampler.devices()
    ]
    return pa.Table.from_pylist(rows, schema=schema_for(Table.GPU))


def test_from_table_replays_the_recorded_series() -> None:
    live = ReplaySampler(host="node02", indices=[0, 1], seed=9)
    live.throttle(1, reason=ThrottleReason.HW_SLOWDOWN)
    live.add_xid(0, 48)
    table = _record(live, 6)
    replay = ReplaySampler.from_table(table, wall_clock=_ticker(7, 1), mono_clock=_ticker(100, 1))
    assert [d.uuid for d in replay.devices()] == [d.uuid for d in live.devices()]
    for index in (0, 1):
        recorded = table.filter(pc.equal(table[Gpu.DEVICE_INDEX], index))
        clocks = recorded.column(Gpu.SM_CLOCK_MHZ).to_pylist()
        replayed = [replay.sample(index) for _ in range(2 * len(clocks))]
        assert [s.sm_clock_mhz for s in replayed] == clocks * 2
        assert [s.temperature_c for s in replayed] == recorded.column(Gpu.TEMPERATURE_C).to_pylist() * 2
        assert [list(s.xid_events) for s in replayed] == recorded.column(Gpu.XID_EVENTS).to_pylist() * 2
        assert all(s.source == "replay" and s.wall_ns < 100 for s in replayed)
    assert table.column(Gpu.XID_EVENTS).to_pylist()[0] == [48]


def test_from_table_rejects_several_hosts() -> None:
    table = pa.concat_tables([_record(ReplaySampler(host=h, indices=[0]), 2) for h in ("a", "b")])
    with pytest.raises(ValueError, match="filter it to one host"):
        ReplaySampler.from_table(table)
    with pytest.raises(ValueError, match="no rows for device indices"):
        ReplaySampler.from_table(_record(ReplaySampler(host="a", indices=[0]), 1), indices=[2])


# ---------------------------------------------------------------------------------------- open_sampler


def test_open_sampler_without_nvml_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gpu, "pynvml", FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    monkeypatch.setattr(gpu, "_warned_unavailable", False)
    caplog.set_level(logging.WARNING, logger="rankwatch.collector")
    assert open_sampler("auto", host="h", indices=[0]) is None
    assert open_sampler("auto", host="h", indices=[0]) is None
    assert open_sampler("nvml", host="h", indices=[0]) is None
    records = [r for r in caplog.records if r.name == "rankwatch.collector"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "NVML" in records[0].getMessage()


def test_open_sampler_nvml_warning_says_it_was_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gpu, "pynvml", FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    monkeypatch.setattr(gpu, "_warned_unavailable", False)
    caplog.set_level(logging.WARNING, logger="rankwatch.collector")
    assert open_sampler("nvml", host="h", indices=[0]) is None
    assert "asked for" in caplog.records[0].getMessage()


def test_open_sampler_kinds(fake_nvml: FakeNvml) -> None:
    assert open_sampler("off", host="h", indices=[0]) is None
    replay = open_sampler("replay", host="h", indices=[2], seed=1)
    assert isinstance(replay, ReplaySampler) and [d.index for d in replay.devices()] == [2]
    nvml = open_sampler("auto", host="h", indices=[1])
    assert isinstance(nvml, NvmlSampler) and [d.index for d in nvml.devices()] == [1]
    with pytest.raises(ValueError, match="auto, nvml, replay, off"):
        open_sampler("bogus", host="h", indices=[0])


# ------------------------------------------------------------------------------------------ GpuMonitor


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_monitor_samples_first_at_start_then_every_interval() -> None:
    got: list[GpuSample] = []
    slow = GpuMonitor(ReplaySampler(host="h", indices=[0, 1]), got.append, interval_s=60.0)
    slow.start()
    _wait_for(lambda: len(got) >= 2)
    slow.stop()
    assert [s.device_index for s in got] == [0, 1] and slow.errors == 0

    got.clear()
    fast = GpuMonitor(ReplaySampler(host="h", indices=[0]), got.append, interval_s=0.005, name="t-gpu")
    fast.start()
    _wait_for(lambda: len(got) >= 5)
    fast.stop()
    assert not any(t.name == "t-gpu" for t in threading.enumerate())


class _FlakySampler(GpuSampler):
    source = "replay"

    def __init__(self) -> None:
        self._inner = ReplaySampler(host="h", indices=[0, 1])

    def devices(self) -> Sequence[DeviceInfo]:
        return self._inner.devices()

    def sample(self, index: int) -> GpuSample:
        if index == 1:
            raise RuntimeError("device fell off the bus")
        return self._inner.sample(index)


def test_monitor_survives_a_failing_sampler_and_emit(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rankwatch.collector")
    got: list[GpuSample] = []

    def emit(sample: GpuSample) -> None:
        if len(got) == 0 and not getattr(emit, "failed", False):
            emit.failed = True  # type: ignore[attr-defined]
            raise ValueError("sink hiccup")
        got.append(sample)

    monitor = GpuMonitor(_FlakySampler(), emit, interval_s=0.005)
    monitor.start()
    _wait_for(lambda: len(got) >= 3 and monitor.errors >= 4)
    monitor.stop()
    assert all(s.device_index == 0 for s in got)
    warnings = [r for r in caplog.records if r.name == "rankwatch.collector"]
    assert len(warnings) == 1


def test_monitor_rejects_bad_interval() -> None:
    with pytest.raises(ValueError):
        GpuMonitor(ReplaySampler(host="h", indices=[0]), lambda s: None, interval_s=0)
