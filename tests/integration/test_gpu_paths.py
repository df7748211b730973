"""The CUDA and NVML paths, on a machine with an NVIDIA GPU (skipped elsewhere)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rankwatch.base.schema import Collectives, GroupKind, Table, column_names
from rankwatch.base.topology import GroupInfo
from rankwatch.collector import Collector, CollectorConfig, MemorySink, open_sampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_nvml_sampler_reads_the_real_device() -> None:
    sampler = open_sampler("nvml", host="local", indices=[0])
    assert sampler is not None, "NVML did not initialize on a machine with CUDA"
    try:
        (device,) = sampler.devices()
        sample = sampler.sample(device.index)
        assert device.uuid.startswith("GPU-") and sample.device_uuid == device.uuid
        assert sample.sm_clock_mhz and sample.sm_clock_mhz > 0
        assert sample.power_w is not None and sample.temperature_c is not None
        assert sample.throttle_reasons is not None
    finally:
        sampler.close()


def test_cuda_collectives_get_device_time_from_events(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        sink = MemorySink()
        c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False), rank=0, world_size=1, sink=sink)
        c.register_group(None, GroupInfo(name="world", kind=GroupKind.WORLD, ranks=(0,), hosts=("local",)))
        t = torch.ones(1 << 20, device="cuda")
        for step in range(3):
            with c.step(step):
                with c.collective("all_reduce", None, t):
                    dist.all_reduce(t)
        c.close(exit_code=0)
    finally:
        dist.destroy_process_group()
    idx = column_names(Table.COLLECTIVES).index(Collectives.DEVICE_DURATION_NS)
    rows = sink.rows(Table.COLLECTIVES)
    assert len(rows) == 3
    assert all(r[idx] is not None and r[idx] > 0 for r in rows)
