"""The checkpoint commit protocol: save, publish, prune and load, with every phase timed by the collector.

Save (collective over the world group), for checkpoint ``step-XXXXXXXX`` under ``<run>/checkpoints``:

1. every rank snapshots its state; model and optimizer go through torch.distributed.checkpoint into
   ``.step-XXXXXXXX.tmp/model_optim/`` (data-parallel replicas share a key, so DCP writes one copy), and the
   per-rank state (RNG states, data position, scheduler, scaler) into ``rank-RRRRR.pt`` via a temporary name;
2. each rank fsyncs and hashes (size, SHA-256) the files it wrote; the reports are all-gathered;
3. only if every rank reported success, rank 0 writes ``manifest.json`` (temp name, fsync, rename, fsync of the
   directory), renames the directory to ``step-XXXXXXXX`` and fsyncs the parent: the visible name appears
   atomically with the manifest inside, which is the commit point;
4. the outcome is all-gathered, so every rank returns the same `SaveResult`; after a commit rank 0 prunes
   committed checkpoints beyond `keep_last`.

Failure semantics: an I/O error on any rank (ENOSPC included, and DCP's `CheckpointException`, which is a
`BaseException`) publishes nothing, leaves older checkpoints intact, and removes this save's partial files so a full
disk is freed again; every rank records a ``checkpoint_failed`` event (rank 0's names the files removed and the
bytes freed: the partial is evidence, never a recovery point, so its description is kept and its bytes are not)
and returns ``ok=False`` — training goes on (the policy: `CheckpointConfig`). A communication error (a dead peer)
propagates: the ranks can no longer agree on anything. A killed save leaves at most a ``.tmp`` directory, which
the catalog reports as PARTIAL and never chooses.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import os
import platform
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import rankwatch
from rankwatch.base.rundir import CHECKPOINT_DIR, atomic_write, fsync_path
from rankwatch.base.schema import CheckpointPhase, EventKind
from rankwatch.base.topology import Layout
from rankwatch.recovery.catalog import (
    DCP_DIR, DISAGREED, MANIFEST, Candidate, Manifest, ShardFile, Verdict, Versions, checkpoint_id, list_checkpoints,
    rank_shard_name, sha256_file,
)

CHECKPOINT_FAULT_ENV = "RANKWATCH_CHECKPOINT_FAULT"
"""Test-only: a `CheckpointFault` spec the canary reads from the environment (spawned ranks inherit it)."""

_CONFIG_FIELDS = ("layout", "model", "seed", "global_batch", "microbatches", "lr", "threads")

__all__ = [
    "CHECKPOINT_DIR", "CheckpointConfig", "CheckpointFault", "FaultAction", "LoadResult", "SavePoint", "SaveResult",
    "Staged", "checkpoint_id", "commit_checkpoint", "current_versions", "load_checkpoint", "stage_checkpoint",
]


# -- test-only fault injection ----------------------------------------------------------------------------
class SavePoint(StrEnum):
    """Points of a save where a `CheckpointFault` can fire."""

    WRITE = "write"
    """Just before the DCP write (with `after_s`, a random instant during or after it)."""
    SHARD = "shard"
    """Halfway through writing this rank's shard file."""
    FSYNC = "fsync"
    """Before this rank fsyncs and hashes its files."""
    GATHER = "gather"
    """Before the all-gather of the write reports."""
    MANIFEST = "manifest"
    """Rank 0: halfway through writing the manifest."""
    RENAME = "rename"
    """Rank 0: manifest in place, directory not yet renamed."""
    PUBLISHED = "published"
    """Rank 0: directory renamed, parent not yet fsynced (the checkpoint is committed)."""


class FaultAction(StrEnum):
    KILL = "kill"
    """SIGKILL this process (after `after_s`, from a timer thread, while the save goes on)."""
    ENOSPC = "enospc"
    """Raise OSError(ENOSPC) as a full disk would."""


