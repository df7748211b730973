"""Ground truth of a simulated run: the incidents a perfect detector raises (`Label`) and the benign variation it
must stay quiet about (`Benign`), derived from a configuration by `labels_for`, written as ``labels.json`` and read
back by `read_labels`. Consistency incidents are blamed by the same majority rule the analysis uses.

A straggler's cause depends on the timing: under `Timing.GPU` a slower compute (`StragglerCause.NONE`) is a slow
device (`device_slow`) and a host stall is `host_stall`, which the device clock tells apart; under `Timing.CPU` both
are `unknown`, as neither clock nor counter says where the time went.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import numpy as np

from rankwatch.analytics.incidents import Cause, IncidentClass, SubjectKind
from rankwatch.base.rundir import LABELS_FILE
from rankwatch.base.schema import GroupKind
from rankwatch.base.topology import link_name
from rankwatch.collector.gpu import replay_uuid
from rankwatch.simulator.config import SimConfig, Timing
from rankwatch.simulator.faults import (
    Corruption, CorruptionKind, DataSkew, DivergeField, Divergence, FailHow, FailStop, Hang, HostDataloader,
    SlowHardware, SlowLink, StageImbalance, SteadyCounters, Straggler, StragglerCause, ThrottleBitOnly, _div_ranks,
)
from rankwatch.simulator.model import _Topo

LABELS_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Label:
    """One incident a perfect detector raises."""

    klass: IncidentClass
    subject_kind: SubjectKind
    subject: str
    ranks: tuple[int, ...]
    onset_step: int
    cause: Cause
    device_fault: bool = False
    """The fault is the device's hardware (a throttled GPU, a hardware ECC error); the subject is then the device."""


class BenignKind(StrEnum):
    CHECKPOINT_STALL = "checkpoint_stall"
    SLOW_HARDWARE = "slow_hardware"
    THROTTLE_BIT_ONLY = "throttle_bit_only"
    STEADY_COUNTERS = "steady_counters"


