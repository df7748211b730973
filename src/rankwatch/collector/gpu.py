"""GPU samples: a `GpuSampler` interface, an NVML implementation, a replay fake and a sampling thread.

`NvmlSampler` reads real devices through NVML (nvidia-ml-py). `ReplaySampler` produces realistic series
for machines without a GPU — synthetic healthy devices with injectable faults, or a replay of a recorded
`gpu` table. `open_sampler` picks one from a config string and degrades to "no GPU sampling" with one
logged warning when NVML is missing. `GpuMonitor` samples on a daemon thread and never raises.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import pyarrow as pa
import pynvml

from rankwatch.base.schema import Gpu, Table, ThrottleReason, column_names

log = logging.getLogger("rankwatch.collector")

_T = TypeVar("_T")
_GPU_COLUMNS = column_names(Table.GPU)
_SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")
_THERMAL = ThrottleReason.HW_THERMAL_SLOWDOWN | ThrottleReason.SW_THERMAL_SLOWDOWN
#: Bound on XID events drained per sample, so a storm of events cannot stall the sampling thread.
_MAX_EVENTS_PER_DRAIN = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    index: int
    """Device index on the host (NVML index for `NvmlSampler`)."""
    uuid: str
    """Device UUID, "GPU-xxxxxxxx-...": follows the physical device across ranks and restarts."""
    pci_bus_id: str
    """PCI bus id as NVML writes it, "00000000:18:00.0"."""
    name: str
    """Product name, e.g. "NVIDIA H100 80GB HBM3"."""
    numa_node: int | None
    """NUMA node the device is attached to; None when unknown."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSample:
    """One reading of one device: the `gpu` table row without `rank` and `step`. None = not supported."""

    device_index: int
    device_uuid: str
    pci_bus_id: str
    source: str
    wall_ns: int
    mono_ns: int
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_bytes: int | None = None
    throttle_reasons: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    pcie_replay: int | None = None
    nvlink_crc_errors: int | None = None
    nvlink_replay_errors: int | None = None
    nvlink_recovery_errors: int | None = None
    xid_events: tuple[int, ...] = ()
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None

    def row(self, *, rank: int, step: int) -> tuple[object, ...]:
        """The sample as a `gpu` table row, in `schema.column_names(Table.GPU)` order."""
        out: list[object] = []
        for name in _GPU_COLUMNS:
            if name == Gpu.RANK:
                out.append(rank)
            elif name == Gpu.STEP:
                out.append(step)
            elif name == Gpu.XID_EVENTS:
                out.append(list(self.xid_events))
            else:
                out.append(getattr(self, name))
        return tuple(out)


class GpuSampler(ABC):
    """Reads the devices a rank watches. Implementations are sampled from one background thread."""

    source: ClassVar[str]
    """Value of the `source` column for samples of this sampler."""

    @abstractmethod
    def devices(self) -> Sequence[DeviceInfo]:
        """The devices this sampler reads."""

    @abstractmethod
    def sample(self, index: int) -> GpuSample:
        """Read device `index` now. Unsupported readings are None, never an exception."""

    def close(self) -> None:
        """Release the library or resources behind the sampler. Idempotent."""

    def __enter__(self) -> GpuSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GpuUnavailable(RuntimeError):
    """NVML cannot be used here (no library, no driver, no such device)."""


# ---------------------------------------------------------------------------------------------- NVML


def _nvml(fn: Callable[..., _T], *args: object) -> _T | None:
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _handle_key(handle: object) -> object:
    # NVML handles are ctypes pointers, which compare by identity; the handle inside an event is a new
    # pointer object, so devices are matched by address.
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _sysfs_numa_node(pci_bus_id: str) -> int | None:
    """NUMA node from sysfs, which names devices with a 4-digit domain ("0000:18:00.0") in lower case."""
    domain, sep, rest = pci_bus_id.strip().partition(":")
    if not sep:
        return None
    try:
        path = _SYSFS_PCI_DEVICES / f"{int(domain, 16):04x}:{rest.lower()}" / "numa_node"
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


