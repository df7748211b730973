"""Helpers for tests that spawn real gloo ranks (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from rankwatch.analytics.store import connect
from rankwatch.trainer import CanaryConfig, Faults, LaunchResult, Layout, launch
from rankwatch.trainer.model import ModelConfig

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

