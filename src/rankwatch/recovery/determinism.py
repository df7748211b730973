"""What a bitwise resume needs: DDP's gradient buckets fixed from the first step, and a record of every setting that
decides the numerics, so a resume that changes one is marked CHANGED.

**Why buckets.** DDP builds its buckets twice: at construction (the first backward reduces every gradient in one
bucket) and again after the first backward, in the order the gradients became ready. A fresh process — every
restart — therefore reduces its first step in another bucket layout than the uninterrupted run reduced that step in.
A collective sums each element in an order that depends on where the element falls in the bucket (gloo's and NCCL's
ring chunks): with two replicas a + b = b + a and nothing shows, with four the sums differ in the last bits and the
replay leaves the uninterrupted trajectory. `pin_ddp_buckets` builds the final buckets once, at construction, in
parameter order, so every step of every attempt reduces in the same layout.

**What a user's own job must do** for a bitwise resume (docs/bitwise-resume.md says more):
1. call `pin_ddp_buckets(ddp)` right after wrapping the model in DDP (or run one warm-up forward/backward, without an
   optimizer step, in every fresh process before the first counted step — both attempts alike);
2. restore model, optimizer, RNGs (python, numpy, torch CPU and CUDA) and the data position from the checkpoint;
3. keep every input of `DeterminismInputs` fixed across attempts: thread counts, the deterministic-algorithms flag
   (on CUDA also ``CUBLAS_WORKSPACE_CONFIG``), DDP bucket settings, backend and NCCL algorithm settings, versions;
4. keep the world size and layout: another dp degree changes which samples are summed in which order.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rankwatch.base.rundir import RunDir

__all__ = ["DDP_BUCKET_CAP_MB", "DETERMINISM_KEY", "DeterminismInputs", "NUMERIC_ENV", "determinism_of", "pin_ddp_buckets"]

DETERMINISM_KEY = "determinism"
"""Key of a launch record's `DeterminismInputs` in run.json."""

DDP_BUCKET_CAP_MB = 25
"""DDP's default bucket cap (torch.distributed's `_DEFAULT_BUCKET_CAP_MB`), which the canary uses."""

NUMERIC_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO",
               "NCCL_NTHREADS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK")
"""Environment variables that change kernels, thread counts or collective algorithms, hence the last bits."""


def pin_ddp_buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Build DDP's final gradient buckets now, in parameter order, instead of after the first backward (see the
    module docstring). Collective over DDP's process group: every replica calls it right after construction."""
    reducer = ddp.reducer
    reducer._push_all_rebuilt_params()
    if not reducer._rebuild_buckets():
        raise RuntimeError("DDP did not rebuild its buckets: pin_ddp_buckets must run before the first forward")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeterminismInputs:
    """The settings that decide a job's numerics beyond its config and data. Two attempts with equal inputs (and the
    same layout, config and checkpointed state) are expected to train bitwise alike."""

    torch_threads: int
    """torch intra-op threads per rank."""
    deterministic_algorithms: bool
    """`torch.use_deterministic_algorithms` as the ranks set it."""
    backend: str
    """torch.distributed backend (gloo, nccl)."""
    ddp_bucket_cap_mb: int
    """DDP bucket cap."""
    ddp_buckets_pinned: bool
    """Buckets fixed at construction (`pin_ddp_buckets`); False: DDP rebuilds them after each process's first
    backward, so the first step after a restart reduces in another layout."""
    gradient_as_bucket_view: bool
    torch: str
    python: str
    numpy: str
    cuda: str | None
    """CUDA runtime torch was built with; None on a CPU build."""
    nccl: str | None
    machine: str
    """CPU architecture (`platform.machine()`): another one runs other kernels."""
    env: dict[str, str]
    """Values of the `NUMERIC_ENV` variables that are set."""

    @classmethod
    def current(cls, *, threads: int, backend: str, deterministic_algorithms: bool, buckets_pinned: bool,
                bucket_cap_mb: int = DDP_BUCKET_CAP_MB, gradient_as_bucket_view: bool = False) -> DeterminismInputs:
        nccl: str | None = None
        if torch.cuda.is_available():
            try:
                nccl = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # no NCCL in this build
                nccl = None
        return cls(
            torch_threads=threads, deterministic_algorithms=deterministic_algorithms, backend=backend,
            ddp_bucket_cap_mb=bucket_cap_mb, ddp_buckets_pinned=buckets_pinned,
            gradient_as_bucket_view=gradient_as_bucket_view, torch=torch.__version__,
            python=platform.python_version(), numpy=np.__version__, cuda=torch.version.cuda, nccl=nccl,
            machine=platform.machine() or sys.platform,
            env={k: os.environ[k] for k in NUMERIC_ENV if k in os.environ},
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any, *, where: str) -> DeterminismInputs:
        """Parse a recorded `to_dict`; a ValueError naming `where` when it is not one."""
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: determinism inputs are not an object")
        try:
            inputs = cls(**doc)
        except TypeError as exc:
            raise ValueError(f"{where}: determinism inputs do not match this rankwatch ({exc})") from None
        if not isinstance(inputs.env, dict):
            raise ValueError(f"{where}: determinism inputs: env is not an object")
        return inputs

    def changes(self, newer: DeterminismInputs) -> tuple[str, ...]:
        """One 'name old->new' per input that differs in `newer`, in field order."""
        old, new = self.to_dict(), newer.to_dict()
        out = [f"{k} {old[k]}->{new[k]}" for k in old if k != "env" and old[k] != new[k]]
        for k in sorted(set(old["env"]) | set(new["env"])):
            if old["env"].get(k) != new["env"].get(k):
                out.append(f"{k} {old['env'].get(k, '(unset)')}->{new['env'].get(k, '(unset)')}")
        return tuple(out)


def determinism_of(run_dir: Path, launch: dict[str, Any]) -> DeterminismInputs | None:
    """A launch record's determinism inputs; None when it has none (written by an older rankwatch)."""
    doc = launch.get(DETERMINISM_KEY)
    if doc is None:
        return None
    return DeterminismInputs.from_dict(doc, where=f"{RunDir(Path(run_dir)).run_file} launch {launch.get('attempt')}")
