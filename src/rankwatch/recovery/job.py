"""What a job gives the recovery side so that it can be recovered: what it declares about itself, how it is placed
and relaunched, and how one attempt of it is launched — and what a launch returns.

    JobDeclaration   what the job says of itself (membership change its algorithm supports, idempotency of its
                     failed operations, the actions it can carry out); the policy never assumes more
    Job              the job's config as the recovery manager (`control.manager`) handles it: its run, layout and
                     placement, a copy placed off quarantined devices, a copy for a relaunch, and its launch record
    Launcher         runs one attempt to its end (`stop` ends it at once); `FakeLauncher` starts no process
    LaunchResult     exit codes, pids, duration, who was terminated, and a resumed attempt's replay verification

The canary implements `Job` with its `CanaryConfig` and `Launcher` with `canary.launcher.CanaryLauncher`; the manager
imports neither, so it can own any job that implements them.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

from rankwatch.base.rundir import append_launch
from rankwatch.base.topology import Layout
from rankwatch.recovery.decision import Action, Idempotency, MembershipSupport

if TYPE_CHECKING:
    from rankwatch.analytics.replay import ReplayCheck

__all__ = [
    "FROM_START", "LAYOUT_ENV", "REPLAY_BASIS_ENV", "RESUME_FROM_ENV", "FakeLauncher", "Job", "JobDeclaration",
    "JobLoader", "LaunchResult", "Launcher", "Placement",
]

# What a relaunch by the recovery manager tells the job it runs by command (`control.command`), in its environment;
# the job's `recovery.Checkpointer` reads them.
RESUME_FROM_ENV = "RANKWATCH_RESUME_FROM"
"""The checkpoint id the policy chose (the Checkpointer resumes from it or refuses), or `FROM_START`."""
FROM_START = "start"
"""`RESUME_FROM_ENV`'s value for a restart from step 0 (the manager has recorded it in the lineage)."""
LAYOUT_ENV = "RANKWATCH_LAYOUT"
"""The layout the job declared to the manager (``dp=2,tp=2,pp=1``); the Checkpointer refuses a mesh that differs."""
REPLAY_BASIS_ENV = "RANKWATCH_REPLAY_BASIS"
"""The step from which the attempts this relaunch replaces stop being a replay reference (`control.manager.
replay_basis`); rank 0 records it as a `replay_basis` event."""

Placement = tuple[str, int, str]
"""Where one rank runs: (host, device slot on it, that device's UUID)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobDeclaration:
    """What the job says about itself; the policy never assumes more."""

    membership: MembershipSupport
    idempotent: Idempotency = Idempotency.UNKNOWN
    """Whether the job's failing operations may be re-run (UNKNOWN is treated as not idempotent)."""
    executable: frozenset[Action] = frozenset({Action.OBSERVE, Action.QUARANTINE, Action.RESTART_JOB})
    """Actions the job can carry out; anything else is escalated to RESTART_JOB."""
    domain_rollback: bool = False
    """True when the job can reload a checkpoint into one consistency domain's living processes (a ROLLBACK_DOMAIN
    narrower than the job); False: a domain rollback relaunches every process."""


