"""The recovery contract in a user's own training loop: save at a step, resume behind the consistency gate.

    from rankwatch import collector, recovery
    rw = collector.attach(mesh=mesh)
    ckpt = recovery.Checkpointer(rw, model, optimizer, lr_scheduler=None, grad_scaler=None, data=loader,
                                 rng={"torch": "replicated"}, every=50)
    for step in range(ckpt.resume(), steps):       # 0 on a fresh run; else the step after the checkpoint loaded
        with rw.step(step):
            ...
        ckpt.after_step(step)                      # saves after every `every`-th step

**Saving** (`save`, collective over the world group) goes through the commit protocol of `recovery.checkpoint`:
model and optimizer through torch DCP under one key for every rank (`STATE_KEY`), so DCP's global plan covers each
DTensor shard once — FSDP2's `fully_shard` parameters, tensor-parallel weights, their optimizer state — and writes one
copy of a tensor every rank holds whole (DDP); per-shard SHA-256; one manifest, published only after every rank
reported its files. Each rank's own file holds its RNG states, its data position (`data.state_dict()`), the scheduler
and scaler states, and the fingerprints of what it saved (`collector.fingerprint`: local shards, XXH3).

**What a job saves beyond model and optimizer is asked for explicitly**: `lr_scheduler`, `grad_scaler`, `data` and
`rng` have no defaults. `None` for a scheduler or scaler says the job has none. `data=None` says the job gives no
data position: every save then says in its manifest that it lacks one (`Manifest.pieces`), and the catalog never
offers it as a recovery point (`catalog.Verdict.INCOMPLETE`): resuming would restart the data stream where it began
and change the trajectory invisibly. A data object whose `state_dict()` fails at a save makes that save lack it
the same way.

**Resuming** (`resume`, collective): rank 0 chooses the newest committed, SHA-256-verified checkpoint this layout can
load (`recovery.resume.plan`; incomplete, partial, corrupt and incompatible candidates are passed over with their
reasons) and every rank loads it; then the consistency gate (`recovery.gate`) must AGREE before the first step:

- every rank restored exactly what it saved: its parameters, optimizer state, RNG states and data position hash as
  they did when saved (this is what proves a sharded or per-rank-seeded state, which no peer holds a copy of);
- every rank is at the same step;
- ranks that must hold equal parameters and optimizer state (`collector.fingerprint.consistency_domain`: every rank
  under DDP, replicas of a shard under HSDP; nobody else under FSDP2 or FSDP + TP) hold equal hashes;
- the RNG streams the job declares replicated (``rng={"torch": "replicated"}``: every rank seeded torch alike) are
  equal on every rank; those declared ``replicas`` (alike within each shard's replicas, as when each pipeline
  stage seeds or draws on its own) are equal within each consistency domain; a stream declared ``per_rank`` (seeded
  by rank on purpose), or not named (Python's and numpy's, which most scripts never seed), is not compared across
  ranks — its restore is still checked.

Anything else raises `GateRefused` on every rank alike, and training does not start. After the gate, rank 0 appends
the lineage (`recovery.resume.record_resume`: RESTART, or ROLLBACK and the range of steps trained twice, world-size
and layout changes). A run with no checkpoint starts at step 0 (a rollback to initialization in the lineage when an
earlier attempt had trained steps); a run whose checkpoints are all unusable raises ValueError naming each.

A DDP model's gradient buckets are fixed when the Checkpointer is built (before the first forward): DDP otherwise
lays them out anew after each process's first backward, and the first step after a resume would sum its gradients in
another layout than the uninterrupted run did (`recovery.determinism`).

Attempts are numbered by the launch (`collector.launcher_env.numbered`), so the same command relaunched resumes as
the next attempt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

import rankwatch
from rankwatch.base.schema import ChangeReason, EventKind, GroupKind
from rankwatch.base.topology import Layout, group_kind, group_specs
from rankwatch.collector.fingerprint import (
    consistency_domain, domain_name, hash_optimizer, hash_tensors, nonfinite_counts, rng_hashes,
)
from rankwatch.collector.launcher_env import RUN_DIR_ENV, launch_env, numbered
from rankwatch.recovery.catalog import (
    AGREED, DISAGREED, PIECE_MISSING, PIECE_NONE, PIECE_SAVED, Versions, list_checkpoints,
)
from rankwatch.recovery.checkpoint import (
    CheckpointConfig, CheckpointFault, SaveResult, Staged, commit_checkpoint, load_checkpoint, shard_key,
    stage_checkpoint,
)
from rankwatch.recovery.decision import GateVerdict
from rankwatch.recovery.determinism import DDP_BUCKET_CAP_MB, DeterminismInputs, pin_ddp_buckets
from rankwatch.recovery.gate import Domain, Field, GateOutcome, RankState, judge, run_gate
from rankwatch.recovery.job import FROM_START, LAYOUT_ENV, REPLAY_BASIS_ENV, RESUME_FROM_ENV
from rankwatch.recovery.lineage import Verdict as LineageVerdict, comparability_of_resume, inputs_json
from rankwatch.recovery.resume import (
    FROM_INITIALIZATION, BatchPlan, GateRefused, last_completed_step, plan, previous_batch_plan, record_batch_change,
    record_resume,
)

__all__ = ["STATE_KEY", "Checkpointer", "RngScope", "Stateful", "Vote", "agreement_of", "gate_domains",
           "job_layout", "job_versions"]

STATE_KEY = "state"
"""The DCP key of model and optimizer, the same on every rank."""

_RNG_STREAMS = {"python": Field.RNG_PYTHON, "numpy": Field.RNG_NUMPY, "torch": Field.RNG_TORCH, "cuda": Field.RNG_CUDA}
"""The RNG streams a job declares, by name: Python's `random`, numpy's global generator, torch's CPU generator,
torch's CUDA generators (`torch.manual_seed` seeds the last two)."""


