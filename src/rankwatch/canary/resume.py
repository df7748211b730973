"""The canary's resume: every rank calls `resume` at startup (collective over the world group) to choose, load, gate
and record the lineage of the checkpoint it trains on from.

Rank 0 chooses (`recovery.resume.plan`: the choice reads every byte, SHA-256, and all ranks must load the same
checkpoint) and broadcasts the candidate. Each rank loads it, then the consistency gate (`recovery.gate`) must AGREE
before training continues at checkpoint step + 1; otherwise every rank raises `GateRefused`. Rank 0 then appends
the lineage: RESTART, or ROLLBACK plus REPLAYED_DATA_RANGE when an earlier attempt had completed steps past the
checkpoint (`recovery.resume.last_completed_step`), plus WORLD_SIZE_CHANGE / LAYOUT_CHANGE when those changed.

Layouts: the same layout loads through `load_checkpoint`. A different data-parallel degree (same tp and pp) loads
too, because every dp replica of a (pp, tp) shard holds the full replicated model and optimizer state under one
DCP key: the new rank (dp, tp, pp) takes the RNG state of the old rank (dp mod old_dp, tp, pp) (in the canary
every rank's RNG is identical), and the data position is the job's global sample count, which the new dp degree
re-slices. The lineage marks such a resume CHANGED (batch composition, ordering). A tp or pp change is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rankwatch.base.rundir import read_launches
from rankwatch.base.schema import CheckpointPhase, EventKind, GroupKind
from rankwatch.base.topology import Layout, group_specs
from rankwatch.canary.parallel import RankGroups
from rankwatch.recovery.catalog import DCP_DIR, Candidate, Manifest, rank_shard_name
from rankwatch.recovery.checkpoint import LoadResult, current_versions, load_checkpoint, set_rng_state, shard_key
from rankwatch.recovery.decision import GateVerdict
from rankwatch.recovery.determinism import DeterminismInputs, determinism_of
from rankwatch.recovery.gate import ALL_FIELDS, WORLD_FIELDS, Domain, GateOutcome, rank_state, run_gate
from rankwatch.recovery.lineage import Verdict as Comparability, comparability_of_resume, inputs_json
from rankwatch.recovery.resume import GateRefused, Plan, plan, record_resume

if TYPE_CHECKING:
    from rankwatch.canary.config import CanaryConfig

__all__ = ["Resumed", "resume"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Resumed:
    plan: Plan
    load: LoadResult
    gate: tuple[GateOutcome, ...]
    """Every domain's outcome (all AGREE: otherwise `resume` raised)."""

    @property
    def next_step(self) -> int:
        return self.load.step + 1


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
    record_resume(Path(cfg.run_dir), attempt=cfg.attempt, resume_at=m.step + 1, checkpoint_id=m.checkpoint_id,
                  verdict=_comparability(cfg, m, changes), old_world_size=m.world_size, new_world_size=cfg.world_size,
                  old_layout=m.layout, new_layout=cfg.layout,
                  determinism=inputs_json(inputs) if inputs is not None else None)


def gate_domains(layout: Layout) -> list[Domain]:
    """The canary's consistency gate: the world on step and data position, each data-parallel group (the replicas of
    one (tp, pp) shard) on every field (`recovery.gate`'s module docstring). Its saves are judged by the same
    (`canary.loop`: `recovery.checkpointer.agreement_over`)."""
    domains = [Domain(name="world", ranks=tuple(range(layout.world_size)), fields=WORLD_FIELDS)]
    return domains + [Domain(name=name, ranks=tuple(ranks), fields=ALL_FIELDS)
                      for kind, name, ranks in group_specs(layout) if kind is GroupKind.DP]


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
    outcomes = run_gate(state, domains=gate_domains(cfg.layout), group=groups.world, world_size=world)
    for o in outcomes:
        if rank in o.ranks and (rank == 0 or o.domain != "world"):
            collector.event(EventKind.RECOVERY, message=o.message()[:1000])
    bad = [o for o in outcomes if o.verdict is not GateVerdict.AGREE]
    if bad:
        raise GateRefused(f"refusing to train: {bad[0].message()}"[:500])
    if rank == 0:
        _record_lineage(cfg, m)
    return Resumed(plan=chosen, load=loaded, gate=outcomes)
