"""rankwatch.collector: per-rank telemetry recorded inside the training loop, written as parquet.

The names that need torch (the `Collector` and what it records with: collective tracking, device timers,
fingerprints, the instrumentation of `torch.distributed`, the no-op collector) are imported on first use, so that the
readers of the collector's files and nouns — the sink, the rollup, GPU samplers, liveness records; analytics and the
simulator through them — never load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankwatch.base.lazy import lazy_names
from rankwatch.base.schema import SCHEMA_VERSION, Table
from rankwatch.base.topology import GroupInfo
from rankwatch.collector.gpu import (
    DeviceInfo, GpuMonitor, GpuSample, GpuSampler, GpuUnavailable, NvmlSampler, ReplaySampler, open_sampler,
)
from rankwatch.collector.rollup import RollupError, RollupResult, list_parts, rollup_all, run_agent
from rankwatch.collector.sink import MemorySink, ParquetSink, Sink, SinkConfig

if TYPE_CHECKING:
    from rankwatch.collector.collectives import CollectiveTracker, StepRecord
    from rankwatch.collector.collector import CheckpointPhaseRecord, Collector, CollectorConfig
    from rankwatch.collector.device import CudaDeviceTimer, DeviceTimer, FakeDeviceTimer, Mark
    from rankwatch.collector.fingerprint import Fingerprint, fingerprint
    from rankwatch.collector.attach import attach, detach
    from rankwatch.collector.instrument import instrument_distributed
    from rankwatch.collector.null import NullCollector

_WITH_TORCH = {
    "CollectiveTracker": "collectives", "StepRecord": "collectives",
    "CheckpointPhaseRecord": "collector", "Collector": "collector", "CollectorConfig": "collector",
    "CudaDeviceTimer": "device", "DeviceTimer": "device", "FakeDeviceTimer": "device", "Mark": "device",
    "Fingerprint": "fingerprint", "fingerprint": "fingerprint",
    "instrument_distributed": "instrument",
    "attach": "attach", "detach": "attach",
    "NullCollector": "null",
}
"""Name -> the module of this package that defines it, imported on first use (it imports torch)."""


__getattr__ = lazy_names(__name__, _WITH_TORCH)


__all__ = [
    "SCHEMA_VERSION", "CheckpointPhaseRecord", "CollectiveTracker", "Collector", "CollectorConfig", "CudaDeviceTimer",
    "DeviceInfo", "DeviceTimer", "FakeDeviceTimer", "Fingerprint", "GpuMonitor", "GpuSample", "GpuSampler",
    "GpuUnavailable", "GroupInfo", "Mark", "MemorySink", "NullCollector", "NvmlSampler", "ParquetSink",
    "ReplaySampler", "RollupError", "RollupResult", "Sink", "SinkConfig", "StepRecord", "Table", "attach", "detach",
    "fingerprint",
    "instrument_distributed", "list_parts", "open_sampler", "rollup_all", "run_agent",
]