class NvmlSampler(GpuSampler):
    """Real devices through NVML. `indices` are NVML indices, which ignore CUDA_VISIBLE_DEVICES."""

    source = "nvml"

    def __init__(self, indices: Sequence[int] | None = None) -> None:
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            raise GpuUnavailable(f"NVML unavailable: nvmlInit failed ({type(exc).__name__}: {exc})") from exc
        self._lock = threading.Lock()
        self._closed = False
        self._event_set: object | None = None
        try:
            wanted = list(range(pynvml.nvmlDeviceGetCount())) if indices is None else list(indices)
            self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in wanted}
        except pynvml.NVMLError as exc:
            _nvml(pynvml.nvmlShutdown)
            which = "all devices" if indices is None else f"devices {list(indices)}"
            raise GpuUnavailable(f"NVML unavailable: cannot open {which} ({type(exc).__name__}: {exc})") from exc
        self._devices = tuple(self._describe(i, h) for i, h in self._handles.items())
        self._info = {d.index: d for d in self._devices}
        self._by_key = {_handle_key(h): i for i, h in self._handles.items()}
        self._xids: dict[int, list[int]] = {i: [] for i in self._handles}
        self._open_xid_events()

    def _describe(self, index: int, handle: object) -> DeviceInfo:
        uuid = _nvml(pynvml.nvmlDeviceGetUUID, handle)
        pci = _nvml(pynvml.nvmlDeviceGetPciInfo, handle)
        name = _nvml(pynvml.nvmlDeviceGetName, handle)
        bus_id = _text(pci.busId) if pci is not None else ""
        numa = _nvml(pynvml.nvmlDeviceGetNumaNodeId, handle)
        if numa is None or numa < 0:
            numa = _sysfs_numa_node(bus_id) if bus_id else None
        return DeviceInfo(
            index=index,
            uuid=_text(uuid) if uuid is not None else "",
            pci_bus_id=bus_id,
            name=_text(name) if name is not None else "",
            numa_node=numa,
        )

    def _open_xid_events(self) -> None:
        event_set = _nvml(pynvml.nvmlEventSetCreate)
        if event_set is None:
            return
        for handle in self._handles.values():
            # Unsupported devices (consumer boards, some vGPU) simply report no XIDs.
            _nvml(pynvml.nvmlDeviceRegisterEvents, handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
        self._event_set = event_set

    def _drain_xids(self) -> None:
        if self._event_set is None:
            return
        for _ in range(_MAX_EVENTS_PER_DRAIN):
            try:
                data = pynvml.nvmlEventSetWait(self._event_set, 0)
            except pynvml.NVMLError:  # NVMLError_Timeout: nothing pending
                return
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                index = self._by_key.get(_handle_key(data.device))
                if index is not None:
                    self._xids[index].append(int(data.eventData))

    def devices(self) -> Sequence[DeviceInfo]:
        return self._devices

    def sample(self, index: int) -> GpuSample:
        handle = self._handles.get(index)
        if handle is None:
            raise ValueError(f"device {index} is not sampled here; devices: {sorted(self._handles)}")
        wall_ns, mono_ns = time.time_ns(), time.monotonic_ns()
        info = self._info[index]
        with self._lock:
            self._drain_xids()
            xids, self._xids[index] = tuple(self._xids[index]), []
        util = _nvml(pynvml.nvmlDeviceGetUtilizationRates, handle)
        mem = _nvml(pynvml.nvmlDeviceGetMemoryInfo, handle)
        power_mw = _nvml(pynvml.nvmlDeviceGetPowerUsage, handle)
        limit_mw = _nvml(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        reasons = _nvml(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if reasons is None:
            reasons = _nvml(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        crc, replay, recovery = self._nvlink_errors(handle)
        remapped = _nvml(pynvml.nvmlDeviceGetRemappedRows, handle)
        corrected, uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        volatile, aggregate = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
        ecc = {
            (kind, counter): _nvml(pynvml.nvmlDeviceGetTotalEccErrors, handle, kind, counter)
            for kind in (corrected, uncorrected)
            for counter in (volatile, aggregate)
        }
        return GpuSample(
            device_index=index,
            device_uuid=info.uuid,
            pci_bus_id=info.pci_bus_id,
            source=self.source,
            wall_ns=wall_ns,
            mono_ns=mono_ns,
            sm_clock_mhz=_nvml(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
            mem_clock_mhz=_nvml(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM),
            sm_clock_max_mhz=_nvml(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            temperature_c=self._temperature(handle),
            gpu_util_pct=float(util.gpu) if util is not None else None,
            mem_util_pct=float(util.memory) if util is not None else None,
            mem_used_bytes=int(mem.used) if mem is not None else None,
            throttle_reasons=reasons,
            ecc_sbe_volatile=ecc[corrected, volatile],
            ecc_dbe_volatile=ecc[uncorrected, volatile],
            ecc_sbe_aggregate=ecc[corrected, aggregate],
            ecc_dbe_aggregate=ecc[uncorrected, aggregate],
            pcie_replay=_nvml(pynvml.nvmlDeviceGetPcieReplayCounter, handle),
            nvlink_crc_errors=crc,
            nvlink_replay_errors=replay,
            nvlink_recovery_errors=recovery,
            xid_events=xids,
            retired_pages_sbe=self._retired_pages(
                handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            ),
            retired_pages_dbe=self._retired_pages(handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
            remapped_rows_correctable=remapped[0] if remapped is not None else None,
            remapped_rows_uncorrectable=remapped[1] if remapped is not None else None,
            remapped_rows_pending=bool(remapped[2]) if remapped is not None else None,
        )

    @staticmethod
    def _temperature(handle: object) -> float | None:
        # nvmlDeviceGetTemperature is deprecated; the versioned call is missing from older drivers.
        temp = _nvml(pynvml.nvmlDeviceGetTemperatureV, handle, pynvml.NVML_TEMPERATURE_GPU)
        if temp is None:
            temp = _nvml(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
        return float(temp) if temp is not None else None

    @staticmethod
    def _retired_pages(handle: object, cause: int) -> int | None:
        pages = _nvml(pynvml.nvmlDeviceGetRetiredPages, handle, cause)
        return len(pages) if pages is not None else None

    @staticmethod
    def _nvlink_errors(handle: object) -> tuple[int | None, int | None, int | None]:
        """(crc, replay, recovery) summed over active links; None where no link reports the counter."""
        crc: int | None = None
        replay: int | None = None
        recovery: int | None = None

        def add(total: int | None, counter: int, link: int) -> int | None:
            value = _nvml(pynvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
            return total if value is None else (total or 0) + value

        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
            except pynvml.NVMLError_NotSupported:  # no NVLink, or this link is fused off
                continue
            except pynvml.NVMLError:  # InvalidArgument: past the device's last link
                break
            if not active:
                continue
            crc = add(crc, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, link)
            crc = add(crc, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA, link)
            replay = add(replay, pynvml.NVML_NVLINK_ERROR_DL_REPLAY, link)
            recovery = add(recovery, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY, link)
        return crc, replay, recovery

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._event_set is not None:
                _nvml(pynvml.nvmlEventSetFree, self._event_set)
                self._event_set = None
            _nvml(pynvml.nvmlShutdown)


# -------------------------------------------------------------------------------------------- replay


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuProfile:
    """Nominal figures of one GPU model, from which `ReplaySampler` draws healthy series."""

    name: str
    """Product name as NVML reports it."""
    sm_clock_max_mhz: int
    """Maximum (boost) SM clock."""
    mem_clock_mhz: int
    """Memory clock; constant under load."""
    power_limit_w: float
    """Enforced board power limit."""
    idle_power_w: float
    """Board power with no kernel running."""
    busy_power_w: float
    """Board power at 100 % utilization and full clock (below the limit on a healthy device)."""
    base_temperature_c: float
    """Centre of the healthy core-temperature band (±10 °C)."""
    memory_total_bytes: int
    """Device memory size."""
    row_remapping: bool = True
    """Memory errors are handled by row remapping (A100 and later); page retirement reads as unsupported."""

    def __post_init__(self) -> None:
        if self.sm_clock_max_mhz <= 0 or self.mem_clock_mhz <= 0 or self.memory_total_bytes <= 0:
            raise ValueError(f"GpuProfile {self.name!r}: clocks and memory must be > 0")
        if not 0 < self.idle_power_w < self.busy_power_w <= self.power_limit_w:
            raise ValueError(f"GpuProfile {self.name!r}: need 0 < idle_power_w < busy_power_w <= power_limit_w")


H100_SXM = GpuProfile(
    name="NVIDIA H100 80GB HBM3",
    sm_clock_max_mhz=1980,
    mem_clock_mhz=2619,
    power_limit_w=700.0,
    idle_power_w=90.0,
    busy_power_w=640.0,
    base_temperature_c=65.0,
    memory_total_bytes=81559 * 2**20,
)

#: PCI buses of the eight GPUs of an HGX H100 board, by device index.
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
#: H100 SM clocks move in 15 MHz steps.
_CLOCK_BIN_MHZ = 15


def replay_uuid(host: str, index: int) -> str:
    """UUID of virtual device `index` on `host`, formatted like NVML's; the same slot always gets the same one."""
    h = hashlib.blake2b(f"{host}/{index}".encode(), digest_size=16).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _replay_bus_id(index: int) -> str:
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else (0x18 + 0x10 * index) % 0x100
    return f"00000000:{bus:02X}:00.0"


def _plus(value: int | None, added: int) -> int | None:
    return value if added == 0 else (value or 0) + added


@dataclass(slots=True)
class _ReplayDevice:
    info: DeviceInfo
    rng: np.random.Generator
    mem_used_frac: float
    temp_drift: float = 0.0
    throttle: tuple[ThrottleReason, int | None] | None = None
    sbe: int = 0
    dbe: int = 0
    pcie_replays: int = 0
    nvlink_crc: int = 0
    nvlink_replay: int = 0
    nvlink_recovery: int = 0
    xids: list[int] = dataclasses.field(default_factory=list)
    recorded: list[GpuSample] = dataclasses.field(default_factory=list)
    cursor: int = 0


class ReplaySampler(GpuSampler):
    """Simulated or replayed devices for machines without a GPU; deterministic given the seed.

    Healthy by default; the fault controls (`throttle`, `add_ecc`, `add_xid`, ...) may be called from any
    thread while another samples, and are laid over the series from the next sample on.
    """

    source = "replay"

    def __init__(
        self,
        *,
        host: str,
        indices: Sequence[int],
        seed: int = 0,
        profile: GpuProfile = H100_SXM,
        wall_clock: Callable[[], int] = time.time_ns,
        mono_clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
            raise ValueError(f"device indices must be distinct and >= 0, got {list(indices)}")
        self._profile = profile
        self._wall_clock = wall_clock
        self._mono_clock = mono_clock
        self._lock = threading.Lock()
        host_key = int.from_bytes(hashlib.blake2b(host.encode(), digest_size=8).digest(), "little")
        self._devices: dict[int, _ReplayDevice] = {}
        for i in indices:
            rng = np.random.default_rng([seed, host_key, i])
            info = DeviceInfo(
                index=i, uuid=replay_uuid(host, i), pci_bus_id=_replay_bus_id(i), name=profile.name, numa_node=i // 4
            )
            self._devices[i] = _ReplayDevice(info=info, rng=rng, mem_used_frac=float(rng.uniform(0.6, 0.9)))

    @classmethod
    def from_table(
        cls,
        table: pa.Table,
        *,
        indices: Sequence[int] | None = None,
        seed: int = 0,
        profile: GpuProfile = H100_SXM,
        wall_clock: Callable[[], int] = time.time_ns,
        mono_clock: Callable[[], int] = time.monotonic_ns,
    ) -> ReplaySampler:
        """Replay recorded `gpu` rows of one host: each device's rows in table order, cycling, fresh timestamps."""
        missing = [str(c) for c in (Gpu.DEVICE_INDEX, Gpu.DEVICE_UUID, Gpu.PCI_BUS_ID) if c not in table.column_names]
        if missing:
            raise ValueError(f"cannot replay a gpu table without columns {missing}")
        fields = [f.name for f in dataclasses.fields(GpuSample)]
        by_index: dict[int, list[GpuSample]] = {}
        for row in table.to_pylist():
            values = {name: row.get(name) for name in fields}
            values["source"] = cls.source
            values["xid_events"] = tuple(row.get(Gpu.XID_EVENTS) or ())
            by_index.setdefault(row[Gpu.DEVICE_INDEX], []).append(GpuSample(**values))
        for index, rows in by_index.items():
            uuids = {r.device_uuid for r in rows}
            if len(uuids) > 1:
                raise ValueError(f"gpu table has {len(uuids)} devices with index {index}; filter it to one host")
        chosen = sorted(by_index) if indices is None else list(indices)
        absent = [i for i in chosen if i not in by_index]
        if absent:
            raise ValueError(f"gpu table has no rows for device indices {absent}")
        sampler = cls(
            host="replay", indices=chosen, seed=seed, profile=profile, wall_clock=wall_clock, mono_clock=mono_clock
        )
        for i in chosen:
            first = by_index[i][0]
            dev = sampler._devices[i]
            dev.info = DeviceInfo(
                index=i, uuid=first.device_uuid, pci_bus_id=first.pci_bus_id, name=profile.name, numa_node=None
            )
            dev.recorded = by_index[i]
        return sampler

    def devices(self) -> Sequence[DeviceInfo]:
        return tuple(d.info for d in self._devices.values())

    def _device(self, index: int) -> _ReplayDevice:
        dev = self._devices.get(index)
        if dev is None:
            raise ValueError(f"device {index} is not simulated here; devices: {sorted(self._devices)}")
        return dev

    def throttle(
        self,
        index: int,
        *,
        reason: ThrottleReason = ThrottleReason.HW_THERMAL_SLOWDOWN,
        sm_clock_mhz: int | None = None,
    ) -> None:
        """Slow device `index` down (default: to ~60 % of the max SM clock) with `reason` set, until cleared.

        Thermal reasons also raise the temperature to ~90 °C; SW_POWER_CAP pins power at the limit; otherwise
        power falls with the clock. Replaces an earlier throttle of the device; combine bits to combine causes.
        """
        if not reason:
            raise ValueError("throttle needs at least one ThrottleReason bit")
        with self._lock:
            self._device(index).throttle = (ThrottleReason(reason), sm_clock_mhz)

    def clear_throttle(self, index: int) -> None:
        with self._lock:
            self._device(index).throttle = None

    def add_ecc(self, index: int, *, sbe: int = 0, dbe: int = 0) -> None:
        """Add corrected (`sbe`) and uncorrected (`dbe`) ECC errors; uncorrected ones also remap rows."""
        if sbe < 0 or dbe < 0:
            raise ValueError(f"ECC error counts only grow; got sbe={sbe}, dbe={dbe}")
        with self._lock:
            dev = self._device(index)
            dev.sbe += sbe
            dev.dbe += dbe

    def add_xid(self, index: int, code: int) -> None:
        """Report XID `code` once, in the next sample of device `index`."""
        with self._lock:
            self._device(index).xids.append(code)

    def add_pcie_replays(self, index: int, n: int) -> None:
        if n < 0:
            raise ValueError(f"PCIe replay counter only grows; got {n}")
        with self._lock:
            self._device(index).pcie_replays += n

    def add_nvlink_errors(self, index: int, *, crc: int = 0, replay: int = 0, recovery: int = 0) -> None:
        if min(crc, replay, recovery) < 0:
            raise ValueError(f"NVLink error counters only grow; got crc={crc}, replay={replay}, recovery={recovery}")
        with self._lock:
            dev = self._device(index)
            dev.nvlink_crc += crc
            dev.nvlink_replay += replay
            dev.nvlink_recovery += recovery

    def sample(self, index: int) -> GpuSample:
        wall_ns, mono_ns = self._wall_clock(), self._mono_clock()
        with self._lock:
            dev = self._device(index)
            if dev.recorded:
                recorded = dev.recorded[dev.cursor % len(dev.recorded)]
                dev.cursor += 1
                base = dataclasses.replace(recorded, wall_ns=wall_ns, mono_ns=mono_ns)
            else:
                base = self._healthy(dev, wall_ns, mono_ns)
            return self._with_faults(dev, base)

    def _healthy(self, dev: _ReplayDevice, wall_ns: int, mono_ns: int) -> GpuSample:
        p, rng = self._profile, dev.rng
        util = float(rng.uniform(85.0, 100.0))
        sm_clock = p.sm_clock_max_mhz - _CLOCK_BIN_MHZ * int(rng.poisson(0.3))
        power = p.idle_power_w + (p.busy_power_w - p.idle_power_w) * util / 100.0 + float(rng.normal(0.0, 8.0))
        # Mean-reverting walk: stationary spread ~2 °C, slow drift like a real board under steady load.
        dev.temp_drift = 0.98 * dev.temp_drift + float(rng.normal(0.0, 0.4))
        temp = p.base_temperature_c + dev.temp_drift + float(rng.normal(0.0, 0.3))
        mem_frac = min(0.98, dev.mem_used_frac + float(rng.normal(0.0, 0.003)))
        remap = p.row_remapping
        return GpuSample(
            device_index=dev.info.index,
            device_uuid=dev.info.uuid,
            pci_bus_id=dev.info.pci_bus_id,
            source=self.source,
            wall_ns=wall_ns,
            mono_ns=mono_ns,
            sm_clock_mhz=sm_clock,
            mem_clock_mhz=p.mem_clock_mhz,
            sm_clock_max_mhz=p.sm_clock_max_mhz,
            power_w=round(min(max(power, p.idle_power_w), p.busy_power_w), 2),
            power_limit_w=p.power_limit_w,
            temperature_c=float(round(min(max(temp, p.base_temperature_c - 10), p.base_temperature_c + 10))),
            gpu_util_pct=float(round(util)),
            mem_util_pct=float(round(rng.uniform(35.0, 65.0))),
            mem_used_bytes=int(p.memory_total_bytes * mem_frac),
            throttle_reasons=0,
            ecc_sbe_volatile=0,
            ecc_dbe_volatile=0,
            ecc_sbe_aggregate=0,
            ecc_dbe_aggregate=0,
            pcie_replay=0,
            nvlink_crc_errors=0,
            nvlink_replay_errors=0,
            nvlink_recovery_errors=0,
            retired_pages_sbe=None if remap else 0,
            retired_pages_dbe=None if remap else 0,
            remapped_rows_correctable=0 if remap else None,
            remapped_rows_uncorrectable=0 if remap else None,
            remapped_rows_pending=False if remap else None,
        )

    def _with_faults(self, dev: _ReplayDevice, s: GpuSample) -> GpuSample:
        p, rng = self._profile, dev.rng
        changes: dict[str, Any] = {
            "ecc_sbe_volatile": _plus(s.ecc_sbe_volatile, dev.sbe),
            "ecc_dbe_volatile": _plus(s.ecc_dbe_volatile, dev.dbe),
            "ecc_sbe_aggregate": _plus(s.ecc_sbe_aggregate, dev.sbe),
            "ecc_dbe_aggregate": _plus(s.ecc_dbe_aggregate, dev.dbe),
            "pcie_replay": _plus(s.pcie_replay, dev.pcie_replays),
            "nvlink_crc_errors": _plus(s.nvlink_crc_errors, dev.nvlink_crc),
            "nvlink_replay_errors": _plus(s.nvlink_replay_errors, dev.nvlink_replay),
            "nvlink_recovery_errors": _plus(s.nvlink_recovery_errors, dev.nvlink_recovery),
            "xid_events": s.xid_events + tuple(dev.xids),
        }
        dev.xids.clear()
        if dev.dbe and p.row_remapping:
            changes["remapped_rows_uncorrectable"] = _plus(s.remapped_rows_uncorrectable, dev.dbe)
            changes["remapped_rows_pending"] = True  # until a GPU reset, which a replay never sees
        elif dev.dbe:
            changes["retired_pages_dbe"] = _plus(s.retired_pages_dbe, dev.dbe)
        if dev.throttle is not None:
            reason, target = dev.throttle
            max_clock = s.sm_clock_max_mhz or p.sm_clock_max_mhz
            if target is None:
                target = round(0.6 * max_clock) - _CLOCK_BIN_MHZ * int(rng.integers(0, 3))
            changes["sm_clock_mhz"] = target
            changes["throttle_reasons"] = (s.throttle_reasons or 0) | int(reason)
            if reason & ThrottleReason.SW_POWER_CAP:
                changes["power_w"] = round((s.power_limit_w or p.power_limit_w) - float(rng.uniform(0.0, 1.5)), 2)
            elif s.power_w is not None:
                changes["power_w"] = round(s.power_w * target / max_clock, 2)
            if reason & _THERMAL:
                changes["temperature_c"] = float(round(rng.uniform(88.0, 92.0)))
        return dataclasses.replace(s, **changes)


# ----------------------------------------------------------------------------------- choice and thread

SAMPLER_KINDS = ("auto", "nvml", "replay", "off")

_warn_lock = threading.Lock()
_warned_unavailable = False


def open_sampler(kind: str, *, host: str, indices: Sequence[int], seed: int = 0) -> GpuSampler | None:
    """The sampler a config string asks for; None means GPU sampling is off.

    "auto" and "nvml" degrade to None when NVML is unavailable, with one logged warning per process.
    """
    global _warned_unavailable
    if kind not in SAMPLER_KINDS:
        raise ValueError(f"unknown GPU sampler kind {kind!r}; expected one of: {', '.join(SAMPLER_KINDS)}")
    if kind == "off":
        return None
    if kind == "replay":
        return ReplaySampler(host=host, indices=indices, seed=seed)
    try:
        return NvmlSampler(indices)
    except GpuUnavailable as exc:
        with _warn_lock:
            first, _warned_unavailable = not _warned_unavailable, True
        if first:
            asked = " was asked for (gpu=nvml) but" if kind == "nvml" else ""
            log.warning("GPU sampling%s is off: %s", asked, exc)
        return None


class GpuMonitor:
    """Samples every device of `sampler` every `interval_s` on a daemon thread and passes samples to `emit`.

    The first sample is taken at `start`. Exceptions from the sampler or `emit` are counted in `errors` (the
    first one is logged) and never leave the thread. The monitor does not close the sampler.
    """

    def __init__(
        self,
        sampler: GpuSampler,
        emit: Callable[[GpuSample], None],
        *,
        interval_s: float,
        name: str = "rankwatch-gpu",
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._sampler = sampler
        self._emit = emit
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def errors(self) -> int:
        return self._errors

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop sampling and join the thread (at most `timeout_s`; a sampler stuck in NVML is left behind)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._tick()
            next_at = max(next_at + self._interval_s, time.monotonic())
            if self._stop.wait(next_at - time.monotonic()):
                return

    def _tick(self) -> None:
        try:
            devices = self._sampler.devices()
        except Exception as exc:  # the collector never raises into training
            self._error(exc)
            return
        for device in devices:
            try:
                self._emit(self._sampler.sample(device.index))
            except Exception as exc:
                self._error(exc)

    def _error(self, exc: Exception) -> None:
        self._errors += 1
        if self._errors == 1:
            log.warning("GPU sampling failed (later failures are only counted): %r", exc, exc_info=exc)