_ENOSPC_POINTS = (SavePoint.SHARD, SavePoint.FSYNC, SavePoint.MANIFEST)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointFault:
    """A fault in one rank's save of one step: ``kill:rank=1,step=9,at=write,after_s=0.01`` or
    ``enospc:rank=2,step=9,at=shard``."""

    action: FaultAction
    """What happens."""
    rank: int
    """Rank it happens on."""
    step: int
    """Checkpoint step it happens in."""
    at: SavePoint
    """Where in the save."""
    after_s: float = 0.0
    """KILL only: delay from reaching `at` to the signal."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise ValueError(f"checkpoint fault: rank and step must be >= 0, got rank={self.rank} step={self.step}")
        if self.after_s < 0:
            raise ValueError(f"checkpoint fault: after_s must be >= 0, got {self.after_s}")
        if self.action is FaultAction.ENOSPC and self.at not in _ENOSPC_POINTS:
            raise ValueError(f"checkpoint fault: enospc needs at= one of {', '.join(_ENOSPC_POINTS)}, got {self.at}")
        if self.action is FaultAction.ENOSPC and self.after_s:
            raise ValueError("checkpoint fault: after_s applies to kill only")

    @classmethod
    def parse(cls, spec: str) -> CheckpointFault:
        action, _, rest = spec.partition(":")
        try:
            kv = dict(item.split("=", 1) for item in rest.split(",") if item)
            return cls(action=FaultAction(action), rank=int(kv["rank"]), step=int(kv["step"]), at=SavePoint(kv["at"]),
                       after_s=float(kv.get("after_s", 0.0)))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"bad checkpoint fault {spec!r}: expected ACTION:rank=R,step=S,at=POINT[,after_s=T] ({exc})") from None

    @classmethod
    def from_env(cls) -> CheckpointFault | None:
        spec = os.environ.get(CHECKPOINT_FAULT_ENV)
        return cls.parse(spec) if spec else None

    def fire(self, point: SavePoint, *, rank: int, step: int, path: Path | None = None) -> None:
        if point is not self.at or rank != self.rank or step != self.step:
            return
        if self.action is FaultAction.ENOSPC:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path else None)
        if self.after_s == 0:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        timer = threading.Timer(self.after_s, os.kill, args=(os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


# -- config and results -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """How checkpoints are saved and kept.

    Policy on a failed save (a full disk, any I/O error on any rank): nothing is published, the committed
    checkpoints stay, this save's partial files are removed at once (a ``checkpoint_failed`` event keeps their
    description: failing rank, error, files and bytes freed), and training goes on; the next scheduled save tries
    again. A job never stops because a save failed — it stops only when its process group breaks. The cost: while
    saves fail, a crash loses the steps since the last committed checkpoint."""

    keep_last: int = 3
    """Committed checkpoints to keep; older committed ones are deleted after a new commit. Partial and corrupt
    candidates are never deleted: they are evidence."""
    fault: CheckpointFault | None = None
    """Test-only fault injection."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveResult:
    """The outcome of one save: the same on every rank."""

    ok: bool
    """True when the checkpoint committed."""
    checkpoint_id: str
    """``step-XXXXXXXX``."""
    step: int
    """Step saved."""
    path: Path | None
    """The committed directory (None when nothing was published)."""
    reason: str
    """"committed", or one line on why not (the first failing rank's error)."""
    pruned: tuple[str, ...] = ()
    """Committed checkpoints deleted by retention (rank 0 only)."""
    freed_bytes: int = 0
    """Bytes of partial files a failed save removed (rank 0 only)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadResult:
    checkpoint_id: str
    """Checkpoint loaded."""
    step: int
    """Last step it includes: training resumes at step + 1."""
    data_position: int
    """This rank's data-loader position (samples consumed by the job)."""
    lr_scheduler: dict[str, Any] | None
    """LR-scheduler state, where one was saved."""
    grad_scaler: dict[str, Any] | None
    """Grad-scaler state, where one was saved."""
    versions: Versions
    """Versions that saved it (compare with `current_versions` to warn about a changed code or config)."""
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """What the save's `rank_extra` put in this rank's file ({} where it gave none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Report:
    rank: int
    error: str | None
    files: tuple[ShardFile, ...]
    vote: Any = None
    """The rank's `Staged.vote`, for the save's `Staged.judge`."""


def current_versions(config: object) -> Versions:
    """Versions of this process, with a hash of the numerics-relevant fields of a `CanaryConfig` (by name)."""
    digest = hashlib.sha256(repr([(n, getattr(config, n, None)) for n in _CONFIG_FIELDS]).encode()).hexdigest()
    return Versions(rankwatch=rankwatch.__version__, torch=str(torch.__version__), python=platform.python_version(),
                    numpy=np.__version__, config_sha256=digest, seed=int(getattr(config, "seed", 0)))


# -- file helpers -----------------------------------------------------------------------------------------
def _write_durably(path: Path, data: bytes, *, mid: Any = None) -> None:
    """Write `data` to ``path.tmp`` (the protocol's name: a kill leaves it for the catalog to read as partial), fsync,
    rename to `path`; `mid()` runs halfway through (fault injection)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            if mid is not None:
                mid()
            f.write(data[half:])

    atomic_write(path, write, tmp=path.with_name(path.name + ".tmp"))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def shard_key(layout: Layout, rank: int) -> str:
    _, tp, pp = layout.coords(rank)
    return f"pp{pp}.tp{tp}"


def _rng_state() -> dict[str, Any]:
    """RNG states in types `torch.load(weights_only=True)` accepts (numpy's array becomes a tensor)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),
        "numpy": (str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


_SHORT_WRITE = "unexpected pos"
"""torch's zip writer (caffe2/serialize/inline_container.cc, `PyTorchStreamWriter::writeRecord`) checks its position
after each write and fails with "[enforce fail at inline_container.cc:…] . unexpected pos N vs M" when the stream took
fewer bytes than it was given: a full disk reaches torch.save this way, with no errno."""
_LOW_FREE_BYTES = 16 << 20
"""Free space under which a short write is read as the disk being full."""


def _why(exc: BaseException, folder: Path) -> str:
    """`exc` in one line that says what went wrong: an OSError anywhere in its chain by its errno's text ("No space
    left on device"), torch's short write by the free space left where it wrote; else its first line."""
    text = _first_line(exc)
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            name = errno.errorcode.get(e.errno, str(e.errno))
            return text if f"[Errno {e.errno}]" in text else f"{os.strerror(e.errno)} ({name}): {text}"[:300]
        e = e.__cause__ or e.__context__
    if _SHORT_WRITE in text:
        try:
            free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        except OSError:
            return text
        if free < _LOW_FREE_BYTES:
            return f"No space left on device ({free} bytes free; torch's writer: {text})"[:300]
    return text


class DcpSaveError(Exception):
    """DCP's `CheckpointException` — a `BaseException` whose text is a traceback per rank — as an `Exception` whose
    text is one line: the first failing rank and its error (``rank 1: OSError: [Errno 28] No space left on device``)."""

    @classmethod
    def of(cls, exc: CheckpointException, folder: Path) -> DcpSaveError:
        if not exc.failures:
            return cls(_why(exc, folder))
        rank, (cause, _) = min(exc.failures.items(), key=lambda kv: kv[0])
        return cls(f"rank {rank}: {_why(cause, folder)}")


def _tree_size(path: Path) -> tuple[int, int]:
    """(files, bytes) under `path`; (0, 0) where it does not exist."""
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size


# -- save -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Staged:
    """A save's state copied out of training at its step (`stage_checkpoint`): what `commit_checkpoint` writes, while
    training goes on and changes the live model."""

    step: int
    rank: int
    layout: Layout
    versions: Versions
    tensors: dict[str, Any]
    """The DCP state (model and optimizer under their key), cloned."""
    payload: bytes
    """The rank's own file (RNG states, data position, scheduler, scaler, extra), serialized."""
    pieces: tuple[tuple[str, str], ...] = ()
    determinism: str = ""
    """`Manifest.determinism` (rank 0's is written)."""
    global_batch: int | None = None
    """`Manifest.global_batch`."""
    vote: Any = None
    """What this rank says it held at the step (picklable), gathered with every rank's file report."""
    judge: Callable[[Sequence[Any]], str] | None = None
    """Rank 0, from every rank's `vote` in rank order: `Manifest.agreement` (`AGREED`, or `DISAGREED` and how).
    None: not checked (the manifest says nothing)."""


def stage_checkpoint(
    collector: Any,
    *,
    step: int,
    rank: int,
    layout: Layout,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_position: int,
    versions: Versions,
    lr_scheduler: Any = None,
    grad_scaler: Any = None,
    state_key: str | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    pieces: tuple[tuple[str, str], ...] = (),
) -> Staged:
    """Copy this rank's state for a save of `step` (no collective, no file): model and optimizer cloned (a DTensor's
    local shard, on its device), the rank's own state serialized. The snapshot and serialize phases."""
    ckpt = checkpoint_id(step)
    with collector.checkpoint_phase(step, ckpt, CheckpointPhase.SNAPSHOT) as rec:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        key = state_key if state_key is not None else shard_key(layout, rank)
        tensors = {key: _clone({"model": model_sd, "optim": optim_sd})}
        rank_state = {
            "rank": rank, "step": step, "world_size": layout.world_size, "data_position": int(data_position),
            "rng": _rng_state(),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
            **({"extra": dict(rank_extra)} if rank_extra is not None else {}),
        }
        rec.bytes = _nbytes(tensors)
    with collector.checkpoint_phase(step, ckpt, CheckpointPhase.SERIALIZE) as rec:
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        payload = buf.getvalue()
        rec.bytes = len(payload)
    return Staged(step=step, rank=rank, layout=layout, versions=versions, tensors=tensors, payload=payload,
                  pieces=pieces)


def commit_checkpoint(collector: Any, config: CheckpointConfig, staged: Staged, *, run_dir: Path, group: Any
                      ) -> SaveResult:
    """Write a staged save and commit it: the write, fsync, gather and publish phases of the protocol (module
    docstring). Collective over `group`; every rank calls it with its own `Staged` of the same step. It may run on a
    thread of its own while training goes on (`recovery.Checkpointer`'s asynchronous save), with a process group of
    its own: nothing here touches the live model."""
    step, rank, layout, versions = staged.step, staged.rank, staged.layout, staged.versions
    tensors, payload, pieces = staged.tensors, staged.payload, staged.pieces
    ckpt = checkpoint_id(step)
    root = Path(run_dir) / CHECKPOINT_DIR
    tmp = root / f".{ckpt}.tmp"
    final = root / ckpt
    fault = config.fault
    world = layout.world_size

    def fire(point: SavePoint, path: Path | None = None) -> None:
        if fault is not None:
            fault.fire(point, rank=rank, step=step, path=path)

    error: str | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # our own temp from a save of this step that died: not evidence of anything committed
                shutil.rmtree(tmp)
        except OSError as exc:  # reported with the write reports below; the ranks still take every collective
            error = _why(exc, root)
    with collector.collective("barrier", group):
        dist.barrier(group=group)

    mine: list[Path] = []
    files: list[ShardFile] = []
    dcp_dir = tmp / DCP_DIR
    try:
        fire(SavePoint.WRITE)
        with collector.checkpoint_phase(step, ckpt, CheckpointPhase.WRITE) as rec:
            # DCP's own collectives carry an error on any rank to every rank, so the ranks stay in step here
            try:
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(dcp_dir, sync_files=False), process_group=group)
            except CheckpointException as exc:  # every rank gets it (DCP gathers the ranks' errors): a failed save
                raise DcpSaveError.of(exc, dcp_dir) from exc
            mine = sorted(p for p in dcp_dir.iterdir() if p.name.startswith(f"__{rank}_"))
            if rank == 0:
                mine.append(dcp_dir / ".metadata")
            shard = tmp / rank_shard_name(rank)
            mine.append(shard)
            _write_durably(shard, payload, mid=lambda: fire(SavePoint.SHARD, shard))
            rec.bytes = sum(p.stat().st_size for p in mine)
        fire(SavePoint.FSYNC, tmp)
        with collector.checkpoint_phase(step, ckpt, CheckpointPhase.FSYNC) as rec:
            for p in mine:
                fsync_path(p)
                files.append(ShardFile(path=p.relative_to(tmp).as_posix(), size=p.stat().st_size,
                                       sha256=sha256_file(p), rank=rank))
            rec.bytes = sum(f.size for f in files)
    except Exception as exc:  # an I/O failure here is reported to every rank below, not raised
        error = error or (_first_line(exc) if isinstance(exc, DcpSaveError) else _why(exc, tmp))
        collector.event(EventKind.WARNING, exc_type=type(exc).__name__,
                        message=f"checkpoint {ckpt}: rank {rank} failed to write: {error}")

    fire(SavePoint.GATHER)
    reports: list[Any] = [None] * world
    with collector.collective("all_gather_object", group):
        dist.all_gather_object(reports, _Report(rank=rank, error=error, files=tuple(files), vote=staged.vote),
                               group=group)

    outcome: tuple[bool, str] | None = None
    partial = (0, 0)
    if rank == 0:
        agreement = _agreement(collector, staged, reports)
        outcome = _publish(collector, reports, layout=layout, versions=versions, step=step, tmp=tmp, final=final,
                           fire=fire, pieces=pieces, agreement=agreement, determinism=staged.determinism,
                           global_batch=staged.global_batch)
        if not outcome[0]:
            partial = _tree_size(tmp)  # before any rank removes its files: what the failed save left
    outcomes: list[Any] = [None] * world
    with collector.collective("all_gather_object", group):
        dist.all_gather_object(outcomes, outcome, group=group)
    ok, reason = outcomes[0]

    if not ok:
        return _discard(collector, ckpt=ckpt, step=step, rank=rank, reason=reason, mine=mine, tmp=tmp, partial=partial)
    pruned = _prune(collector, Path(run_dir), config.keep_last) if rank == 0 else ()
    return SaveResult(ok=True, checkpoint_id=ckpt, step=step, path=final, reason="committed", pruned=pruned)


