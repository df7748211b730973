"""rankwatch.collector: per-rank telemetry recorded inside the training loop, written as parquet."""

from rankwatch.collector.collectives import CollectiveTracker, GroupInfo
from rankwatch.collector.collector import CheckpointPhaseRecord, Collector, CollectorConfig, StepRecord
from rankwatch.collector.device import CudaDeviceTimer, DeviceTimer, FakeDeviceTimer, Mark
from rankwatch.collector.fingerprint import Fingerprint, fingerprint
from rankwatch.collector.gpu import (
    DeviceInfo,
    GpuMonitor,
    GpuSample,
    GpuSampler,
    GpuUnavailable,
    NvmlSampler,
    ReplaySampler,
    open_sampler,
)
from rankwatch.collector.instrument import instrument_distributed
from rankwatch.collector.null import NullCollector
from rankwatch.collector.rollup import RollupError, RollupResult, list_parts, rollup_all, run_agent
from rankwatch.collector.schema import SCHEMA_VERSION, Table
from rankwatch.collector.sink import MemorySink, ParquetSink, Sink, SinkConfig

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointPhaseRecord",
    "CollectiveTracker",
    "Collector",
    "CollectorConfig",
    "CudaDeviceTimer",
    "DeviceInfo",
    "DeviceTimer",
    "FakeDeviceTimer",
    "Fingerprint",
    "GpuMonitor",
    "GpuSample",
    "GpuSampler",
    "GpuUnavailable",
    "GroupInfo",
    "Mark",
    "MemorySink",
    "NullCollector",
    "NvmlSampler",
    "ParquetSink",
    "ReplaySampler",
    "RollupError",
    "RollupResult",
    "Sink",
    "SinkConfig",
    "StepRecord",
    "Table",
    "fingerprint",
    "instrument_distributed",
    "list_parts",
    "open_sampler",
    "rollup_all",
    "run_agent",
]
