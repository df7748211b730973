"""Resume a run from its newest usable checkpoint: choose, load, gate, record the lineage.

Every rank calls `resume` at startup (collective over the world group). Rank 0 chooses, because the choice reads
every byte (SHA-256) and all ranks must load the same checkpoint; it broadcasts the candidate. Each rank loads it,
then the consistency gate (`trainer.gate`) must AGREE before training continues at checkpoint step + 1; otherwise
every rank raises `GateRefused`. Rank 0 then appends the lineage: RESTART, or ROLLBACK plus REPLAYED_DATA_RANGE
when an earlier attempt had completed steps past the checkpoint (read from the steps telemetry's part files, the
one record of completed steps that survives a crash), plus WORLD_SIZE_CHANGE / LAYOUT_CHANGE when those changed.

Layouts: the same layout loads through `load_checkpoint`. A different data-parallel degree (same tp and pp) loads
too, because every dp replica of a (pp, tp) shard holds the full replicated model and optimizer state under one
DCP key: the new rank (dp, tp, pp) takes the RNG state of the old rank (dp mod old_dp, tp, pp) (in the canary
every rank's RNG is identical), and the data position is the job's global sample count, which the new dp degree
re-slices. The lineage marks such a resume CHANGED (batch composition, ordering). A tp or pp change is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rankwatch.collector.schema import CheckpointPhase, EventKind, GroupKind, Steps, Table
from rankwatch.collector.sink import partition_dir
from rankwatch.trainer.catalog import CHECKPOINT_DIR, DCP_DIR, Candidate, Manifest, Verdict, list_checkpoints, rank_shard_name
from rankwatch.trainer.checkpoint import LoadResult, current_versions, load_checkpoint, set_rng_state, shard_key
from rankwatch.trainer.gate import ALL_FIELDS, WORLD_FIELDS, Domain, GateOutcome, GateVerdict, rank_state, run_gate
from rankwatch.trainer.determinism import DeterminismInputs
from rankwatch.trainer.lineage import (Details, EntryKind, Lineage, NewEntry, check_lineage, comparability_of_resume,
                                       inputs_json, lineage_path)
from rankwatch.trainer.lineage import Verdict as Comparability
from rankwatch.trainer.parallel import Layout, RankGroups, group_specs
from rankwatch.trainer.runfile import RUN_FILE, determinism_of, read_launches

if TYPE_CHECKING:
    from rankwatch.trainer.canary import CanaryConfig

log = logging.getLogger("rankwatch.trainer")

__all__ = ["GateRefused", "Plan", "Resumed", "last_completed_step", "loadable", "plan", "preflight", "resume"]


class GateRefused(RuntimeError):
    """The consistency gate did not AGREE: training must not resume."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    chosen: Candidate
    """Newest committed, SHA-256-verified checkpoint this layout can load."""
    rejected: tuple[Candidate, ...]
    """Newer candidates passed over, newest first, each with its reason."""
    requested: bool = False
    """The checkpoint was named by the caller (a rollback target), not the newest usable one."""

    def describe(self) -> str:
        m = self.chosen.manifest
        saved = f" (saved by {m.layout})" if m is not None else ""
        which = "the requested" if self.requested else "newest"
        text = f"resume from {self.chosen.checkpoint_id}{saved}: {which} committed, verified, loadable checkpoint"
        if self.rejected:
            text += "; rejected newer: " + "; ".join(f"{c.path.name}: {c.verdict} ({c.reason})" for c in self.rejected)
        return text


@dataclass(frozen=True, kw_only=True, slots=True)
class Resumed:
    plan: Plan
    load: LoadResult
    gate: tuple[GateOutcome, ...]
    """Every domain's outcome (all AGREE: otherwise `resume` raised)."""

    @property
    def next_step(self) -> int:
        return self.load.step + 1


def loadable(saved: Layout, job: Layout) -> str | None:
    """None when a job with layout `job` can load a checkpoint saved by `saved`; else why not (one line)."""
    if (saved.tp, saved.pp) != (job.tp, job.pp):
        return f"layout incompatible: saved by {saved}, job is {job}; only the dp degree may change on resume"
    return None


def plan(run_dir: Path, *, layout: Layout, checkpoint_id: str | None = None) -> Plan:
    """Choose like `catalog.choose`, but also accept a changed dp degree; ValueError naming every rejection when
    nothing is usable. With `checkpoint_id`, that checkpoint or a ValueError saying why it cannot be used (newer
    candidates are then passed over as "not the requested checkpoint")."""
    chosen: Candidate | None = None
    rejected: list[Candidate] = []
    candidates = list_checkpoints(run_dir, verify=True)
    if checkpoint_id is not None:
        wanted = [c for c in candidates if c.path.name == checkpoint_id]
        if not wanted:
            raise ValueError(f"{Path(run_dir) / 'checkpoints'}: no checkpoint {checkpoint_id} to resume from")
        candidates = tuple(wanted)
    for c in candidates:
        if c.usable and c.manifest is not None and (why := loadable(c.manifest.layout, layout)) is not None:
            c = dataclasses.replace(c, verdict=Verdict.INCOMPATIBLE, reason=why)
        if c.usable:
            chosen = c
            break
        rejected.append(c)
    if chosen is None:
        if not rejected:
            raise ValueError(f"{Path(run_dir) / 'checkpoints'}: no checkpoint to resume from")
        raise ValueError(f"{Path(run_dir) / 'checkpoints'}: no usable checkpoint: "
                         + "; ".join(f"{c.path.name}: {c.verdict} ({c.reason})" for c in rejected))
    return Plan(chosen=chosen, rejected=tuple(rejected), requested=checkpoint_id is not None)


