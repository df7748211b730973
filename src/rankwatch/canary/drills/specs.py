"""What each drill injects into the canary and what it expects to see: the drill specs (`DRILLS`) and the canary
they run on (`drill_config`)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from rankwatch.analytics.incidents import IncidentClass
from rankwatch.base.topology import Layout
from rankwatch.canary.config import CanaryConfig
from rankwatch.canary.faults import Faults
from rankwatch.canary.model import ModelConfig
from rankwatch.recovery.checkpoint import CHECKPOINT_FAULT_ENV
from rankwatch.recovery.decision import Action


STEPS = 50
"""Steps of every drill's canary (and of the reference run)."""


VICTIM = 1
"""The rank a fail-stop or hang drill takes down."""


FAULT_AFTER = 22
"""The fault comes once the victim completed this step (after the step-20 checkpoint)."""


PACE_S = 0.15
"""Added to every rank's step (CanaryConfig.pace_s; numerics untouched): ~0.2 s a step instead of ~0.07 s, so a fault
detected from part files (a second or two) lands mid-run and the checkpoint before it is still kept."""


_SMALL = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2)


class Tamper(StrEnum):
    """An edit of a committed checkpoint on disk, from outside the job (as a bad disk or a careless hand would)."""

    MANIFEST = "manifest"
    """manifest.json cut in half: the checkpoint's description unreadable."""
    SHARD = "shard"
    """One byte of the victim's per-rank state file flipped in place: its SHA-256 no longer the manifest's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillSpec:
    name: str
    what: str
    classes: tuple[IncidentClass, ...]
    """The classes the monitor may detect it as (the first is the usual one)."""
    rank: int
    """The rank it must name."""
    relaunch: bool
    """True: the decision must relaunch (a new attempt resumed from a checkpoint); False: no restart, one attempt."""
    faults: Faults = field(default_factory=Faults)
    """Injected inside the job (the canary's fault injection); empty when the drill acts from outside."""
    signal: int | None = None
    """Sent to the rank's pid from outside once it completed `after` steps."""
    after: int = FAULT_AFTER
    """The victim step after which the outside action comes (the signal, after `tamper`)."""
    tamper: Tamper | None = None
    """Edited on disk, in the newest committed checkpoint, just before the signal."""
    env: tuple[tuple[str, str], ...] = ()
    """The job's environment beside the drill's own (e.g. recovery.checkpoint's save fault), every attempt."""
    fault_step: int | None = None
    """An in-job fault's step (its instant: when the victim completed it); None: FAULT_AFTER."""
    resume_from: str | None = None
    """The checkpoint the relaunch must resume from (the newest one a sound recovery may use); None: any."""
    actions: tuple[Action, ...] = ()
    """The decisions that pass (empty: any relaunching one when `relaunch`, observe when not)."""
    device: bool = False
    """The subject is the rank's device (`device:<uuid>`, a device fault), not the rank."""
    slots_per_host: int = 0
    """Device slots per virtual host (CanaryConfig.slots_per_host; 0: one per rank): spares to place a relaunch on."""
    cut: bool = False
    """Once the victim completed `after` steps, reset every TCP connection of its process from outside (`ss -K`,
    as a partition's peers see it): its process group's transport torn down while the process lives."""
    recurs: int = 0
    """Times the fault comes back on a relaunch (a fault of the machine, met by whichever rank is placed on it) before
    localization across the attempts quarantines it: that many more recoveries, the second one moving the ranks to
    other devices (`RecoveryPlan.reshuffle`), the last one quarantining the device; the final attempt is placed off
    it."""
    then_kill: int | None = None
    """Once the decision about the fault is done (a quarantine), SIGKILL this rank from outside: the relaunch that
    follows must be placed off what was quarantined."""


_LATE = 32
"""The step after which the checkpoint drills act: past the step-29 checkpoint, whose save they spoil."""


_SAVE_FAULT = f"enospc:rank={VICTIM},step=29,at=shard"
"""recovery.checkpoint's save fault: the step-29 save of the victim's shard fails as a full disk would."""


_GOOD = "step-00000019"
"""The newest checkpoint left intact when the step-29 one is spoiled."""


def _state_fault(name: str, what: str, klass: IncidentClass, faults: Faults) -> DrillSpec:
    """An in-job fault of rank VICTIM's state at step FAULT_AFTER + 1: rolled back to the checkpoint before it."""
    return DrillSpec(name=name, what=what, classes=(klass,), rank=VICTIM, relaunch=True, faults=faults,
                     fault_step=FAULT_AFTER + 1, resume_from=_GOOD)


def _killed_after(name: str, what: str, *, tamper: Tamper | None = None,
                  env: tuple[tuple[str, str], ...] = ()) -> DrillSpec:
    """The step-29 checkpoint spoiled (on disk, or its save failed), then rank VICTIM SIGKILLed past it: the
    recovery must resume from the one before."""
    return DrillSpec(name=name, what=f"{what}, then SIGKILL of rank {VICTIM}", classes=(IncidentClass.FAIL_STOP,),
                     rank=VICTIM, relaunch=True, signal=signal.SIGKILL, after=_LATE, tamper=tamper, env=env,
                     resume_from=_GOOD)


DRILLS: dict[str, DrillSpec] = {
    "sigkill": DrillSpec(name="sigkill", what=f"SIGKILL of rank {VICTIM}", classes=(IncidentClass.FAIL_STOP,),
                         rank=VICTIM, relaunch=True, signal=signal.SIGKILL),
    "exit": DrillSpec(name="exit", what=f"os._exit(1) in rank {VICTIM} at step {FAULT_AFTER + 1}",
                      classes=(IncidentClass.FAIL_STOP,), rank=VICTIM, relaunch=True,
                      faults=Faults().exit(rank=VICTIM, step=FAULT_AFTER + 1, code=1)),
    # a SIGSTOPped process stops its liveness thread too: without an exit record it reads as a rank gone silent
    # (a fail-stop, "stopped"); a hang proper (heartbeats on, no progress) is the `hang` drill
    "sigstop": DrillSpec(name="sigstop", what=f"SIGSTOP of rank {VICTIM}",
                         classes=(IncidentClass.FAIL_STOP, IncidentClass.HANG), rank=VICTIM, relaunch=True,
                         signal=signal.SIGSTOP),
    "straggler": DrillSpec(name="straggler", what=f"rank 2 80 ms slower a step from step {FAULT_AFTER}",
                           classes=(IncidentClass.STRAGGLER,), rank=2, relaunch=False,
                           faults=Faults().slow(rank=2, from_step=FAULT_AFTER, delay_s=0.08)),
    "hang": DrillSpec(name="hang", what=f"rank {VICTIM} stuck in step {FAULT_AFTER + 1} (heartbeats on)",
                      classes=(IncidentClass.HANG,), rank=VICTIM, relaunch=True,
                      faults=Faults().hang(rank=VICTIM, step=FAULT_AFTER + 1)),
    "bitflip": _state_fault("bitflip", f"bit 30 of a gradient element flipped on rank {VICTIM} at step "
                                       f"{FAULT_AFTER + 1}, before the all-reduce", IncidentClass.CORRUPTION,
                            Faults().bitflip(rank=VICTIM, step=FAULT_AFTER + 1)),
    "skew_rng": _state_fault("skew_rng", f"rank {VICTIM} draws one extra random number at step {FAULT_AFTER + 1}",
                             IncidentClass.DIVERGENCE, Faults().skew_rng(rank=VICTIM, step=FAULT_AFTER + 1)),
    "skew_data": _state_fault("skew_data", f"rank {VICTIM}'s data position one sample ahead from step "
                                           f"{FAULT_AFTER + 1}", IncidentClass.DIVERGENCE,
                              Faults().skew_data(rank=VICTIM, step=FAULT_AFTER + 1)),
    "throttle": DrillSpec(name="throttle", what=f"rank 2's GPU thermal-throttled (+80 ms a step) from step "
                                                f"{FAULT_AFTER}",
                          classes=(IncidentClass.STRAGGLER,), rank=2, relaunch=False,
                          faults=Faults().throttle(rank=2, from_step=FAULT_AFTER, delay_s=0.08),
                          actions=(Action.OBSERVE, Action.QUARANTINE), device=True),
    "corrupt_manifest": _killed_after("corrupt_manifest", "the step-29 checkpoint's manifest cut in half on disk",
                                      tamper=Tamper.MANIFEST),
    "corrupt_shard": _killed_after("corrupt_shard", f"one byte of rank {VICTIM}'s step-29 shard flipped on disk",
                                   tamper=Tamper.SHARD),
    "bad_device": DrillSpec(name="bad_device", what=f"the GPU in slot 1 of host 0 (rank {VICTIM}'s) throttles, +80 ms "
                                                    f"a step, from step {FAULT_AFTER}; once it is quarantined, SIGKILL "
                                                    f"of rank 0",
                            classes=(IncidentClass.STRAGGLER,), rank=VICTIM, relaunch=True, device=True,
                            faults=Faults().bad_device(host=0, index=1, from_step=FAULT_AFTER, delay_s=0.08),
                            actions=(Action.QUARANTINE,), slots_per_host=3, then_kill=0),
    "partition": DrillSpec(name="partition", what=f"every TCP connection of rank {VICTIM} reset from outside (ss -K): "
                                                  f"its process group's transport torn down, the process alive",
                           classes=(IncidentClass.FAIL_STOP,), rank=VICTIM, relaunch=True, cut=True),
    "failing_device": DrillSpec(
        name="failing_device", what=f"the GPU in slot 1 of host 0 raises a device error (no XID, healthy counters) at "
                                    f"step {FAULT_AFTER + 1} under whichever rank is placed on it, every attempt",
        classes=(IncidentClass.FAIL_STOP,), rank=VICTIM, relaunch=True, slots_per_host=3, recurs=2,
        faults=Faults().failing_device(host=0, index=1, step=FAULT_AFTER + 1)),
    "full_storage": _killed_after("full_storage", f"ENOSPC in rank {VICTIM}'s step-29 save (every attempt)",
                                  env=((CHECKPOINT_FAULT_ENV, _SAVE_FAULT),)),
}


def drill_config(run_dir: Path, faults: Faults | None = None, *, slots_per_host: int = 0) -> CanaryConfig:
    """The drills' canary: 4 gloo ranks (dp=4 over 2 virtual hosts), small model paced to ~0.2 s a step, liveness
    every 0.25 s, part files every 0.5 s, a checkpoint every 10 steps, fingerprints every 10, a 30 s collective
    timeout."""
    return CanaryConfig(run_dir=run_dir, steps=STEPS, layout=Layout.parse("dp=4", nproc=4), hosts=2,
                        faults=faults or Faults(), gpu="replay", pg_timeout_s=30.0, flush_interval_s=0.5,
                        heartbeat_interval_s=0.25, gpu_interval_s=0.1, model=_SMALL, checkpoint_every=10,
                        fingerprint_every=10, pace_s=PACE_S, slots_per_host=slots_per_host)
