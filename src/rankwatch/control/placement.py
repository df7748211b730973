"""Where the job's ranks run after a recovery: off the run's quarantine list, on fewer ranks where the job declared
that membership change, or rotated over their devices so a recurring fault tells device from rank. Every rank that
changes device is recorded in lineage (DEVICE_REPLACED, CHANGED: hardware). The recovery manager (`control.manager`)
calls these before each relaunch; the service (`control.service`) before each attempt.

    quarantined(run)                the quarantine list
    place_off_quarantine(run, cfg)  the job placed off it (or on fewer ranks, where declared)
    continue_on(cfg, n)             can the job go on with n ranks, and on what conditions
    reshuffled(run, cfg, suspects)  the ranks rotated so that another rank number holds each suspect device
    placed_topology(run, topo)      each rank's device as the launcher placed it, where its collector named none
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import polars as pl

from rankwatch.base.rundir import QuarantineEntry, read_launches, read_quarantine
from rankwatch.base.schema import ChangeReason, LineageKind
from rankwatch.recovery.decision import MembershipSupport, TargetKind
from rankwatch.recovery.job import Job
from rankwatch.recovery.lineage import Details, Lineage, NewEntry, Verdict as LineageVerdict, lineage_path

__all__ = ["continue_on", "place_off_quarantine", "placed_topology", "quarantined", "reshuffled"]

J = TypeVar("J", bound=Job)


def placed_topology(run_dir: Path, topo: pl.DataFrame) -> pl.DataFrame:
    """`topo` (`attempt_topology`) with each rank's device where its collector named none (no NVML: a CPU run, a
    driver that did not answer) taken from the launch record of its attempt: the device the launcher placed it on
    (`CommandJob.placement`: its UUID where known, else the device's name in the visibility list it was given), so
    a fault that follows a device can be told from one that follows a rank on any machine. Unchanged where the run
    records no placement."""
    launches = read_launches(run_dir, missing_ok=True)
    rows = [(n, int(r), str(p[2])) for n, rec in enumerate(launches) if isinstance(rec.get("placement"), dict)
            for r, p in rec["placement"].items() if isinstance(p, list) and len(p) == 3 and p[2]]
    if not rows or topo.height == 0:
        return topo
    placed = pl.DataFrame(rows, schema={"attempt": topo.schema["attempt"], "rank": topo.schema["rank"],
                                        "_placed": pl.String}, orient="row")
    return topo.join(placed, on=["attempt", "rank"], how="left").with_columns(
        pl.coalesce("device_uuid", "_placed").alias("device_uuid")).drop("_placed")



def quarantined(run_dir: Path) -> tuple[QuarantineEntry, ...]:
    """The run's quarantine list (<run>/quarantine.json): every device, host or link taken out of placement."""
    return read_quarantine(run_dir)



def place_off_quarantine(run_dir: Path, cfg: J, *, say: Callable[[str], None] = lambda _: None) -> J:
    """`cfg` placed off every device and host on the run's quarantine list (the job's `placed_off`); each
    quarantined device a rank leaves is recorded in lineage as replaced (CHANGED: hardware; another device is not
    assumed bitwise alike), and each move said. `cfg` itself when it uses nothing quarantined (so calling this on a
    placed config records nothing again). ValueError naming what is left when nothing is."""
    entries = quarantined(run_dir)
    devices = {e.id for e in entries if e.kind == str(TargetKind.DEVICE)}
    hosts = {e.id for e in entries if e.kind == str(TargetKind.HOST)}
    if not devices and not hosts:
        return cfg
    try:
        placed, moves = cfg.placed_off(devices=devices, hosts=hosts)
    except ValueError as exc:  # too little left for the whole world: fewer ranks only where the job declared it
        return _shrunk(cfg, devices=devices, hosts=hosts, why=str(exc), say=say)
    if not moves:
        return cfg
    for line in moves:
        say(f"placement off the quarantine list: {line}")
    before = cfg.placement()
    _record_moves(run_dir, cfg, placed, lambda rank, uuid: uuid in devices or before[rank][0] in hosts,
                  lambda rank, uuid: f"rank {rank} placed off quarantined {uuid}: " + "; ".join(moves))
    return placed


def continue_on(cfg: Job, world_size: int) -> tuple[bool, tuple[str, ...]]:
    """Can the job go on with `world_size` ranks instead of its `cfg.world_size` ("can we continue on 2,047
    GPUs?"): (yes or no, the conditions or the reasons, one line each). Only the membership change the job declared
    is taken: a pure data-parallel job with a reconfigurable batch may run on fewer replicas (its own `resized` says
    whether that many fit its batch); fixed shapes may not; a spare replaces a rank 1:1 and changes no world size."""
    have, decl = cfg.world_size, cfg.declaration()
    head = f"the job declares membership {decl.membership}"
    if world_size == have:
        return True, (f"the world is unchanged ({have} ranks): a relaunch on them, placed off the quarantine list",)
    if world_size > have or world_size < 1:
        return False, (f"{world_size} ranks: only a smaller world than the job's {have} is a membership change here",)
    if decl.membership is MembershipSupport.FIXED_SHAPES:
        return False, (f"{head}: its group shapes (FSDP / TP / PP, or a job that has not said) cannot change",
                       f"it goes on only on its full world of {have} ranks: a full restart once {have} devices can "
                       "be placed off the quarantine list")
    if decl.membership is MembershipSupport.SPARE_REPLACEMENT:
        return False, (f"{head}: a spare takes a lost rank's place 1:1, the world stays {have} ranks",
                       f"without a spare it goes on only after {have} devices can be placed")
    try:
        smaller = cfg.resized(world_size)
    except ValueError as exc:
        return False, (f"{head}, but it cannot run on {world_size} ranks: {exc}",)
    return True, (
        f"{head}: yes, on {world_size} of {have} ranks (layout {cfg.layout} -> {smaller.layout}), if",
        "  - it resumes from a committed, verified checkpoint (saved by any dp degree of the same tp and pp), behind "
        f"the consistency gate on the {world_size} ranks",
        f"  - the job re-plans its data over {smaller.layout.dp} replicas (its global batch or per-rank work changes)",
        f"  - the trajectory is CHANGED (batch composition, reduction order): lineage records world {have} -> "
        f"{world_size}; nothing after it is compared bitwise with the run before",
    )


def _shrunk(cfg: J, *, devices: set[str], hosts: set[str], why: str, say: Callable[[str], None]) -> J:
    """`cfg` resized to the largest world below its own that can be placed off the quarantine list, when the job
    declared that membership change (`continue_on`); ValueError with `why` and the job's answer otherwise."""
    for world in range(cfg.world_size - 1, 0, -1):
        ok, lines = continue_on(cfg, world)
        if not ok:
            if cfg.declaration().membership is not MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH:
                raise ValueError(f"{why}; no smaller world either: {lines[0]}")
            continue
        try:
            placed, _ = cfg.resized(world).placed_off(devices=devices, hosts=hosts)
        except ValueError:
            continue
        say(f"membership: {why}; {lines[0]}")
        for line in lines[1:]:
            say(f"membership: {line}")
        return placed
    raise ValueError(f"{why}; no smaller world can be placed either")


def _record_moves(run_dir: Path, before_cfg: Job, after_cfg: Job, which: Callable[[int, str], bool],
                  text: Callable[[int, str], str]) -> None:
    """A DEVICE_REPLACED lineage entry (CHANGED: hardware) for each rank `which` picks by (rank, old device) that
    runs elsewhere after: on another device, or on another host. A device is its UUID, or ``host:slot`` where the
    placement names none (a job on a host list)."""
    before, after = before_cfg.placement(), after_cfg.placement()
    book = Lineage(lineage_path(run_dir))

    def name(p: tuple[str, int, str]) -> str:
        return p[2] or f"{p[0]}:{p[1]}"

    for rank, place in before.items():
        old, new = name(place), name(after[rank])
        if which(rank, old) and new != old:
            book.append(NewEntry(kind=LineageKind.DEVICE_REPLACED, verdict=LineageVerdict.changed(
                ChangeReason.HARDWARE, note="another physical device; bitwise identity is not assumed"),
                details=Details(old_device=old, new_device=new, text=text(rank, old))))


def reshuffled(run_dir: Path, cfg: J, suspects: Sequence[str], *, say: Callable[[str], None] = lambda _: None) -> J:
    """`cfg` with the ranks rotated over their hosts' device slots (the job's `rotations`, nearest first) so that
    every suspect device (UUID) holds another rank number than now, and no rank is on a quarantined device: the next
    occurrence of a fault that recurred on one device under one rank number then tells device from rank. Every rank
    that changes device is recorded in lineage (DEVICE_REPLACED). `cfg` itself, said, when no rotation does."""
    bad = {e.id for e in quarantined(run_dir) if e.kind == str(TargetKind.DEVICE)}
    holder = {u: r for r, (_, _, u) in cfg.placement().items()}
    for k, moved in enumerate(cfg.rotations(), 1):
        there = {u: r for r, (_, _, u) in moved.placement().items()}
        if set(there) & bad or any(d in holder and there.get(d, holder[d]) == holder[d] for d in suspects):
            continue
        why = (f"rotated by {k} device slot(s): {', '.join(suspects)} recurred under one rank number; another rank "
               f"number on it tells device from rank")
        say(f"placement: {why}")
        _record_moves(run_dir, cfg, moved, lambda rank, uuid: True, lambda rank, uuid: f"rank {rank} moved off {uuid}: {why}")
        return moved
    say(f"placement: no rotation of the device slots puts another rank on {', '.join(suspects)} clear of the "
        f"quarantine list; placed as before")
    return cfg
