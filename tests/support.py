"""Helpers for tests that spawn real gloo ranks (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import timedelta
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rankwatch.analytics.store import connect
from rankwatch.base.rundir import CHECKPOINT_DIR
from rankwatch.base.topology import Layout
from rankwatch.canary import CanaryConfig, Faults, launch
from rankwatch.canary.model import ModelConfig
from rankwatch.recovery.catalog import (
    DCP_METADATA, MANIFEST, Manifest, ShardFile, Versions, checkpoint_id, rank_shard_name,
)
from rankwatch.recovery.job import LaunchResult

#: A small model keeps 8 ranks on 2 cores fast; the code paths are the same as the default's.
SMALL = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2)


def canary(run_dir: Path, *, layout: str, steps: int, hosts: int = 1, faults: Faults | None = None, **kw: Any) -> CanaryConfig:
    world = 1
    for part in layout.split(","):
        world *= int(part.split("=")[1])
    cfg = CanaryConfig(
        run_dir=run_dir,
        steps=steps,
        layout=Layout.parse(layout, nproc=world),
        hosts=hosts,
        faults=faults or Faults(),
        gpu="replay",
        pg_timeout_s=8.0,
        flush_interval_s=0.5,
        heartbeat_interval_s=0.25,
        gpu_interval_s=0.1,
        model=SMALL,
    )
    return replace(cfg, **kw)


def run(cfg: CanaryConfig, **kw: Any) -> LaunchResult:
    kw.setdefault("timeout_s", 150)
    kw.setdefault("failure_grace_s", cfg.pg_timeout_s + 4)
    kw.setdefault("term_grace_s", 3.0)
    return launch(cfg, **kw)


def rows(run_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    return connect(run_dir).execute(sql).fetchall()


LAYOUT = Layout(dp=2, tp=2)
"""The layout of `make_checkpoint`'s checkpoints unless told otherwise."""
VERSIONS = Versions(rankwatch="0.1.0", torch="2.13.0", python="3.11.9", numpy="2.0.0", config_sha256="0" * 64, seed=0)


def make_checkpoint(run_dir: Path, step: int, *, layout: Layout = LAYOUT, tmp: bool = False) -> Path:
    """A committed-looking checkpoint: a DCP metadata file, one data file and one rank file per rank."""
    name = checkpoint_id(step)
    path = run_dir / CHECKPOINT_DIR / (f".{name}.tmp" if tmp else name)
    (path / "model_optim").mkdir(parents=True)
    contents = {DCP_METADATA: (0, b"meta" * 10)}
    for r in range(layout.world_size):
        contents[f"model_optim/__{r}_0.distcp"] = (r, bytes([r]) * (100 + step))
        contents[rank_shard_name(r)] = (r, f"rank {r} step {step}".encode() * 5)
    files = []
    for rel, (rank, data) in sorted(contents.items()):
        (path / rel).write_bytes(data)
        files.append(ShardFile(path=rel, size=len(data), sha256=hashlib.sha256(data).hexdigest(), rank=rank))
    manifest = Manifest(checkpoint_id=name, step=step, world_size=layout.world_size, layout=layout, versions=VERSIONS,
                        files=tuple(files), created_wall_ns=1)
    (path / MANIFEST).write_text(manifest.to_json())
    return path


def benchmark_table(script: str, *args: str, timeout_s: float) -> list[str]:
    """The figure table a benchmarks/ script prints (its "| ..." lines), run with `args`; the run must succeed."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table and table[0] == "| figure | value |", done.stdout[-2000:]
    return table


def assert_rows(table: list[str], names: tuple[str, ...]) -> None:
    """Every figure in `names` has a row in `table`, and the collector counted no internal error."""
    for name in names:
        assert any(line.startswith(f"| {name}") for line in table), f"no row {name!r} in:\n" + "\n".join(table)
    errors = next(line for line in table if line.startswith("| collector internal errors"))
    assert errors.endswith("| 0 |"), errors



@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[Any]:
    """A world of one gloo rank in this process (its default group), destroyed after the test."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