def _agreement(collector: Any, staged: Staged, reports: list[Any]) -> str:
    """Rank 0: `Manifest.agreement` from every rank's vote (`Staged.judge`); "" when the save does not check. A
    disagreement is also an event, so the live reading sees it before anything resumes from the save."""
    if staged.judge is None:
        return ""
    votes = [r.vote if r is not None else None for r in reports]
    try:
        agreement = staged.judge(votes)
    except Exception as exc:  # the save goes on; what could not be judged is not called agreed
        agreement = f"{DISAGREED} the votes could not be judged: {type(exc).__name__}: {_first_line(exc)}"
    if agreement.startswith(DISAGREED):
        collector.event(EventKind.WARNING, step=staged.step,
                        message=f"checkpoint {checkpoint_id(staged.step)}: the ranks {agreement}"[:1000])
    return agreement


def _discard(
    collector: Any, *, ckpt: str, step: int, rank: int, reason: str, mine: list[Path], tmp: Path,
    partial: tuple[int, int],
) -> SaveResult:
    """Remove what a save that committed nothing wrote, and record what failed and (rank 0) the bytes freed."""
    for p in mine:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass
    message = f"checkpoint {ckpt} not committed: {reason}"
    freed = 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        left = _tree_size(tmp)
        freed = partial[1] - left[1]
        message += f"; partial {tmp.name} removed: {partial[0] - left[0]} file(s), {freed} bytes freed"
        if left[0]:
            message += f", {left[0]} file(s) ({left[1]} bytes) could not be removed"
        try:
            message += f"; {shutil.disk_usage(tmp.parent).free} bytes free"
        except OSError:
            pass
    collector.event(EventKind.CHECKPOINT_FAILED, message=message)
    return SaveResult(ok=False, checkpoint_id=ckpt, step=step, path=None, reason=reason, freed_bytes=freed)