class Job(Protocol):
    """A job's config as the recovery manager handles it. Values, not processes: every method returns a new config
    and launches nothing."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def world_size(self) -> int: ...

    def declaration(self) -> JobDeclaration:
        """What the job declares about itself (`JobDeclaration`)."""
        ...

    def placement(self) -> Mapping[int, Placement]:
        """rank -> (host, device slot, device UUID) this config places it on."""
        ...

    def placed_off(self, *, devices: Collection[str] = (), hosts: Collection[str] = ()) -> tuple[Self, tuple[str, ...]]:
        """This config placed so that no rank is on one of `devices` (UUIDs) or `hosts`, and one line per rank that
        moved; itself and () when nothing it uses is among them. ValueError naming what is left when nothing is."""
        ...

    def rotations(self) -> Sequence[Self]:
        """The other placements a relaunch may move the ranks to, each rank to another device of its host, nearest
        first (a fault that recurred on one device under one rank number then meets another rank number)."""
        ...

    def resized(self, world_size: int) -> Self:
        """This config on `world_size` ranks, for a membership change the job declared (`JobDeclaration.membership`:
        a pure data-parallel job continuing with fewer replicas, its batch or per-rank work re-planned by the job).
        ValueError naming why when the job cannot run on that many (fixed shapes, a batch that does not divide)."""
        ...

    def relaunched(self, *, checkpoint: str | None, keep_faults: bool, replay_basis: int | None) -> Self:
        """The config of a relaunch: resumed from `checkpoint` behind the consistency gate (None: from step 0),
        with the faults injected into this attempt only when `keep_faults` (the machine's own stay), and
        `replay_basis` (the step a state fault it undoes may have begun at; None: none)."""
        ...

    def launch_record(self) -> dict[str, Any]:
        """This launch as `<run>/run.json` records it (`base.rundir.append_launch` numbers it)."""
        ...


JobLoader = Callable[[Path], Job]
"""The job a run's latest launch recorded, read back from `<run>/run.json` (the canary's: `CanaryConfig.from_run`).
ValueError naming the run file when it records no launch of that job."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchResult:
    run_dir: Path
    exit_codes: tuple[int | None, ...]
    """Per rank: 0 ok, >0 exit code, <0 killed by that signal, None never observed ending."""
    pids: tuple[int, ...]
    duration_s: float
    terminated: tuple[int, ...]
    """Ranks the launcher had to terminate."""
    replay: tuple[ReplayCheck, ...] = ()
    """A resumed attempt's replay verification (`recovery.promises`): one check per earlier attempt whose
    fingerprinted steps it trained again."""
    warnings: tuple[str, ...] = ()
    """What the launcher could not do after the ranks ended (e.g. verify the replay), one line each."""
    stopped: bool = False
    """The caller's `stop` event ended the job (its still-running ranks are in `terminated`)."""

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.exit_codes)

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, c in enumerate(self.exit_codes) if c != 0)


class Launcher(ABC):
    """Runs one attempt of the job to its end; `stop`, set from another thread, ends it at once (the result's
    `stopped`); `on_start` gets the ranks' pids. The canary's is `canary.launcher.CanaryLauncher`; `FakeLauncher`
    is for tests."""

    @abstractmethod
    def __call__(self, job: Any, *, stop: threading.Event, on_start: Callable[[tuple[int, ...]], None],
                 **kw: Any) -> LaunchResult: ...


class FakeLauncher(Launcher):
    """A launcher that starts no process. Each call appends the attempt to run.json as a real launcher does (the
    job's own launch record, so `read_launches`, the job's `from_run` and `apply` see it), calls `on_start`, and
    then follows the next of `script`: "run" waits until `stop` is set (or `finish()`, or `wait_s`), "ok" ends at
    once with exit 0, "fail" with exit 1 on rank 0. Past the script's end it ends "ok"."""

    def __init__(self, script: tuple[str, ...] = ("run",), *, wait_s: float = 60.0) -> None:
        for s in script:
            if s not in ("run", "ok", "fail"):
                raise ValueError(f"fake launcher: unknown step {s!r} (run, ok or fail)")
        self._script = list(script)
        self._wait_s = wait_s
        self._finish = threading.Event()
        self.calls: list[Any] = []
        self.started = threading.Semaphore(0)
        """Released once per attempt, after on_start."""

    def finish(self) -> None:
        """End the attempt that is waiting ("run") with exit 0."""
        self._finish.set()

    def __call__(self, job: Any, *, stop: threading.Event, on_start: Callable[[tuple[int, ...]], None],
                 **kw: Any) -> LaunchResult:
        Path(job.run_dir).mkdir(parents=True, exist_ok=True)
        append_launch(job.run_dir, job.launch_record())
        self.calls.append(job)
        step = self._script.pop(0) if self._script else "ok"
        pids = tuple(range(1000, 1000 + job.world_size))
        on_start(pids)
        self.started.release()
        t0 = time.monotonic()
        stopped = False
        codes: tuple[int | None, ...] = (0,) * job.world_size
        if step == "run":
            self._finish.clear()
            while not (stop.is_set() or self._finish.is_set()) and time.monotonic() - t0 < self._wait_s:
                stop.wait(0.01)
            stopped = stop.is_set()
            if stopped:
                codes = (-15,) * job.world_size
        elif step == "fail":
            codes = (1,) + (0,) * (job.world_size - 1)
        return LaunchResult(run_dir=Path(job.run_dir), exit_codes=codes, pids=pids, duration_s=time.monotonic() - t0,
                            terminated=tuple(range(job.world_size)) if stopped else (), stopped=stopped)