class RngScope(StrEnum):
    """How a job seeds one of its random number generators."""

    REPLICATED = "replicated"
    """Every rank seeds and draws alike: the gate compares the stream across all ranks."""
    REPLICAS = "replicas"
    """The replicas of a shard seed and draw alike, other shards need not (Megatron seeds each pipeline stage on its
    own; a stage that builds other layers draws other numbers while it builds them): the gate compares the stream
    within each rank's consistency domain (`Checkpointer.members`)."""
    PER_RANK = "per_rank"
    """Each rank seeds its own (seed + rank, as many scripts do), or nobody seeds it: each rank's restored state is
    checked against what it saved, never against a peer's."""


def rng_fields(rng: RngScope | str | Mapping[str, RngScope | str],
               scope: RngScope = RngScope.REPLICATED) -> tuple[Field, ...]:
    """The gate fields of the streams declared with `scope` (default: replicated): one scope for every stream, or a
    scope per stream name (python, numpy, torch, cuda; a stream not named is per rank). ValueError naming an unknown
    stream or scope."""
    if isinstance(rng, Mapping):
        unknown = sorted(set(rng) - set(_RNG_STREAMS))
        if unknown:
            raise ValueError(f"rankwatch.recovery.Checkpointer: rng names unknown stream(s) {unknown}; "
                             f"streams are {', '.join(_RNG_STREAMS)}")
        scopes = {name: _scope(value) for name, value in rng.items()}
    else:
        scopes = dict.fromkeys(_RNG_STREAMS, _scope(rng))
    return tuple(f for name, f in _RNG_STREAMS.items() if scopes.get(name) is scope)


def _scope(value: RngScope | str) -> RngScope:
    try:
        return RngScope(value)
    except ValueError:
        raise ValueError(f"rankwatch.recovery.Checkpointer: rng scope {value!r} is none of "
                         f"{', '.join(repr(str(s)) for s in RngScope)}") from None


class _Background:
    """The collector as an asynchronous save's thread uses it: its checkpoint phases and events are recorded, and
    nothing of the training thread's own state is touched (its step's time, where the liveness record says it is,
    its open collectives: the save's collectives run on a process group of their own, not timed)."""

    def __init__(self, collector: Any) -> None:
        self._collector = collector

    def collective(self, op: str, group: Any, tensor: Any = None, *, peer: int | None = None) -> Any:
        return contextlib.nullcontext()

    def checkpoint_phase(self, step: int, checkpoint_id: str, phase: Any, nbytes: int | None = None) -> Any:
        return self._collector.checkpoint_phase(step, checkpoint_id, phase, nbytes, background=True)

    def event(self, kind: EventKind, **kw: Any) -> None:
        self._collector.event(kind, **kw)