def _publish(
    collector: Any, reports: list[Any], *, layout: Layout, versions: Versions, step: int, tmp: Path, final: Path,
    fire: Any, pieces: tuple[tuple[str, str], ...] = (), agreement: str = "", determinism: str = "",
    global_batch: int | None = None,
) -> tuple[bool, str]:
    """Rank 0: write the manifest and make the checkpoint visible, only if every rank reported its files."""
    ckpt = checkpoint_id(step)
    failed = [r for r in reports if r is None or r.error is not None]
    if failed:
        first = failed[0]
        return False, f"rank {first.rank}: {first.error}" if first is not None else "a rank sent no report"
    try:
        with collector.checkpoint_phase(step, ckpt, CheckpointPhase.PUBLISH) as rec:
            if final.exists():
                raise FileExistsError(f"{final} already exists")
            manifest = Manifest(
                checkpoint_id=ckpt, step=step, world_size=layout.world_size, layout=layout, versions=versions,
                files=tuple(sorted((f for r in reports for f in r.files), key=lambda f: f.path)),
                created_wall_ns=time.time_ns(), pieces=pieces, agreement=agreement, determinism=determinism,
                global_batch=global_batch,
            )
            data = manifest.to_json().encode()
            rec.bytes = len(data)
            _write_durably(tmp / MANIFEST, data, mid=lambda: fire(SavePoint.MANIFEST, tmp / MANIFEST))
            fsync_path(tmp)
            fire(SavePoint.RENAME)
            os.rename(tmp, final)
    except Exception as exc:  # ValueError included: a manifest that does not validate is not published
        return False, f"rank 0 publish: {_first_line(exc)}"
    fire(SavePoint.PUBLISHED)
    try:
        fsync_path(final.parent)
    except OSError as exc:  # the rename happened: committed, but its durability across a power cut is unknown
        collector.event(EventKind.WARNING, exc_type=type(exc).__name__,
                        message=f"checkpoint {ckpt}: fsync of {final.parent} failed after commit: {_first_line(exc)}")
    return True, "committed"


