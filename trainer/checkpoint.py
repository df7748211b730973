"""Checkpoint saving for the canary with every phase timed by the collector.

A plain torch.distributed.checkpoint save into a hidden temporary directory, fsync of this rank's files, and a
publish (rename to ``step-<n>``) by rank 0 after a barrier. The full commit protocol — per-shard checksums,
a manifest and a verifying loader — belongs to the recovery issue; this module records the phases.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rankwatch.collector.schema import CheckpointPhase

CHECKPOINT_DIR = "checkpoints"


def checkpoint_id(step: int) -> str:
    return f"step-{step:08d}"


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    collector: Any,
    *,
    run_dir: Path,
    step: int,
    shard_key: str,
    state: dict[str, Any],
    rank: int,
    group: Any,
) -> Path:
    """Save `state` under `shard_key` (e.g. ``pp0.tp1``: data-parallel replicas share a key and DCP writes one
    copy). Collective over `group`; returns the published directory."""
    ckpt = checkpoint_id(step)
    root = Path(run_dir) / CHECKPOINT_DIR
    tmp = root / f".{ckpt}.tmp"
    final = root / ckpt
    with collector.checkpoint_phase(step, ckpt, CheckpointPhase.SNAPSHOT) as rec:
        snapshot = {shard_key: _clone(state)}
        rec.bytes = _nbytes(snapshot)
    before = set(tmp.iterdir()) if tmp.exists() else set()
    with collector.checkpoint_phase(step, ckpt, CheckpointPhase.WRITE) as rec:
        dcp.save(snapshot, storage_writer=dcp.FileSystemWriter(tmp, sync_files=False), process_group=group)
    with collector.checkpoint_phase(step, ckpt, CheckpointPhase.FSYNC) as rec:
        mine = [p for p in tmp.iterdir() if p not in before and p.name.startswith(f"__{rank}_")]
        for p in mine:
            _fsync(p)
        rec.bytes = sum(p.stat().st_size for p in mine)
    with collector.collective("barrier", group):
        dist.barrier(group=group)
    with collector.checkpoint_phase(step, ckpt, CheckpointPhase.PUBLISH):
        if rank == 0:
            _fsync(tmp)
            if final.exists():
                raise FileExistsError(f"checkpoint {final} already exists")
            os.replace(tmp, final)
            _fsync(root)
    with collector.collective("barrier", group):
        dist.barrier(group=group)
    return final