class Stateful(Protocol):
    """What `data` must offer (torch DCP's `Stateful`, torchdata's `StatefulDataLoader`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def job_layout(mesh: Any, world_size: int) -> Layout:
    """The job's (dp, tp, pp) from a DeviceMesh's dimension names (`base.topology.group_kind`: dp / fsdp / shard /
    replicate are data parallel, tp tensor, pp pipeline; a dimension of another kind counts as data parallel); all
    data parallel without a mesh. ValueError when the mesh does not span the world."""
    if mesh is None:
        return Layout(dp=world_size)
    sizes = {GroupKind.DP: 1, GroupKind.TP: 1, GroupKind.PP: 1}
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    for i, name in enumerate(names):
        kind = group_kind(str(name))
        sizes[kind if kind in sizes else GroupKind.DP] *= int(mesh.size(i))
    layout = Layout(dp=sizes[GroupKind.DP], tp=sizes[GroupKind.TP], pp=sizes[GroupKind.PP])
    if layout.world_size != world_size:
        raise ValueError(f"rankwatch.recovery.Checkpointer: the mesh {dict(zip(names, mesh.shape))} holds "
                         f"{layout.world_size} ranks, the world {world_size}")
    return layout


def job_versions(config: Mapping[str, Any] | None, *, seed: int = 0) -> Versions:
    """The versions a checkpoint records: rankwatch, torch, Python, numpy, and a SHA-256 of the job's config (its
    JSON with sorted keys; values that are not JSON by their text)."""
    import platform

    import numpy as np

    text = json.dumps(dict(config or {}), sort_keys=True, default=str)
    return Versions(rankwatch=rankwatch.__version__, torch=str(torch.__version__), python=platform.python_version(),
                    numpy=np.__version__, config_sha256=hashlib.sha256(text.encode()).hexdigest(), seed=int(seed))


def _hash_data(state: Any) -> str:
    """A data position's state, hashed: tensors by their bytes, the rest by its text (`collector.fingerprint`)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    rest: list[str] = []

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            tensors.append((prefix, v))
        elif isinstance(v, Mapping):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(f"{prefix}[{i}]", item)
        else:
            rest.append(f"{prefix}={v!r}")

    walk("", state)
    digest, _ = hash_tensors(tensors)
    return hashlib.sha256((digest + "\n".join(rest)).encode()).hexdigest()[:16]


def determinism_changes(manifest: Any, now: DeterminismInputs) -> tuple[str, ...]:
    """One 'name old->new' per determinism input that differs between the checkpoint's saver (`Manifest.determinism`)
    and `now`; () when the manifest records none. ValueError naming the checkpoint when what it records is not one."""
    if not manifest.determinism:
        return ()
    where = f"checkpoint {manifest.checkpoint_id} manifest"
    try:
        doc = json.loads(manifest.determinism)
    except ValueError as exc:
        raise ValueError(f"{where}: determinism inputs are not JSON ({exc})") from None
    return DeterminismInputs.from_dict(doc, where=where).changes(now)


def gate_domains(members: Sequence[Sequence[int]], *, world_size: int, rng: Sequence[Field],
                 position: bool = False, replica_rng: Sequence[Field] = ()) -> list[Domain]:
    """The gate's domains from each rank's consistency-domain members (`consistency_domain`, in rank order): the
    world on the step, the RNG streams declared replicated (`rng`) and, where the job gives one (`position`), its
    data position; each domain of two or more ranks on parameters, optimizer state and the RNG streams declared
    alike within a shard's replicas (`replica_rng`)."""
    world = (Field.STEP, *rng, *((Field.DATA_POSITION,) if position else ()))
    domains = [Domain(name="world", ranks=tuple(range(world_size)), fields=world)]
    seen: set[tuple[int, ...]] = set()
    for ranks in members:
        if len(ranks) > 1 and tuple(ranks) not in seen:
            seen.add(tuple(ranks))
            domains.append(Domain(name=domain_name(ranks), ranks=tuple(ranks),
                                  fields=(Field.PARAM, Field.OPTIM, *replica_rng)))
    return domains


Vote = tuple[RankState, Sequence[int], tuple[int, int]]
"""A rank's word at a save: what it held (hashed as the gate hashes it), its consistency domain's members, and the
non-finite elements in the parameters and the optimizer state it holds (`fingerprint.nonfinite_counts`)."""


def agreement_of(votes: Sequence[Vote | None], *, rng: Sequence[Field], position: bool = False,
                 replica_rng: Sequence[Field] = ()) -> str:
    """`Manifest.agreement` of a save from every rank's vote (rank order; None from a rank that sent none): the
    resume gate's domains and fields (`gate_domains`) judged at the save, and no rank holding a NaN or inf (a value
    no other rank may hold a copy of under sharding, which resuming would carry on). A save the ranks disagreed on
    is never a recovery point (the gate would refuse most of them at the resume anyway) and retention keeps the
    last one they agreed on. Pure."""
    missing = [r for r, v in enumerate(votes) if v is None]
    if missing:
        return f"{DISAGREED} no vote from ranks {missing}"
    present = [v for v in votes if v is not None]
    domains = gate_domains([v[1] for v in present], world_size=len(votes), rng=rng, position=position,
                           replica_rng=replica_rng)
    outcomes = [judge(d, [v[0] for v in present]) for d in domains]
    why = [o.message().removeprefix("consistency gate ") for o in outcomes if o.verdict is not GateVerdict.AGREE]
    why += [f"rank {v[0].rank} holds non-finite values ({v[2][0]} in its parameters, {v[2][1]} in its optimizer "
            "state)" for v in present if v[2][0] or v[2][1]]
    return f"{DISAGREED} " + "; ".join(why)[:800] if why else AGREED