@dataclass(frozen=True, kw_only=True, slots=True)
class Benign:
    """Variation that must raise no incident."""

    kind: BenignKind
    ranks: tuple[int, ...]
    steps: tuple[int, ...] = ()
    """Steps it shows in (checkpoint steps); empty = all run long."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Labels:
    scenario: str
    ranks: int
    steps: int
    layout: str
    hosts: int
    expected: tuple[Label, ...]
    benign: tuple[Benign, ...]

    def to_json(self) -> str:
        doc = {
            "version": LABELS_VERSION, "scenario": self.scenario, "ranks": self.ranks, "steps": self.steps,
            "layout": self.layout, "hosts": self.hosts,
            "expected": [{"class": str(x.klass), "subject_kind": str(x.subject_kind), "subject": x.subject,
                          "ranks": list(x.ranks), "onset_step": x.onset_step, "cause": str(x.cause),
                          **({"device_fault": True, "device": x.subject} if x.device_fault else {})}
                         for x in self.expected],
            "benign": [{"kind": str(b.kind), "ranks": list(b.ranks), "steps": list(b.steps)} for b in self.benign],
        }
        return json.dumps(doc, indent=1)


def read_labels(path: Path | str) -> Labels:
    """Read labels.json (a run directory or the file itself); a malformed file is a one-line ValueError."""
    p = Path(path)
    if p.is_dir():
        p = p / LABELS_FILE
    try:
        doc = json.loads(p.read_text())
        return Labels(
            scenario=str(doc["scenario"]), ranks=int(doc["ranks"]), steps=int(doc["steps"]),
            layout=str(doc["layout"]), hosts=int(doc["hosts"]),
            expected=tuple(
                Label(klass=IncidentClass(x["class"]), subject_kind=SubjectKind(x["subject_kind"]),
                      subject=str(x["subject"]), ranks=tuple(int(r) for r in x["ranks"]),
                      onset_step=int(x["onset_step"]), cause=Cause(x["cause"]),
                      device_fault=bool(x.get("device_fault", False)))
                for x in doc["expected"]
            ),
            benign=tuple(
                Benign(kind=BenignKind(b["kind"]), ranks=tuple(int(r) for r in b["ranks"]),
                       steps=tuple(int(s) for s in b.get("steps", ())))
                for b in doc["benign"]
            ),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{p}: not a valid labels file ({type(exc).__name__}: {exc})") from None


def _first_fp(cfg: SimConfig, step: int) -> int:
    fps = sorted(set(range(0, cfg.steps, cfg.fingerprint_every)) | {cfg.steps - 1})
    return next((s for s in fps if s >= step), step)


def _consistency_labels(cfg: SimConfig, topo: _Topo, bad: Sequence[int], klass: IncidentClass, cause: Cause,
                        onset: int) -> list[Label]:
    """Blame by the majority rule: a minority only when a strict majority of >= 3 members agrees."""
    by_domain: dict[int, list[int]] = {}
    for r in bad:
        by_domain.setdefault(int(topo.gid[GroupKind.DP][r]), []).append(int(r))
    size = cfg.layout.dp
    blameable = all(size - len(m) >= 3 and size - len(m) > size / 2 for m in by_domain.values())
    lab = lambda kind, subject, ranks: Label(  # noqa: E731
        klass=klass, subject_kind=kind, subject=subject, ranks=tuple(sorted(ranks)), onset_step=onset, cause=cause)
    if blameable:
        if len(bad) == 1:
            return [lab(SubjectKind.RANK, str(bad[0]), bad)]
        dps = {int(topo.dp[r]) for r in bad}
        if len(dps) == 1 and len(by_domain) > 1:
            return [lab(SubjectKind.REPLICA, f"dp={dps.pop()}", bad)]
        return [lab(SubjectKind.RANK, str(r), (r,)) for r in sorted(bad)]
    n_domains = cfg.layout.tp * cfg.layout.pp
    splits = {frozenset(int(topo.dp[r]) for r in m) for m in by_domain.values()}
    if len(by_domain) == n_domains and len(splits) == 1 and n_domains > 1:
        return [lab(SubjectKind.JOB, "job", range(topo.n))]
    return [lab(SubjectKind.DOMAIN, topo.infos[d].name, topo.infos[d].ranks) for d in sorted(by_domain)]


def labels_for(cfg: SimConfig, skewed: Sequence[int] = ()) -> Labels:
    """The ground truth of a configuration (data-skew ranks come from the simulation's draws)."""
    topo = _Topo(cfg)
    lay = cfg.layout
    out: list[Label] = []
    benign: list[Benign] = []
    gpu = cfg.timing is Timing.GPU
    straggler_cause = {StragglerCause.NONE: Cause.DEVICE_SLOW if gpu else Cause.UNKNOWN,
                       StragglerCause.THERMAL: Cause.THERMAL_THROTTLE, StragglerCause.POWER: Cause.POWER_THROTTLE,
                       StragglerCause.DATALOADER: Cause.DATALOADER,
                       StragglerCause.HOST_STALL: Cause.HOST_STALL if gpu else Cause.UNKNOWN}
    fail_cause = {FailHow.EXIT: Cause.EXIT, FailHow.SIGNAL: Cause.SIGNAL, FailHow.VANISHED: Cause.VANISHED,
                  FailHow.KILLED_ALL: Cause.VANISHED}
    div_cause = {DivergeField.RNG: Cause.RNG_MISMATCH, DivergeField.DATA: Cause.DATA_POSITION_MISMATCH,
                 DivergeField.STEP: Cause.STEP_MISMATCH}
    def device(rank: int) -> str:
        return replay_uuid(f"host{int(topo.host[rank])}", int(topo.local[rank]))

    def on_device(label: Label) -> Label:
        """A hardware fault of the rank's GPU: the device is the subject (direct evidence in its counters)."""
        if label.subject_kind is not SubjectKind.RANK:
            return label
        return replace(label, subject_kind=SubjectKind.DEVICE, subject=device(label.ranks[0]), device_fault=True)

    for f in cfg.faults:
        if isinstance(f, Straggler):
            lab = Label(klass=IncidentClass.STRAGGLER, subject_kind=SubjectKind.RANK, subject=str(f.rank),
                        ranks=(f.rank,), onset_step=f.from_step, cause=straggler_cause[f.cause])
            out.append(on_device(lab) if f.cause in (StragglerCause.THERMAL, StragglerCause.POWER) else lab)
        elif isinstance(f, HostDataloader):
            out.append(Label(klass=IncidentClass.STRAGGLER, subject_kind=SubjectKind.HOST, subject=f"host{f.host}",
                             ranks=topo.host_ranks(f.host), onset_step=f.from_step, cause=Cause.DATALOADER))
        elif isinstance(f, SlowLink):
            link = link_name(f"host{f.host_a}", f"host{f.host_b}")
            crossing = sorted({r for g in topo.infos if g.kind is not GroupKind.WORLD and link in g.links
                               for r in g.ranks})
            out.append(Label(klass=IncidentClass.STRAGGLER, subject_kind=SubjectKind.LINK, subject=link,
                             ranks=tuple(crossing), onset_step=f.from_step, cause=Cause.SLOW_LINK))
        elif isinstance(f, StageImbalance):
            ranks = tuple(int(r) for r in np.flatnonzero(topo.pp == f.stage))
            out.append(Label(klass=IncidentClass.IMBALANCE, subject_kind=SubjectKind.STAGE, subject=f"pp={f.stage}",
                             ranks=ranks, onset_step=f.from_step, cause=Cause.STAGE_IMBALANCE))
        elif isinstance(f, DataSkew):
            out.append(Label(klass=IncidentClass.IMBALANCE, subject_kind=SubjectKind.JOB, subject="job",
                             ranks=tuple(sorted(skewed)), onset_step=f.from_step, cause=Cause.DATA_SKEW))
        elif isinstance(f, FailStop):
            out.append(Label(klass=IncidentClass.FAIL_STOP, subject_kind=SubjectKind.RANK, subject=str(f.rank),
                             ranks=(f.rank,), onset_step=f.step, cause=fail_cause[f.how]))
        elif isinstance(f, Hang):
            out.append(Label(klass=IncidentClass.HANG, subject_kind=SubjectKind.RANK, subject=str(f.rank),
                             ranks=(f.rank,), onset_step=f.step, cause=Cause.STUCK_IN_STEP))
        elif isinstance(f, Divergence):
            out += _consistency_labels(cfg, topo, _div_ranks(f, lay), IncidentClass.DIVERGENCE, div_cause[f.field],
                                       _first_fp(cfg, f.step))
        elif isinstance(f, Corruption):
            if f.kind is CorruptionKind.BITFLIP_PARAM:
                cause = Cause.HARDWARE_ERROR if f.hardware else Cause.VALUE_MISMATCH
                labs = _consistency_labels(cfg, topo, (f.rank,), IncidentClass.CORRUPTION, cause,
                                           _first_fp(cfg, f.step))
                out += [on_device(x) for x in labs] if f.hardware else labs
            else:
                cause = Cause.NON_FINITE if f.kind is CorruptionKind.NAN else Cause.GRAD_NORM_OUTLIER
                lab = Label(klass=IncidentClass.CORRUPTION, subject_kind=SubjectKind.RANK, subject=str(f.rank),
                            ranks=(f.rank,), onset_step=f.step, cause=Cause.HARDWARE_ERROR if f.hardware else cause)
                out.append(on_device(lab) if f.hardware else lab)
        elif isinstance(f, SlowHardware):
            benign.append(Benign(kind=BenignKind.SLOW_HARDWARE, ranks=(f.rank,)))
        elif isinstance(f, ThrottleBitOnly):
            benign.append(Benign(kind=BenignKind.THROTTLE_BIT_ONLY, ranks=(f.rank,)))
        elif isinstance(f, SteadyCounters):
            benign.append(Benign(kind=BenignKind.STEADY_COUNTERS, ranks=(f.rank,)))
    if cfg.checkpoint_every:
        steps = tuple(range(cfg.checkpoint_every - 1, cfg.steps, cfg.checkpoint_every))
        if steps:
            benign.append(Benign(kind=BenignKind.CHECKPOINT_STALL, ranks=tuple(range(topo.n)), steps=steps))
    return Labels(scenario=cfg.name, ranks=topo.n, steps=cfg.steps, layout=str(lay), hosts=cfg.hosts,
                  expected=tuple(out), benign=tuple(benign))