def last_completed_step(run_dir: Path, *, before_attempt: int) -> int | None:
    """The highest step any rank completed in attempts before `before_attempt`, from the steps part files. A part
    that cannot be read, or whose columns are not integers, is skipped with a warning naming it: it is evidence of
    what was trained, not something a resume from an intact checkpoint must stop on."""
    root = partition_dir(run_dir, Table.STEPS, 0).parent
    best: int | None = None
    for part in sorted(root.glob("*/part-*.parquet")):
        try:
            t = pq.read_table(part, columns=[str(Steps.STEP), str(Steps.ATTEMPT)])
        except Exception as exc:  # cut short, not parquet, columns missing: the part is damaged
            log.warning("rankwatch resume: %s: unreadable steps part left out of the replay range (%s)", part,
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        if not all(pa.types.is_integer(t.schema.field(c).type) for c in (str(Steps.STEP), str(Steps.ATTEMPT))):
            log.warning("rankwatch resume: %s: steps part with non-integer step/attempt left out", part)
            continue
        d = t.to_pydict()
        steps = [s for s, a in zip(d[str(Steps.STEP)], d[str(Steps.ATTEMPT)])
                 if s is not None and a is not None and a < before_attempt]
        if steps:
            best = max(steps) if best is None else max(best, *steps)
    return best


def preflight(run_dir: Path) -> None:
    """What `train --resume` checks before it launches anything (so a bad run directory gets a one-line
    ValueError and nothing is created or appended): the run directory exists and is a directory, its run file is
    well formed, its lineage verifies (a tampered lineage is never appended to), and it has a checkpoints folder."""
    run = Path(run_dir)
    if not run.exists():
        raise ValueError(f"{run}: no such run directory (--resume never creates a run)")
    if not run.is_dir():
        raise ValueError(f"{run}: not a directory")
    if not read_launches(run):
        raise ValueError(f"{run / RUN_FILE}: records no launch")
    check_lineage(lineage_path(run), consequence="refusing to resume a run whose lineage was tampered with")
    if not (run / CHECKPOINT_DIR).is_dir():
        raise ValueError(f"{run / CHECKPOINT_DIR}: no checkpoints folder — nothing to resume from")


def _load_other_dp(collector: Any, c: Candidate, *, rank: int, layout: Layout, group: Any, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> LoadResult:
    m = c.manifest
    assert m is not None
    dp, tp, pp = layout.coords(rank)
    source = m.layout.rank_of(dp=dp % m.layout.dp, tp=tp, pp=pp)
    key = shard_key(layout, rank)  # the dp replicas of a shard share it, so any dp size reads the same key
    with collector.checkpoint_phase(m.step, m.checkpoint_id, CheckpointPhase.LOAD):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        tensors: dict[str, dict[str, Any]] = {key: {"model": model_sd, "optim": optim_sd}}
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(c.path / DCP_DIR), process_group=group)
        set_state_dict(model, optimizer, model_state_dict=tensors[key]["model"], optim_state_dict=tensors[key]["optim"])
        state = torch.load(c.path / rank_shard_name(source), weights_only=True)
        if state["rank"] != source or state["step"] != m.step:
            raise ValueError(f"checkpoint {c.path}: {rank_shard_name(source)} holds rank {state['rank']} step "
                             f"{state['step']}, expected rank {source} step {m.step}")
        set_rng_state(state["rng"])
    return LoadResult(checkpoint_id=m.checkpoint_id, step=m.step, data_position=int(state["data_position"]),
                      lr_scheduler=state["lr_scheduler"], grad_scaler=state["grad_scaler"], versions=m.versions)


def _determinism_changes(cfg: CanaryConfig) -> tuple[tuple[str, ...], DeterminismInputs | None]:
    """What changed in the determinism inputs since the previous launch that recorded them, and this launch's."""
    launches = read_launches(Path(cfg.run_dir))
    now = determinism_of(Path(cfg.run_dir), launches[cfg.attempt]) if cfg.attempt < len(launches) else None
    if now is None:
        return (), None
    for launch in reversed(launches[:cfg.attempt]):
        before = determinism_of(Path(cfg.run_dir), launch)
        if before is not None:
            return before.changes(now), now
    return (), now


def _comparability(cfg: CanaryConfig, m: Manifest, determinism: tuple[str, ...] = ()) -> Comparability:
    now = current_versions(cfg)
    old = m.versions
    same_code = (old.rankwatch, old.torch, old.python, old.numpy) == (now.rankwatch, now.torch, now.python, now.numpy)
    try:  # the config hash covers the layout: compare it with the old layout put back, so a dp change is not "config"
        same_config = current_versions(dataclasses.replace(cfg, layout=m.layout, faults=type(cfg.faults)())).config_sha256 \
            == old.config_sha256
    except ValueError:
        same_config = False
    return comparability_of_resume(m.layout, cfg.layout, m.world_size, cfg.world_size, same_code=same_code,
                                   same_config=same_config, determinism_changes=determinism)


def _record_lineage(cfg: CanaryConfig, m: Manifest) -> None:
    changes, inputs = _determinism_changes(cfg)
    verdict = _comparability(cfg, m, changes)
    recorded = inputs_json(inputs) if inputs is not None else None
    resume_at = m.step + 1
    previous = last_completed_step(cfg.run_dir, before_attempt=cfg.attempt)
    book = Lineage(lineage_path(Path(cfg.run_dir)))
    if previous is not None and previous >= resume_at:
        book.append(NewEntry(kind=EntryKind.ROLLBACK, verdict=verdict, details=Details(
            from_step=previous, to_step=resume_at, checkpoint_id=m.checkpoint_id, determinism=recorded,
            attempt=cfg.attempt, text=f"attempt {cfg.attempt} rolls back from step {previous} to {m.checkpoint_id}")))
        book.append(NewEntry(kind=EntryKind.REPLAYED_DATA_RANGE, verdict=verdict, details=Details(
            from_step=resume_at, to_step=previous + 1, checkpoint_id=m.checkpoint_id, attempt=cfg.attempt,
            text=f"attempt {cfg.attempt} trains steps {resume_at}..{previous} again")))
    else:
        book.append(NewEntry(kind=EntryKind.RESTART, verdict=verdict, details=Details(
            from_step=previous, to_step=resume_at, checkpoint_id=m.checkpoint_id, determinism=recorded,
            attempt=cfg.attempt, text=f"attempt {cfg.attempt} restarts from {m.checkpoint_id}")))
    if m.world_size != cfg.world_size:
        book.append(NewEntry(kind=EntryKind.WORLD_SIZE_CHANGE, verdict=verdict, details=Details(
            old_world_size=m.world_size, new_world_size=cfg.world_size, checkpoint_id=m.checkpoint_id,
            attempt=cfg.attempt)))
    if m.layout != cfg.layout:
        book.append(NewEntry(kind=EntryKind.LAYOUT_CHANGE, verdict=verdict, details=Details(
            old_layout=str(m.layout), new_layout=str(cfg.layout), checkpoint_id=m.checkpoint_id,
            attempt=cfg.attempt)))


def resume(collector: Any, cfg: CanaryConfig, *, rank: int, groups: RankGroups, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer) -> Resumed:
    """Collective over the world group: choose (rank 0), load, gate, record lineage (rank 0). The caller sets its
    loader to `load.data_position` and trains from `next_step`. Raises ValueError when there is nothing usable,
    `GateRefused` when the gate does not AGREE (on every rank alike)."""
    world = cfg.world_size
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = plan(cfg.run_dir, layout=cfg.layout, checkpoint_id=cfg.resume_from)
        except ValueError as exc:
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0, group=groups.world)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    chosen: Plan = box[0]
    m = chosen.chosen.manifest
    assert m is not None
    if rank == 0:
        print(f"rankwatch train: {chosen.describe()}", flush=True)
        collector.event(EventKind.RECOVERY, message=chosen.describe()[:1000])
    if m.layout == cfg.layout:
        loaded = load_checkpoint(collector, chosen.chosen, rank=rank, layout=cfg.layout, group=groups.world,
                                 model=model, optimizer=optimizer)
    else:
        loaded = _load_other_dp(collector, chosen.chosen, rank=rank, layout=cfg.layout, group=groups.world,
                                model=model, optimizer=optimizer)
    state = rank_state(rank=rank, step=loaded.step, data_position=loaded.data_position, model=model,
                       optimizer=optimizer)
    domains = [Domain(name="world", ranks=tuple(range(world)), fields=WORLD_FIELDS)]
    domains += [Domain(name=name, ranks=tuple(ranks), fields=ALL_FIELDS)
                for kind, name, ranks in group_specs(cfg.layout) if kind is GroupKind.DP]
    outcomes = run_gate(state, domains=domains, group=groups.world, world_size=world)
    for o in outcomes:
        if rank in o.ranks and (rank == 0 or o.domain != "world"):
            collector.event(EventKind.RECOVERY, message=o.message()[:1000])
    bad = [o for o in outcomes if o.verdict is not GateVerdict.AGREE]
    if bad:
        raise GateRefused(f"refusing to train: {bad[0].message()}"[:500])
    if rank == 0:
        _record_lineage(cfg, m)
    return Resumed(plan=chosen, load=loaded, gate=outcomes)