def _prune(collector: Any, run_dir: Path, keep_last: int) -> tuple[str, ...]:
    """Delete committed checkpoints beyond the newest `keep_last`, except the newest recovery point (COMMITTED:
    complete, and no disagreement among the ranks when saved) when none of those is one: saves the ranks disagreed
    on must not push out the last one they agreed on. Partial and corrupt ones stay as evidence."""
    # finished saves: committed ones, and incomplete ones (intact, never recovery points, pruned alike)
    committed = [c for c in list_checkpoints(run_dir, verify=False)
                 if c.verdict in (Verdict.COMMITTED, Verdict.INCOMPLETE)]
    kept = committed[:keep_last]
    if not any(c.verdict is Verdict.COMMITTED for c in kept):
        kept += [c for c in committed[keep_last:] if c.verdict is Verdict.COMMITTED][:1]
    pruned: list[str] = []
    keep = {c.path for c in kept}
    for c in committed:
        if c.path in keep:
            continue
        doomed = c.path.with_name(f".{c.path.name}.deleting")  # not a candidate name: a crash mid-delete is no "partial"
        try:
            os.rename(c.path, doomed)
            shutil.rmtree(doomed)
            pruned.append(c.path.name)
        except OSError as exc:
            collector.event(EventKind.WARNING, exc_type=type(exc).__name__,
                            message=f"checkpoint retention: could not delete {c.path.name}: {_first_line(exc)}")
    return tuple(pruned)


