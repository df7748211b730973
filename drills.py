"""Fault drills: the whole live loop on a real canary, one fault at a time, timed and checked end to end.

    run_drill("sigkill", workdir, say=print) -> DrillReport
    run_drills(["sigkill", "sigstop"], workdir, say=print) -> tuple[DrillReport, ...]

Each drill starts the recovery manager as a service (trainer.service.ManagerService on 127.0.0.1, port 0, a fresh
webhook secret), which launches a small fast canary (4 gloo ranks, dp=4 over 2 virtual hosts, checkpoints every 10
steps, fingerprints every 10); a `Monitor` (rankwatch.monitor) watches the run in a thread and sends its incidents
and decisions to the service as signed webhooks. Then the drill injects one fault — from outside the job where it
can (a signal to the rank's pid, which the service learned from the launcher) — and waits until the job finished,
checking the chain: the detection (class and subject), the decision the service accepted (action, scope), the
recovery record (<run>/recovery/*.json, its gate), the resume, and the final verdict: the recovered run's last
fingerprints bitwise equal to those of a fault-free reference run of the same config (run once per workdir and
cached there), or the lineage's reasons why not (trainer.promises.evaluate).

Drills (DRILLS, in priority order):
    sigkill     SIGKILL of rank 1 (a fail-stop): detected by the liveness records, the job restarted from a checkpoint
    exit        rank 1 calls os._exit(1) inside the job (trainer.faults Exit; no outside signal can make a process
                exit with a code of its choosing): a fail-stop, as above
    sigstop     SIGSTOP of rank 1: its liveness thread stops too, so it reads as a rank gone silent (a fail-stop;
                a hang is accepted as well); the service stops the job at once, not after the collective timeout
    straggler   rank 2 sleeps 80 ms more per step (trainer.faults Slow): a straggler; the decision is observe, no
                restart, the job finishes
    hang        rank 1's training thread stops in a step while its process (and heartbeat) lives (trainer.faults
                Hang): a hang; the job stopped at once and restarted
    bitflip     bit 30 of one gradient element flipped on rank 1 before the all-reduce (trainer.faults BitFlip): every
                replica takes the bad update and they still agree; silent corruption, seen in rank 1's local gradient
                norm; rolled back to the checkpoint before the flip (step 19)
    skew_rng    rank 1 draws one extra random number (SkewRng): divergence at the next fingerprint; rolled back to
                step 19, not to the step-29 checkpoint saved between the skew and the fingerprint that showed it
    skew_data   rank 1's data position jumps one sample (SkewData): divergence, as skew_rng
    throttle    rank 2's (replayed) GPU reports a thermal throttle and computes 80 ms longer a step (Throttle): a
                straggler caused by the device; observed (or the device quarantined), no restart
    corrupt_manifest, corrupt_shard
                past the step-29 checkpoint, its manifest is cut in half / one byte of rank 1's state file flipped on
                disk (from outside), then rank 1 is SIGKILLed: the recovery must pass over the damaged checkpoint
                (integrity-checked: CORRUPT) and resume from step 19
    partition   every TCP connection of rank 1's process destroyed from outside (`ss -K`): its process group's
                transport torn down, the process alive; every rank's collective fails at once, rank 1's with its own
                end aborted, its peers' with a reset: fail_stop rank:1 (cause network), restarted
    failing_device
                the (replayed) GPU in slot 1 of host 0 raises a device error at step 23 under whichever rank sits on
                it, in every attempt, its counters healthy: fail_stop rank:1 and a restart; the same again (one rank
                on one device: inconclusive), so the relaunch rotates the ranks over the slots; then rank 0 fails
                on it, the fault follows the device across the attempts (analytics.localize), it is quarantined and
                the last relaunch placed off it
    full_storage
                the step-29 save of rank 1's shard fails with ENOSPC (trainer.checkpoint's save fault, through the
                job's environment, every attempt): nothing is published, training goes on; then rank 1 is SIGKILLed
                and the recovery resumes from step 19, never from the failed save's partial

The canary is paced (CanaryConfig.pace_s) to ~0.2 s a step so that a fault seen from part files is acted on mid-run.
A recovery that undoes a state fault relaunches with a replay basis (the step the fault may have begun at), so the
replayed steps are not compared with the corrupted ones (analytics.replay).

Times are seconds after the fault: to detect (the monitor's first incident naming the subject, on the monitor's
clock), to decision (the service accepted a decision about it), to training again (the first step the new attempt
completed, from its steps). The fault's instant is the signal for sigkill/sigstop and the checkpoint drills, the exit
record's wall clock for exit, the monitor's first sight of the stuck rank's last step for hang, and the monitor's
first sight of the faulty step completed for straggler, throttle, bitflip and the skews.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.analytics.incidents import Incident, IncidentClass, SubjectKind
from rankwatch.analytics.recovery import Action
from rankwatch.monitor import Monitor
from rankwatch.trainer.canary import CanaryConfig
from rankwatch.trainer.checkpoint import CHECKPOINT_FAULT_ENV
from rankwatch.trainer.faults import Faults
from rankwatch.trainer.model import ModelConfig
from rankwatch.trainer.parallel import Layout

__all__ = ["DRILLS", "DrillReport", "DrillSpec", "Tamper", "drill_config", "read_report", "reference_fingerprints",
           "report_json", "report_table", "run_drill", "run_drills", "write_report"]

STEPS = 50
"""Steps of every drill's canary (and of the reference run)."""
VICTIM = 1
"""The rank a fail-stop or hang drill takes down."""
FAULT_AFTER = 22
"""The fault comes once the victim completed this step (after the step-20 checkpoint)."""
PACE_S = 0.15
"""Added to every rank's step (CanaryConfig.pace_s; numerics untouched): ~0.2 s a step instead of ~0.07 s, so a fault
detected from part files (a second or two) lands mid-run and the checkpoint before it is still kept."""
REPORT_FILE = "report.json"
REFERENCE_DIR = "reference"
REFERENCE_FILE = "reference.json"
_FP_FIELDS = ("param_hash", "optim_hash", "rng_python_hash", "rng_numpy_hash", "rng_torch_hash", "data_position")
_SMALL = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2)
_LAUNCH_KW: Mapping[str, Any] = {"timeout_s": 240.0, "failure_grace_s": 60.0, "term_grace_s": 2.0}
"""A long failure grace (and the canary's 30 s collective timeout): only the service's stop ends an attempt fast."""


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
    """The job's environment beside the drill's own (e.g. trainer.checkpoint's save fault), every attempt."""
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
"""trainer.checkpoint's save fault: the step-29 save of the victim's shard fails as a full disk would."""
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


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillReport:
    """One drill's chain, timed. Times are seconds after the fault; None where the step did not happen."""

    name: str
    fault: str
    """What was injected."""
    passed: bool
    reason: str
    """PASS: what held; FAIL: the first link of the chain that broke."""
    detected: str | None = None
    """"<class> <subject>" of the monitor's first incident naming the subject."""
    detect_s: float | None = None
    decision: str | None = None
    """"<action> (<scope>)" of the decision the service accepted."""
    decision_s: float | None = None
    recovery: str | None = None
    """"<recovery id>: <outcome>" of the recovery record; None for a drill that must not restart."""
    gate: str | None = None
    """The gate on the decision's path (e.g. "gate=none")."""
    resume_from: str | None = None
    """The checkpoint the new attempt resumed from."""
    stopped_s: float | None = None
    """Until the fault's attempt was over (every rank gone; the service stops it on the decision), as polled."""
    training_again_s: float | None = None
    steps_lost: int | None = None
    """Steps the fault's attempt completed that the new attempt trained again."""
    attempts: int = 0
    bitwise: bool | None = None
    """The final fingerprints equal the reference run's (None: not compared)."""
    run_dir: str = ""

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> DrillReport:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in names})


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