class Checkpointer:
    """Save and resume a user's training loop under the recovery contract (module docstring). One per job, built on
    every rank with the same arguments after the model is sharded and the optimizer built."""

    def __init__(self, collector: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 lr_scheduler: Any, grad_scaler: Any, data: Stateful | None,
                 rng: RngScope | str | Mapping[str, RngScope | str], every: int,
                 keep_last: int = 3, mesh: Any = None, config: Mapping[str, Any] | None = None, seed: int = 0,
                 run_dir: str | Path | None = None, group: Any = None, async_save: bool = False,
                 global_batch: int | None = None, position: Callable[[], int] | None = None,
                 layout: Layout | None = None, attempt: int | None = None, pin_buckets: bool = True) -> None:
        """`collector`: the attached collector (its rank, world size, attempt and run directory; a `NullCollector`
        works with `run_dir`). `every`: save after each `every`-th step (`after_step`); 0 saves only when `save` is
        called. `mesh`: the DeviceMesh the layout is read from. `config`: the job's settings that change its numerics
        (hashed into the manifest: a resume under another config is marked CHANGED in the lineage). `group`: the
        world group (default: torch's default group). `async_save`: a save copies the state at its step and writes
        and commits it on a thread of its own, over a gloo process group of its own (built here: a collective), while
        training goes on (see `save`). `global_batch`: the samples per optimizer step across the job, where the
        job says (recorded in each manifest; a resume on another world records old and new in the lineage, so a
        data-parallel job that goes on with fewer replicas says whether it kept its global batch).
        `position`: the job's data position as a number every rank must agree on (the samples the job consumed:
        the global batch times the batches its stream gave), where the job has one: compared across the ranks at
        every save and at the resume gate, so a rank whose stream ran ahead or behind makes its saves disagreed.
        `data`'s own state is per rank (each rank's stream) and is checked only against what that rank saved.
        `layout`: for a job that splits its model by hand, with no DeviceMesh and no DTensor (its own tensor-parallel
        all-reduces and pipeline send/recv, as the canary does): its (dp, tp, pp) in `base.topology`'s rank order.
        Each (tp, pp) shard is then saved under a DCP key of its own (`checkpoint.shard_key`: the shards' parameters
        share names), and a rank's consistency domain is its data-parallel group (the replicas of its shard). A
        resume on another dp degree loads too (each shard's replicas hold it whole). `attempt`: the attempt number
        where the job's own launcher keeps it (default: the collector's, or the launch's). `pin_buckets`: False
        leaves a DDP model's buckets to DDP (a job that measures what pinning changes; see `_pin_buckets`)."""
        self._position = position
        if global_batch is not None and global_batch < 1:
            raise ValueError(f"rankwatch.recovery.Checkpointer: global_batch must be >= 1, got {global_batch}")
        self._global_batch = global_batch
        self._collector = collector
        self._model = model
        self._optimizer = optimizer
        self._scheduler = lr_scheduler
        self._scaler = grad_scaler
        self._data = data
        self._rng_fields = rng_fields(rng)
        self._replica_rng_fields = rng_fields(rng, RngScope.REPLICAS)
        self._rng_text = json.dumps(dict(rng) if isinstance(rng, Mapping) else str(rng), default=str)
        if every < 0:
            raise ValueError(f"rankwatch.recovery.Checkpointer: every must be >= 0, got {every}")
        self._every = every
        # the drills' full disk and killed save, through the job's environment (`checkpoint.CHECKPOINT_FAULT_ENV`)
        self._config = CheckpointConfig(keep_last=keep_last, fault=CheckpointFault.from_env())
        self.rank = int(getattr(collector, "rank", dist.get_rank() if dist.is_initialized() else 0))
        self.world_size = int(getattr(collector, "world_size", dist.get_world_size() if dist.is_initialized() else 1))
        where = run_dir if run_dir is not None else getattr(getattr(collector, "config", None), "run_dir", None)
        where = where if where is not None else os.environ.get(RUN_DIR_ENV)
        if not where:
            raise ValueError(f"rankwatch.recovery.Checkpointer: no run directory (pass run_dir, attach a collector, or "
                             f"set {RUN_DIR_ENV})")
        self.run_dir = Path(where)
        # the collector's attempt; without one (RANKWATCH_DISABLE=1's NullCollector), the launch's own number
        attempt = attempt if attempt is not None else getattr(collector, "attempt", None)
        self.attempt = int(attempt) if attempt is not None else numbered(launch_env(), self.run_dir).attempt
        if layout is not None and mesh is not None:
            raise ValueError("rankwatch.recovery.Checkpointer: pass a mesh (its layout is read from it) or a layout "
                             "(a model split by hand), not both")
        if layout is not None and layout.world_size != self.world_size:
            raise ValueError(f"rankwatch.recovery.Checkpointer: the layout {layout} holds {layout.world_size} ranks, "
                             f"the world {self.world_size}")
        self.layout = layout if layout is not None else job_layout(mesh, self.world_size)
        self._by_hand = layout is not None
        self._key = shard_key(self.layout, self.rank) if self._by_hand else STATE_KEY
        """The DCP key of this rank's model and optimizer: one for every rank (DCP's plan covers each DTensor shard
        once), or one per shard of a model split by hand."""
        self._members: tuple[int, ...] | None = None
        declared = os.environ.get(LAYOUT_ENV, "")
        if declared and declared != str(self.layout):
            raise ValueError(f"rankwatch.recovery.Checkpointer: the recovery manager was told this job's layout is "
                             f"{declared} ({LAYOUT_ENV}); its mesh says {self.layout}")
        self._ordered = os.environ.get(RESUME_FROM_ENV, "") or None
        """The checkpoint the recovery manager's relaunch must resume from (`FROM_START`: step 0); None unordered."""
        self._resumed = False
        self._versions = job_versions(config, seed=seed)
        self._group = group
        self.last_save: SaveResult | None = None
        self.buckets_pinned = (self._pin_buckets(model) if pin_buckets else
                               False if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None)
        if self.rank == 0 and global_batch is not None:  # what a restart from step 0 on another world compares with
            self._collector.event(EventKind.GLOBAL_BATCH, message=json.dumps(
                {"global_batch": global_batch, "world_size": self.world_size}))
        self._async = async_save
        self._save_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self._pending: threading.Thread | None = None
        self._pending_out: list[Any] = []

    def _pin_buckets(self, model: torch.nn.Module) -> bool | None:
        """A DDP model's gradient buckets built now, in parameter order (`determinism.pin_ddp_buckets`): DDP otherwise
        rebuilds them after each process's first backward, so the first step after a resume would sum its
        gradients in another layout than the uninterrupted run and leave its trajectory in the last bits. None for
        a model that is not DDP; False, with a warning event, when its first forward already ran."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return None
        try:
            pin_ddp_buckets(model)
            return True
        except RuntimeError as exc:
            self._collector.warning(f"rankwatch.recovery.Checkpointer: DDP buckets not pinned ({exc}); build the "
                                    "Checkpointer before the first forward, or a resumed run is not bitwise equal to "
                                    "an uninterrupted one")
            return False

    # -- save ------------------------------------------------------------------------------------------------
    def after_step(self, step: int) -> SaveResult | None:
        """Save when `step` completes an `every`-step interval; None otherwise. RuntimeError when the recovery manager
        relaunched the job to resume and the script trained without calling `resume` (its command lacks the flag
        that makes it resume): the trajectory would change invisibly."""
        if self._ordered is not None and not self._resumed:
            raise RuntimeError(f"rankwatch.recovery.Checkpointer: the recovery manager relaunched this job to resume "
                               f"from {self._ordered} ({RESUME_FROM_ENV}), and it trained step {step} without calling "
                               f"Checkpointer.resume() (does its command ask the script to resume?)")
        if self._every and (step + 1) % self._every == 0:
            return self.save(step)
        return None

    def _pieces_and_data(self) -> tuple[tuple[tuple[str, str], ...], Any]:
        data_state: Any = None
        if self._data is None:
            data_piece = f"{PIECE_MISSING} the job gave no data position (Checkpointer data=None)"
        else:
            try:
                data_state = self._data.state_dict()
                data_piece = PIECE_SAVED
            except Exception as exc:  # the save goes on; the manifest says what it lacks
                data_piece = f"{PIECE_MISSING} data.state_dict() failed: {type(exc).__name__}: {str(exc)[:120]}"
        pieces = (
            ("lr_scheduler", PIECE_SAVED if self._scheduler is not None else PIECE_NONE),
            ("grad_scaler", PIECE_SAVED if self._scaler is not None else PIECE_NONE),
            ("rng", PIECE_SAVED),
            ("data_position", data_piece),
        )
        return pieces, data_state

    def _hashes(self, data_state: Any) -> dict[str, str | None]:
        param, _ = hash_tensors(self._model.named_parameters())
        py, npy, cpu, cuda = rng_hashes()
        return {"param": param, "optim": hash_optimizer(self._optimizer), "rng_python": py, "rng_numpy": npy,
                "rng_torch": cpu, "rng_cuda": cuda, "data": _hash_data(data_state) if data_state is not None else None}

    def save(self, step: int) -> SaveResult | None:
        """Save and commit a checkpoint of the state after `step` (collective: every rank calls it). A failed save
        (a full disk) commits nothing and training goes on; the result says why (`SaveResult.reason`).

        With `async_save`, the state is copied now (the snapshot: model and optimizer cloned, the rank's own state
        serialized), and the write, the per-file SHA-256, the gather of every rank's report and the manifest run on
        a thread over the Checkpointer's own process group; this returns None at once. The commit rule is the same:
        the manifest is published only after every rank reported its files, so a save cut short (the process killed
        while it writes) leaves a ``.tmp`` folder the catalog calls PARTIAL and never chooses. One save is in flight
        at a time: the next `save`, `resume` and `wait` wait for it."""
        self.wait()
        pieces, data_state = self._pieces_and_data()
        extra = {"data": data_state, "saved": self._hashes(data_state), "rng_scope": self._rng_text}
        staged = stage_checkpoint(
            self._collector, step=step, rank=self.rank, layout=self.layout, model=self._model,
            optimizer=self._optimizer, data_position=self._position_now(), versions=self._versions,
            lr_scheduler=self._scheduler, grad_scaler=self._scaler, state_key=self._key, rank_extra=extra,
            pieces=pieces)  # what restores the position: `data`'s state
        staged = replace(staged, vote=self._vote(step, extra["saved"]), judge=self._judge,
                         determinism=inputs_json(self.determinism()), global_batch=self._global_batch)
        if not self._async:
            result = commit_checkpoint(self._collector, self._config, staged, run_dir=self.run_dir, group=self._group)
            self.last_save = result
            return result
        self._pending_out = []
        self._pending = threading.Thread(target=self._commit, args=(staged,), name=f"rankwatch-save-{step}",
                                         daemon=True)
        self._pending.start()
        return None

    def determinism(self) -> DeterminismInputs:
        """This process's determinism inputs (`recovery.determinism`): threads, the deterministic-algorithms flag,
        backend, DDP's bucket settings, versions, the numeric environment. Each save records them in its manifest;
        a resume under other ones is CHANGED in the lineage with what changed."""
        ddp = self._model if isinstance(self._model, torch.nn.parallel.DistributedDataParallel) else None
        cap = getattr(ddp, "bucket_bytes_cap", None) if ddp is not None else None
        return DeterminismInputs.current(
            threads=torch.get_num_threads(),
            backend=str(dist.get_backend(self._group)) if dist.is_initialized() else "none",
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            buckets_pinned=bool(self.buckets_pinned),
            bucket_cap_mb=round(cap / (1024 * 1024)) if cap else DDP_BUCKET_CAP_MB,
            gradient_as_bucket_view=bool(getattr(ddp, "gradient_as_bucket_view", False)))

    def _state(self, step: int, hashes: Mapping[str, str | None]) -> RankState:
        """What this rank holds at `step` as the gate compares it, from `_hashes`."""
        return RankState(rank=self.rank, step=step, data_position=self._position_now(), param=str(hashes["param"]),
                         optim=str(hashes["optim"]), rng_python=str(hashes["rng_python"]),
                         rng_numpy=str(hashes["rng_numpy"]), rng_torch=str(hashes["rng_torch"]),
                         rng_cuda=hashes["rng_cuda"])

    def _vote(self, step: int, saved: Mapping[str, str | None]) -> Vote:
        """This rank's word at a save of `step` (`Vote`)."""
        return self._state(step, saved), self.members(), nonfinite_counts(self._model, self._optimizer)

    def members(self) -> tuple[int, ...]:
        """The ranks that must hold this rank's parameters and optimizer state bitwise alike, in rank order: its
        data-parallel group for a model split by hand (`layout`), else `fingerprint.consistency_domain` of the model
        (every rank under DDP, the replicas of a shard under HSDP, itself alone under FSDP2 or FSDP + TP). Worked
        out once: the model's placement does not change while it trains."""
        if self._members is None:
            if self._by_hand:
                self._members = next(tuple(ranks) for kind, _, ranks in group_specs(self.layout)
                                     if kind is GroupKind.DP and self.rank in ranks)
            else:
                self._members = tuple(consistency_domain(self._model, self.rank, self.world_size)[1])
        return self._members

    def _judge(self, votes: Sequence[Any]) -> str:
        return agreement_of(votes, rng=self._rng_fields, position=self._position is not None,
                            replica_rng=self._replica_rng_fields)

    def _domains(self, members: Sequence[Sequence[int]]) -> list[Domain]:
        return gate_domains(members, world_size=self.world_size, rng=self._rng_fields,
                            position=self._position is not None, replica_rng=self._replica_rng_fields)

    def _position_now(self) -> int:
        """`position()` now; -1 where the job gives none, or where it raised (then this rank disagrees)."""
        if self._position is None:
            return -1
        try:
            return int(self._position())
        except Exception:
            return -1

    def _commit(self, staged: Staged) -> None:
        try:
            self._pending_out.append(commit_checkpoint(_Background(self._collector), self._config, staged,
                                                       run_dir=self.run_dir, group=self._save_group))
        except BaseException as exc:  # the save's group broke: `wait` raises it in the training thread
            self._pending_out.append(exc)

    def wait(self) -> SaveResult | None:
        """Wait for the asynchronous save in flight, if any, and return its result (None when none was in flight).
        Raises what broke its process group (a dead peer), as a synchronous save would."""
        thread, self._pending = self._pending, None
        if thread is None:
            return None
        thread.join()
        out = self._pending_out[0] if self._pending_out else RuntimeError("the asynchronous save left no result")
        if isinstance(out, BaseException):
            raise out
        self.last_save = out
        return out

    def close(self) -> SaveResult | None:
        """The end of training: wait for the save in flight (`wait`). Call it before the process group goes."""
        return self.wait()

    # -- resume ----------------------------------------------------------------------------------------------
    def resume(self, checkpoint_id: str | None = None) -> int:
        """Collective: load the newest usable checkpoint behind the consistency gate and record the lineage; returns
        the step to train next (0 when the run has no checkpoint). `checkpoint_id`: that checkpoint (its folder's
        name) or a ValueError saying why it cannot be used. Raises ValueError when checkpoints exist but none is
        usable (each named with its reason), `GateRefused` when the gate does not agree."""
        self._resumed = True
        self.wait()
        if self.rank == 0 and os.environ.get(REPLAY_BASIS_ENV, ""):
            basis = os.environ[REPLAY_BASIS_ENV]
            self._collector.event(EventKind.REPLAY_BASIS, step=int(basis) if basis.isdigit() else None,
                                  message=f"earlier attempts are a replay reference before step {basis} only")
        box: list[Any] = [None]
        if self.rank == 0:
            box[0] = self._choose(checkpoint_id)
        dist.broadcast_object_list(box, src=0, group=self._group)
        choice = box[0]
        if isinstance(choice, str):
            raise ValueError(choice)
        if choice is None:
            return self._fresh()
        chosen = choice.chosen
        m = chosen.manifest
        if self.rank == 0:
            print(f"rankwatch: {choice.describe()}", flush=True)
            self._collector.event(EventKind.RECOVERY, message=choice.describe()[:1000])
        loaded = load_checkpoint(self._collector, chosen, rank=self.rank, layout=self.layout, group=self._group,
                                 model=self._model, optimizer=self._optimizer, state_key=self._key)
        extra = dict(loaded.extra)
        problems: list[str] = []
        if self._scheduler is not None:
            if loaded.lr_scheduler is None:
                problems.append("the checkpoint holds no lr_scheduler state")
            else:
                self._scheduler.load_state_dict(loaded.lr_scheduler)
        if self._scaler is not None:
            if loaded.grad_scaler is None:
                problems.append("the checkpoint holds no grad_scaler state")
            else:
                self._scaler.load_state_dict(loaded.grad_scaler)
        if self._data is not None:
            if extra.get("data") is None:
                problems.append("the checkpoint holds no data position")
            else:
                self._data.load_state_dict(extra["data"])
        saved = extra.get("saved") or {}
        try:  # the loader's state as it now reports it: what it restored, not what it was given
            restored = self._data.state_dict() if self._data is not None and extra.get("data") is not None else None
        except Exception as exc:
            restored = None
            problems.append(f"data.state_dict() failed after loading: {type(exc).__name__}: {str(exc)[:120]}")
        now = self._hashes(restored)
        names: tuple[str, ...] = ("param", "optim", "rng_python", "rng_numpy", "rng_torch", "rng_cuda", "data")
        if m.world_size != self.world_size and self._sharded():
            problems.append(f"the state is sharded (DTensor) and was saved by {m.world_size} ranks: each rank's "
                            f"shards after loading on {self.world_size} cannot be checked against what any rank "
                            "saved, so the resume is not proven")
            names = names[2:]
        for name in names:
            if name in saved and saved[name] != now[name]:
                problems.append(f"{name} after loading differs from what rank {self.rank} saved")
        if not saved:
            problems.append("the checkpoint holds no fingerprints of what was saved")
        self._gate(step=loaded.step, problems=problems, now=now)
        if self.rank == 0:
            same_code = (m.versions.rankwatch, m.versions.torch, m.versions.python, m.versions.numpy) == (
                self._versions.rankwatch, self._versions.torch, self._versions.python, self._versions.numpy)
            now_inputs = self.determinism()
            changes = determinism_changes(m, now_inputs)
            verdict = comparability_of_resume(m.layout, self.layout, m.world_size, self.world_size,
                                              same_code=same_code,
                                              same_config=m.versions.config_sha256 == self._versions.config_sha256,
                                              determinism_changes=changes)
            record_resume(self.run_dir, attempt=self.attempt, resume_at=m.step + 1, checkpoint_id=m.checkpoint_id,
                          verdict=verdict, old_world_size=m.world_size, new_world_size=self.world_size,
                          old_layout=m.layout, new_layout=self.layout, determinism=inputs_json(now_inputs),
                          old_global_batch=m.global_batch, new_global_batch=self._global_batch)
        return loaded.step + 1

    def _choose(self, checkpoint_id: str | None) -> Any:
        """Rank 0: the plan, None when the run has no checkpoint candidates at all (or the recovery manager ordered a
        start from step 0), or the one-line refusal (also when the manager ordered a checkpoint and the newest usable
        one is another)."""
        if self._ordered == FROM_START:
            return None
        if not list_checkpoints(self.run_dir, verify=False):
            if checkpoint_id is not None:
                return f"asked to resume from {checkpoint_id}; the run has no checkpoint"
            return (None if self._ordered is None else
                    f"the recovery manager ordered a resume from {self._ordered}; the run has no checkpoint")
        try:
            chosen = plan(self.run_dir, layout=self.layout, checkpoint_id=checkpoint_id)
        except ValueError as exc:
            return str(exc)
        if self._ordered is not None and chosen.chosen.path.name != self._ordered:
            return (f"the recovery manager ordered a resume from {self._ordered}; the newest usable checkpoint is "
                    f"{chosen.chosen.path.name}: not resuming from either")
        return chosen

    def _sharded(self) -> bool:
        """Whether any parameter is a DTensor (FSDP2, tensor parallel): each rank then holds its own shards."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in self._model.parameters())

    def _fresh(self) -> int:
        """No checkpoint: step 0. When an earlier attempt had trained steps, they are trained again from the job's
        initial state, and the lineage says so: the restart (unless the recovery manager ordered it and recorded it)
        and, where the earlier attempt's events say its global batch, a world or batch that changed (the manager
        knows the world it relaunched on, only the job knows the batch it re-planned)."""
        if self.rank != 0:
            return 0
        if self._ordered == FROM_START:  # the manager's restart is in the lineage already
            before = (previous_batch_plan(self.run_dir, before_attempt=self.attempt)
                      if self._global_batch is not None else None)
            if before is not None and self._global_batch is not None:
                now = BatchPlan(attempt=self.attempt, global_batch=self._global_batch, world_size=self.world_size)
                reasons = ((ChangeReason.BATCH_COMPOSITION,) if now.global_batch != before.global_batch else ()) + (
                    (ChangeReason.ORDERING,) if now.world_size != before.world_size else ())
                record_batch_change(self.run_dir, before=before, after=now, verdict=LineageVerdict.changed(*reasons))
        else:
            previous = last_completed_step(self.run_dir, before_attempt=self.attempt)
            if previous is not None:
                before = previous_batch_plan(self.run_dir, before_attempt=self.attempt)
                old_world = before.world_size if before is not None else self.world_size
                verdict = comparability_of_resume(self.layout, self.layout, old_world, self.world_size,
                                                  same_code=True, same_config=True)
                record_resume(self.run_dir, attempt=self.attempt, resume_at=0, checkpoint_id=FROM_INITIALIZATION,
                              verdict=verdict, old_world_size=old_world, new_world_size=self.world_size,
                              old_layout=self.layout, new_layout=self.layout,
                              old_global_batch=before.global_batch if before is not None else None,
                              new_global_batch=self._global_batch)
                self._collector.event(EventKind.RECOVERY, message=(
                    f"no checkpoint committed: attempt {self.attempt} trains from step 0 again (an earlier attempt "
                    f"reached step {previous})"))
        return 0

    def _gate(self, *, step: int, problems: Sequence[str], now: Mapping[str, str | None]) -> tuple[GateOutcome, ...]:
        """The gate over every rank: each rank's own restore check, then the domains (module docstring)."""
        mine = (tuple(problems), self.members())
        reports: list[Any] = [None] * self.world_size
        dist.all_gather_object(reports, mine, group=self._group)
        bad = [(r, p) for r, rep in enumerate(reports) for p in rep[0]]
        if bad:
            text = "; ".join(f"rank {r}: {p}" for r, p in bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
            self._collector.event(EventKind.RECOVERY, message=f"consistency gate: restore check failed: {text}"[:1000])
            raise GateRefused(f"refusing to train: restore check failed: {text}"[:500])
        domains = self._domains([dranks for _, dranks in reports])
        outcomes = run_gate(self._state(step, now), domains=domains, group=self._group, world_size=self.world_size)
        for o in outcomes:
            if self.rank == min(o.ranks):
                self._collector.event(EventKind.RECOVERY, message=o.message()[:1000])
        refused = [o for o in outcomes if o.verdict is not GateVerdict.AGREE]
        if refused:
            raise GateRefused(f"refusing to train: {refused[0].message()}"[:500])
        return outcomes