# -- load -------------------------------------------------------------------------------------------------
def load_checkpoint(
    collector: Any,
    candidate: Candidate,
    *,
    rank: int,
    layout: Layout,
    group: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    verify: bool = True,
    state_key: str | None = None,
) -> LoadResult:
    """Restore model, optimizer and this rank's RNG states from `candidate`; returns the data position and the
    rest of the per-rank state. Collective over `group`. With `verify`, the ranks split the manifest's files,
    check their SHA-256 and agree on the result before anything is loaded (ValueError if any is damaged).
    `state_key` as `stage_checkpoint` was given it. With one `state_key` for every rank, a checkpoint saved by
    another data-parallel degree (same tp and pp) loads too: DCP reads each tensor for the new sharding, and the rank
    at (dp, tp, pp) takes the rank file of the old rank at (dp mod the old dp degree, tp, pp), a replica of its own
    shard (its RNG states, data position and fingerprints; the job re-plans its data over the new replicas, and
    lineage marks the resume CHANGED)."""
    manifest = candidate.manifest
    if candidate.verdict is not Verdict.COMMITTED or manifest is None:
        raise ValueError(f"checkpoint {candidate.path}: {candidate.verdict} ({candidate.reason}); not loadable")
    if manifest.layout != layout and (state_key is None or (manifest.layout.tp, manifest.layout.pp) != (layout.tp,
                                                                                                       layout.pp)):
        raise ValueError(f"checkpoint {candidate.path}: layout incompatible: saved by {manifest.layout}, job is {layout}")
    dp, tp, pp = layout.coords(rank)
    source = manifest.layout.rank_of(dp=dp % manifest.layout.dp, tp=tp, pp=pp)
    ckpt, step, world = manifest.checkpoint_id, manifest.step, layout.world_size
    if verify:
        with collector.checkpoint_phase(step, ckpt, CheckpointPhase.VERIFY) as rec:
            problems: list[str] = []
            share = manifest.files[rank::world]
            for f in share:
                p = candidate.path / f.path
                if not p.exists():
                    problems.append(f"missing shard {f.path}")
                elif p.stat().st_size != f.size:
                    problems.append(f"size mismatch for {f.path}")
                elif sha256_file(p) != f.sha256:
                    problems.append(f"sha256 mismatch for {f.path}")
            rec.bytes = sum(f.size for f in share)
            gathered: list[Any] = [None] * world
            with collector.collective("all_gather_object", group):
                dist.all_gather_object(gathered, problems, group=group)
        found = [p for ps in gathered for p in ps]
        if found:
            raise ValueError(f"checkpoint {candidate.path}: {found[0]} (found while loading)")
    with collector.checkpoint_phase(step, ckpt, CheckpointPhase.LOAD) as rec:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # a fresh optimizer gets zero state to load into
        key = state_key if state_key is not None else shard_key(layout, rank)
        tensors: dict[str, dict[str, Any]] = {key: {"model": model_sd, "optim": optim_sd}}
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(candidate.path / DCP_DIR), process_group=group)
        loaded = tensors[key]
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        state = torch.load(candidate.path / rank_shard_name(source), weights_only=True)
        if state["rank"] != source or state["step"] != step or state["world_size"] != manifest.world_size:
            raise ValueError(f"checkpoint {candidate.path}: {rank_shard_name(source)} holds rank {state['rank']} step "
                             f"{state['step']} of world {state['world_size']}, expected rank {source} step {step}")
        set_rng_state(state["rng"])
        rec.bytes = _nbytes(tensors)
    return LoadResult(checkpoint_id=ckpt, step=step, data_position=int(state["data_position"]),
                      lr_scheduler=state["lr_scheduler"], grad_scaler=state["grad_scaler"], versions=manifest.versions,
                      extra=state.get("extra") or {})