_COLUMNS = ("drill", "detected", "detect_s", "decision", "decision_s", "stopped_s", "training_again_s", "steps_lost",
            "verdict")


def _row(r: DrillReport) -> tuple[str, ...]:
    return (r.name, r.detected or "-", _num(r.detect_s), r.decision or "-", _num(r.decision_s), _num(r.stopped_s),
            _num(r.training_again_s), "-" if r.steps_lost is None else str(r.steps_lost),
            f"{r.verdict}: {r.reason}")


def report_table(reports: Sequence[DrillReport]) -> str:
    """One fixed-width row per drill under a header; the verdict column (last) carries the reason."""
    rows = [_COLUMNS, *(_row(r) for r in reports)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_COLUMNS) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows)


def report_json(reports: Sequence[DrillReport]) -> dict[str, Any]:
    return {"schema": 1, "passed": all(r.passed for r in reports) and bool(reports),
            "drills": [r.to_dict() for r in reports]}


def write_report(path: Path, reports: Sequence[DrillReport]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report_json(reports), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_report(path: Path) -> tuple[DrillReport, ...]:
    """A report.json back. ValueError naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
        return tuple(DrillReport.from_dict(d) for d in doc["drills"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a drill report ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------------------------------------------- the canary


def drill_config(run_dir: Path, faults: Faults | None = None, *, slots_per_host: int = 0) -> CanaryConfig:
    """The drills' canary: 4 gloo ranks (dp=4 over 2 virtual hosts), small model paced to ~0.2 s a step, liveness
    every 0.25 s, part files every 0.5 s, a checkpoint every 10 steps, fingerprints every 10, a 30 s collective
    timeout."""
    return CanaryConfig(run_dir=run_dir, steps=STEPS, layout=Layout.parse("dp=4", nproc=4), hosts=2,
                        faults=faults or Faults(), gpu="replay", pg_timeout_s=30.0, flush_interval_s=0.5,
                        heartbeat_interval_s=0.25, gpu_interval_s=0.1, model=_SMALL, checkpoint_every=10,
                        fingerprint_every=10, pace_s=PACE_S, slots_per_host=slots_per_host)


def _final_fingerprints(run_dir: Path) -> dict[str, Any]:
    """{"step": the last fingerprinted step, "ranks": {rank: {field: value}}} (the latest row of each rank)."""
    from rankwatch.analytics.queries import fingerprints
    from rankwatch.analytics.store import connect

    fp = fingerprints(connect(run_dir))
    if fp.height == 0:
        raise ValueError(f"{run_dir}: no fingerprints")
    last = int(fp["step"].max())  # type: ignore[arg-type]
    rows = fp.filter(fp["step"] == last).to_dicts()
    return {"step": last, "ranks": {str(r["rank"]): {k: r.get(k) for k in _FP_FIELDS} for r in rows}}


def reference_fingerprints(workdir: Path, *, say: Callable[[str], None]) -> dict[str, Any]:
    """The fault-free reference run's final fingerprints: run once per workdir (<workdir>/reference), then read
    from <workdir>/reference.json."""
    from rankwatch.trainer.launch import launch

    cache = workdir / REFERENCE_FILE
    if cache.is_file():
        try:
            doc: dict[str, Any] = json.loads(cache.read_text())
            if doc.get("steps") == STEPS:
                return doc
        except ValueError:
            pass
    run_dir = workdir / REFERENCE_DIR
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    say(f"reference: a fault-free run of the drill config ({STEPS} steps) in {run_dir}")
    t0 = time.monotonic()
    result = launch(drill_config(run_dir), timeout_s=240.0, term_grace_s=2.0)
    if not result.ok:
        raise RuntimeError(f"{run_dir}: the reference run failed (exit codes {list(result.exit_codes)})")
    doc = {"steps": STEPS, **_final_fingerprints(run_dir)}
    cache.write_text(json.dumps(doc, indent=2) + "\n")
    say(f"reference: done in {time.monotonic() - t0:.1f}s, final fingerprints at step {doc['step']}")
    return doc


# ------------------------------------------------------------------------------------------------- one drill


class _Clock:
    """The fault's instant on both clocks."""

    def __init__(self) -> None:
        self.mono: float | None = None
        self.wall_ns: int | None = None

    def mark(self, wall_ns: int | None = None) -> None:
        now_wall, now_mono = time.time_ns(), time.monotonic()
        self.wall_ns = now_wall if wall_ns is None else wall_ns
        self.mono = now_mono - (now_wall - self.wall_ns) / 1e9

    def since_wall(self, wall_ns: int | None) -> float | None:
        return None if wall_ns is None or self.wall_ns is None else (wall_ns - self.wall_ns) / 1e9


def _wait(pred: Callable[[], bool], timeout_s: float, what: str,
          failed: Sequence[BaseException] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if failed:
            raise RuntimeError(f"the monitor failed while waiting for {what}: {failed[0]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.02)


def _steps(run_dir: Path) -> list[tuple[int, int, int, int]]:
    """(attempt, min step, max step, first end wall ns) per attempt."""
    from rankwatch.analytics.store import connect

    return [tuple(int(x) for x in r) for r in connect(run_dir).execute(  # type: ignore[misc]
        "SELECT attempt, min(step), max(step), min(end_wall_ns) FROM steps GROUP BY attempt ORDER BY attempt"
    ).fetchall()]


def _kill_once_quarantined(rank: int, manager: Any, monitor: Monitor, clock: _Clock, run_dir: Path,
                           failed: Sequence[BaseException], *, say: Callable[[str], None], name: str) -> None:
    """Wait until the quarantine decision is done and the list names something, SIGKILL `rank`, and wait for the
    monitor to see it; the clock restarts at the kill (stopped and training-again times count from it)."""
    from rankwatch.trainer.manager import quarantined

    _wait(lambda: bool(quarantined(run_dir)) and (manager.status()["last_decision"] or {}).get("state") == "done",
          60, "the quarantine applied", failed)
    listed = ", ".join(f"{e['kind']}:{e['id']}" for e in quarantined(run_dir))
    pid = int(manager.status()["job"]["pids"][rank])
    os.kill(pid, signal.SIGKILL)
    clock.mark()
    say(f"drill {name}: quarantined {listed}; sent SIGKILL to rank {rank} (pid {pid})")
    _wait(lambda: any(s.incident.klass is IncidentClass.FAIL_STOP and str(s.incident.subject) == f"rank:{rank}"
                      and s.at >= clock.mono - 0.5 for s in list(monitor.seen)),  # type: ignore[operator]
          60, f"fail_stop rank:{rank} detected", failed)


def _off_quarantine(run_dir: Path, attempt: int) -> str | None:
    """None when no rank of `attempt` sat on a quarantined device, else which did."""
    from rankwatch.analytics.store import connect
    from rankwatch.trainer.manager import quarantined

    bad = {str(e["id"]) for e in quarantined(run_dir) if e.get("kind") == "device"}
    rows = connect(run_dir).execute(
        f"SELECT rank, device_uuid FROM topology WHERE attempt = {int(attempt)} ORDER BY rank").fetchall()
    on = [f"rank {r} on {u}" for r, u in rows if u in bad]
    return "; ".join(on) if on else None


def _save_failed(run_dir: Path) -> bool:
    """A save of attempt 0 committed nothing (its `checkpoint_failed` events)."""
    from rankwatch.analytics.store import connect

    return bool(connect(run_dir).execute(
        "SELECT count(*) FROM events WHERE kind = 'checkpoint_failed' AND attempt = 0").fetchall()[0][0])


def _lineage_why(run_dir: Path) -> str:
    from rankwatch.trainer.promises import evaluate

    try:
        v = evaluate(run_dir)
    except ValueError as exc:
        return f"lineage unreadable: {exc}"
    return f"lineage: {v.comparability}" + (f" ({', '.join(map(str, v.reasons))})" if v.reasons else "")


def _decision_messages(monitor: Monitor) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for body in monitor.sent_bodies():
        doc = json.loads(body)
        if doc.get("type") == "decision" and doc.get("rankwatch", {}).get("decision"):
            out.append(doc["rankwatch"])
    return out


def run_drill(name: str, workdir: Path, *, say: Callable[[str], None] = print,
              reference: Mapping[str, Any] | None = None, folder: str | None = None) -> DrillReport:
    """Run one drill (see the module docstring) in <workdir>/<folder or name> (replaced), against the cached
    reference run. ValueError for an unknown drill name."""
    from rankwatch.analytics.alerts import write_secret
    from rankwatch.trainer.service import ManagerService

    spec = DRILLS.get(name)
    if spec is None:
        raise ValueError(f"unknown drill {name!r} (drills: {', '.join(DRILLS)})")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ref = reference if reference is not None else reference_fingerprints(workdir, say=say)
    base = workdir / (folder or name)
    if base.exists():
        import shutil

        shutil.rmtree(base)
    base.mkdir()
    run_dir = base / "run"
    secret_file = base / "webhook.secret"
    secret = write_secret(secret_file)
    cfg = drill_config(run_dir, spec.faults, slots_per_host=spec.slots_per_host)
    clock = _Clock()
    stop = threading.Event()
    lines: list[str] = []

    def note(msg: str) -> None:
        lines.append(msg)

    partial: dict[str, Any] = {"name": name, "fault": spec.what, "run_dir": str(run_dir)}
    say(f"drill {name}: {spec.what}; canary {cfg.world_size} ranks, {STEPS} steps in {run_dir}")
    with _environ(spec.env), ManagerService(run_dir, secret=secret, job=cfg, launch_kw=_LAUNCH_KW) as svc:
        watcher: threading.Thread | None = None
        try:
            # the monitor starts on a run that has begun recording (before, its part-file side has nothing to read)
            _wait(lambda: svc.manager.status()["job"]["state"] == "running" and (run_dir / "telemetry").is_dir(),
                  90, "the job running")
            monitor = Monitor(run_dir, window=20, every=1.0, poll=0.1, webhook=f"{svc.url}/alerts",
                              secret_file=secret_file, say=note, warn=note)
            failed: list[BaseException] = []

            def watch() -> None:
                try:
                    monitor.run(stop=stop)
                except BaseException as exc:  # noqa: BLE001 - reported as the drill's failure
                    failed.append(exc)
                    note(f"monitor failed: {type(exc).__name__}: {exc}")

            watcher = threading.Thread(target=watch, name="rankwatch-drill-monitor", daemon=True)
            watcher.start()
            report = _drive(spec, svc, monitor, clock, run_dir, ref, partial, say, failed)
        except (TimeoutError, RuntimeError, ValueError) as exc:
            report = DrillReport(**partial, passed=False, reason=f"{type(exc).__name__}: {exc}")
        finally:
            stop.set()
            if watcher is not None:
                watcher.join(30.0)
    (base / "monitor.log").write_text("\n".join(lines) + "\n")
    say(f"drill {name}: {report.verdict}: {report.reason}")
    return report


@contextmanager
def _environ(pairs: Sequence[tuple[str, str]]) -> Iterator[None]:
    """os.environ with `pairs` set (the ranks are spawned: they inherit it), restored after."""
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tamper(run_dir: Path, how: Tamper, rank: int) -> str:
    """Spoil the newest committed checkpoint on disk; one line saying what was done. RuntimeError when there is
    none to spoil."""
    from rankwatch.trainer.catalog import CHECKPOINT_DIR, MANIFEST

    found = sorted(p for p in (run_dir / CHECKPOINT_DIR).glob("step-*") if (p / MANIFEST).is_file())
    if not found:
        raise RuntimeError(f"{run_dir / CHECKPOINT_DIR}: no committed checkpoint to tamper with")
    ckpt = found[-1]
    if how is Tamper.MANIFEST:
        path = ckpt / MANIFEST
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return f"cut {path} from {len(data)} to {len(data) // 2} bytes"
    shards = sorted(ckpt.glob(f"rank-{rank:05d}*"))
    if not shards:
        raise RuntimeError(f"{ckpt}: no per-rank state file of rank {rank}")
    path = shards[0]
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return f"flipped the byte at offset {path.stat().st_size // 2} of {path}"


def _tcp_connections(pid: int) -> list[tuple[str, str]]:
    """(local "addr:port", remote "addr:port") of every established IPv4 TCP connection of process `pid` (its
    socket inodes in /proc/<pid>/fd matched against /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])

    def addr(hexed: str) -> str:
        ip, port = hexed.split(":")
        return ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"

    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) > 9 and f[9] in inodes and f[3] == "01":  # 01: ESTABLISHED
            out.append((addr(f[1]), addr(f[2])))
    return out


def _cut_connections(pid: int) -> str:
    """Destroy every established TCP connection of `pid` (iproute2's `ss -K`, the kernel's sock_destroy): the
    process sees its sockets aborted, its peers a reset. "<n> connection(s)"; RuntimeError when there is none or
    `ss` cannot (no iproute2, a kernel without INET_DIAG_DESTROY, no CAP_NET_ADMIN)."""
    import shutil
    import subprocess

    ss = shutil.which("ss")
    if ss is None:
        raise RuntimeError("the partition drill needs `ss` (iproute2: apt-get install -y iproute2)")
    conns = _tcp_connections(pid)
    if not conns:
        raise RuntimeError(f"pid {pid}: no established TCP connection to cut")
    for local, remote in conns:
        subprocess.run([ss, "-K", "src", local, "dst", remote], capture_output=True, text=True, timeout=10, check=False)
    left = set(_tcp_connections(pid)) & set(conns)
    if left:
        raise RuntimeError(f"pid {pid}: `ss -K` did not destroy {len(left)} of its {len(conns)} connection(s) (a "
                           f"kernel without CONFIG_INET_DIAG_DESTROY, or no CAP_NET_ADMIN)")
    return f"{len(conns)} TCP connection(s)"


def _exit_wall_ns(run_dir: Path, rank: int) -> int | None:
    """The wall clock of the launcher's exit record of `rank` (live/exit-<r>.json), None before it exists."""
    from rankwatch.analytics.liveness import parse_exit_record

    try:
        return parse_exit_record(json.loads((run_dir / "live" / f"exit-{rank}.json").read_text())).wall_ns
    except (OSError, ValueError):
        return None


def _step_end_wall_ns(monitor: Monitor, rank: int) -> int | None:
    """When the monitor first saw `rank`'s last progress (its latest completed step), on the wall clock."""
    view = monitor.view
    r = None if view is None else view.rank(rank)
    return None if view is None or r is None or r.idle_ns is None else view.now_ns - r.idle_ns


def _victim_step(monitor: Monitor, rank: int) -> int | None:
    view = monitor.view
    r = None if view is None else view.rank(rank)
    return None if r is None else r.last_step


def _drive(spec: DrillSpec, svc: Any, monitor: Monitor, clock: _Clock, run_dir: Path, ref: Mapping[str, Any],
           partial: dict[str, Any], say: Callable[[str], None], failed: list[BaseException]) -> DrillReport:
    manager = svc.manager
    first = spec.after if spec.signal is not None or spec.cut else FAULT_AFTER - 2
    _wait(lambda: (_victim_step(monitor, spec.rank) or -1) >= first, 120, f"rank {spec.rank} at step {first}", failed)
    if spec.signal is not None:
        if spec.tamper is not None:
            say(f"drill {spec.name}: {_tamper(run_dir, spec.tamper, spec.rank)}")
        pid = int(manager.status()["job"]["pids"][spec.rank])
        os.kill(pid, spec.signal)
        clock.mark()
        say(f"drill {spec.name}: sent {signal.Signals(spec.signal).name} to rank {spec.rank} (pid {pid}) after step "
            f"{_victim_step(monitor, spec.rank)}")
    elif spec.cut:
        pid = int(manager.status()["job"]["pids"][spec.rank])
        cut = _cut_connections(pid)
        clock.mark()
        say(f"drill {spec.name}: reset {cut} of rank {spec.rank} (pid {pid}) after step "
            f"{_victim_step(monitor, spec.rank)}")
    elif spec.classes[0] is IncidentClass.HANG:  # in-job hang: its instant is the last step the rank completed
        _wait(lambda: (_victim_step(monitor, spec.rank) or -1) >= FAULT_AFTER, 60, f"rank {spec.rank} stuck", failed)
        clock.mark(_step_end_wall_ns(monitor, spec.rank))
        say(f"drill {spec.name}: rank {spec.rank} stuck after step {FAULT_AFTER}")
    elif spec.classes[0] is IncidentClass.FAIL_STOP:  # in-job exit or error: its instant is the launcher's exit record
        _wait(lambda: _exit_wall_ns(run_dir, spec.rank) is not None, 60, f"rank {spec.rank}'s exit record", failed)
        clock.mark(_exit_wall_ns(run_dir, spec.rank))
        say(f"drill {spec.name}: rank {spec.rank} exited")
    else:  # a slow, throttle, flip or skew fault: its instant is when the monitor saw the rank complete its step
        at = FAULT_AFTER if spec.fault_step is None else spec.fault_step
        _wait(lambda: (_victim_step(monitor, spec.rank) or -1) >= at, 60, f"rank {spec.rank} past step {at}", failed)
        clock.mark()
        say(f"drill {spec.name}: rank {spec.rank} completed step {at} with the fault")
    assert clock.mono is not None
    subject = f"rank:{spec.rank}"

    def named(inc: Incident) -> bool:
        if spec.device:
            return inc.subject.kind is SubjectKind.DEVICE and spec.rank in inc.ranks
        return str(inc.subject) == subject

    def detection() -> Any:
        return next((s for s in list(monitor.seen) if s.incident.klass in spec.classes and named(s.incident)
                     and s.at >= clock.mono - 0.5), None)  # type: ignore[operator]

    wanted = f"rank {spec.rank}'s device" if spec.device else subject
    _wait(lambda: detection() is not None, 60, f"{'/'.join(spec.classes)} {wanted} detected", failed)
    seen = detection()
    subject = str(seen.incident.subject)
    partial.update(detected=f"{seen.incident.klass} {subject}", detect_s=round(seen.at - clock.mono, 3))
    say(f"drill {spec.name}: detected {seen.incident.klass} {subject} after {partial['detect_s']:.2f}s "
        f"({seen.source})")

    def decided() -> dict[str, Any] | None:
        for d in manager.db.summary()["decisions"]:
            if d["incident"] == seen.incident.id or (spec.relaunch and d["action"] != "observe"):
                return dict(d)
        return None

    _wait(lambda: decided() is not None, 60, "a decision accepted by the service", failed)
    dec = decided()
    assert dec is not None
    scope = next((m.get("scope") for m in _decision_messages(monitor) if m.get("decision_id") == dec["decision_id"]),
                 None)
    partial.update(decision=f"{dec['action']} ({scope or '-'})", decision_s=clock.since_wall(dec["received_ns"]))
    say(f"drill {spec.name}: decision {partial['decision']} accepted after {_num(partial['decision_s'])}s")
    if spec.then_kill is not None:
        _kill_once_quarantined(spec.then_kill, manager, monitor, clock, run_dir, failed, say=say, name=spec.name)

    ended: list[int] = []

    def over() -> bool:
        st = manager.status()
        if not ended and st["attempts"] and st["attempts"][0]["exit_codes"] is not None:
            ended.append(time.time_ns())  # the fault's attempt is over (every rank gone): the job stopped
        # a fault that recurs fails attempts on the way: only the job's end counts
        # and a relaunching drill ends relaunched: the decision about a kill may not have reached the service yet when
        # the one before it (bad_device's quarantine) is done and the killed attempt already over
        decision = (st["last_decision"] or {}).get("state")
        return st["job"]["state"] in (("finished",) if spec.recurs else ("finished", "failed")) and (
            not spec.relaunch or decision == "failed" or decision == "done" and len(st["attempts"]) >= 2 + spec.recurs)

    _wait(over, 240 + 150 * spec.recurs, "the job finished", failed)
    if spec.relaunch and ended:
        partial["stopped_s"] = clock.since_wall(ended[0])
    time.sleep(0.5)
    status = manager.status()
    attempts = status["attempts"]
    partial["attempts"] = len(attempts)
    steps = _steps(run_dir)
    recs = sorted((run_dir / "recovery").glob("recovery-*.json"))
    rec: dict[str, Any] | None = json.loads(recs[0].read_text()) if recs else None
    ours: list[dict[str, Any]] = []
    if spec.relaunch:
        if rec is not None:
            partial["recovery"] = f"{rec['id']}: {rec['outcome']}"
            ours = [d for d in rec["decisions"] if d["class"] in spec.classes and d["subject"] == subject]
            gate = next((p for d in ours for p in d["path"] if str(p).startswith("gate")), None)
            partial["gate"] = gate
        if len(attempts) >= 2:
            partial["resume_from"] = attempts[-1]["resume_from"]
        if len(steps) >= 2:
            partial["training_again_s"] = clock.since_wall(steps[-1][3])
            partial["steps_lost"] = max(0, steps[0][2] + 1 - steps[-1][1])
    else:
        partial["steps_lost"] = 0
    if partial.get("training_again_s") is not None:
        say(f"drill {spec.name}: stopped after {_num(partial.get('stopped_s'))}s, training again after "
            f"{partial['training_again_s']:.2f}s ({partial['steps_lost']} step(s) lost)")

    def fail(why: str) -> DrillReport:
        return DrillReport(**partial, passed=False, reason=why)

    if status["job"]["state"] != "finished":
        return fail(f"the job ended {status['job']['state']}")
    if spec.relaunch:
        if not dec["action"] or dec["action"] == "observe":
            return fail(f"the decision was {dec['action']}, not a relaunch")
        expected = 2 if spec.then_kill is not None else 1 + spec.recurs  # (the quarantine's record, then the relaunch's)
        if len(recs) > expected:
            return fail(f"{len(recs)} recoveries for {expected} fault(s): " + "; ".join(
                f"{r['id']} ({', '.join(d['class'] + ' ' + d['subject'] for d in r['decisions'])}: {r['outcome']})"
                for r in (json.loads(p.read_text()) for p in recs)))
        if spec.then_kill is not None:
            if rec is None or rec["outcome"] != "quarantined" or not rec["quarantined"]:
                return fail("the device fault's recovery record did not quarantine it")
            rec = json.loads(recs[-1].read_text()) if len(recs) == 2 else None
            if rec is not None:
                partial["recovery"] = f"{rec['id']}: {rec['outcome']}"
            ours = [d for d in (rec or {}).get("decisions", []) if d["class"] == IncidentClass.FAIL_STOP]
        if spec.recurs:
            if len(recs) != expected:
                return fail(f"{len(recs)} recoveries: the fault was to come back {spec.recurs} time(s) before it "
                            "was localized")
            docs = [json.loads(p.read_text()) for p in recs]
            if not docs[1].get("reshuffle"):
                return fail(f"{docs[1]['id']} did not move the ranks off the device the fault recurred on")
            rec = docs[-1]
            partial["recovery"] = f"{rec['id']}: {rec['outcome']}"
            if not rec["quarantined"]:
                return fail(f"{rec['id']}: the fault recurred under other rank numbers and nothing was quarantined")
            ours = [d for d in rec["decisions"] if d["class"] in spec.classes]
            gate = next((p for d in ours for p in d["path"] if str(p).startswith("gate")), None)
            partial["gate"] = gate
        if rec is None or rec["outcome"] != "recovered":
            return fail("no recovery record" if rec is None else f"{rec['id']}: outcome {rec['outcome']}")
        if not ours:
            return fail(f"{rec['id']} does not name {'/'.join(spec.classes)} {subject}")
        if spec.actions and dec["action"] not in spec.actions:
            return fail(f"the decision was {dec['action']}, not {' or '.join(spec.actions)}")
        if len(attempts) < 2 or attempts[-1]["resume_from"] is None:
            return fail("the new attempt did not resume from a checkpoint")
        if (spec.then_kill is not None or spec.recurs) and (on := _off_quarantine(run_dir, len(attempts) - 1)) is not None:
            return fail(f"the relaunch was placed on the quarantine list: {on}")
        if spec.resume_from is not None and attempts[-1]["resume_from"] != spec.resume_from:
            return fail(f"the new attempt resumed from {attempts[-1]['resume_from']}, not {spec.resume_from} (the "
                        f"newest checkpoint a sound recovery may use)")
    else:
        allowed = spec.actions or (Action.OBSERVE,)
        if dec["action"] not in allowed:
            return fail(f"the decision was {dec['action']}, not {' or '.join(allowed)}")
        if dec["action"] == Action.QUARANTINE and (rec is None or not rec["quarantined"]):
            return fail("a quarantine decision, but no recovery record quarantined anything")
        if len(attempts) != 1:
            return fail(f"{len(attempts)} attempts: the job was restarted")
    if spec.env and not _save_failed(run_dir):
        return fail("the save fault never fired: no checkpoint_failed event in attempt 0")
    final = _final_fingerprints(run_dir)
    same = final["step"] == ref["step"] and final["ranks"] == ref["ranks"]
    partial["bitwise"] = same
    if not same:
        differ = sorted({k for r, fp in final["ranks"].items() for k, v in fp.items()
                         if ref["ranks"].get(r, {}).get(k) != v})
        return fail(f"final fingerprints (step {final['step']}) differ from the reference's (step {ref['step']}: "
                    f"{', '.join(differ) or 'ranks'}); {_lineage_why(run_dir)}")
    why = f"final fingerprints at step {final['step']} bitwise equal to the reference run"
    if spec.resume_from is not None and rec is not None:
        why += f"; resumed from {spec.resume_from}, retired: {', '.join(rec['retired']) or 'none'}"
    return DrillReport(**partial, passed=True, reason=why)


def run_drills(names: Iterable[str], workdir: Path, *, say: Callable[[str], None] = print) -> tuple[DrillReport, ...]:
    """Each drill in turn against one reference run; the report written to <workdir>/report.json after each."""
    names = list(names)
    for n in names:
        if n not in DRILLS:
            raise ValueError(f"unknown drill {n!r} (drills: {', '.join(DRILLS)})")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ref = reference_fingerprints(workdir, say=say)
    out: list[DrillReport] = []
    for i, n in enumerate(names):
        again = names[:i].count(n)  # a repeated drill keeps each run: <name>, <name>-2, ...
        out.append(run_drill(n, workdir, say=say, reference=ref, folder=f"{n}-{again + 1}" if again else None))
        write_report(workdir / REPORT_FILE, out)
    return tuple(out)
