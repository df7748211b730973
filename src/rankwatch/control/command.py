"""A job the recovery manager owns by its command line: any training script, launched the way its team launches it.

    job = CommandJob.from_args(run_dir, ["rankwatch", "torchrun", "--standalone", "--nproc-per-node", "4",
                                         "train.py", "--resume"], layout=Layout(dp=2, tp=2),
                               membership=MembershipSupport.FIXED_SHAPES)
    ManagerService(run_dir, secret=..., job=job, launcher=CommandLauncher(), load_job=CommandJob.from_run)

`CommandJob` is the `recovery.job.Job` of such a command (values, no processes), `CommandLauncher` its `Launcher`:

- **Launch.** The command runs in a session of its own (``start_new_session``), its output in
  ``<run>/manager/attempt-N.log``. The launch is recorded in ``<run>/run.json`` (the command, the layout and
  membership the job declares, placement) under a launch key the launcher makes up; the environment carries it as
  ``RANKWATCH_LAUNCH`` (`collector.launcher_env.LAUNCH_ENV`), so the ranks' `collector.attach()` (and torchrun's own
  restarts, as the next attempts) find their attempt number in the run file. The ranks' pids are read from their
  liveness records (`collector.liveness`) once every rank has written one.
- **Stop** (the manager's `stop` event, on a signed fail-stop / hang decision): SIGTERM to the command's process
  group — torchrun's agent then stops its workers (torch/distributed/elastic/agent/server/api.py: a signal ends the
  agent's run and ``_shutdown`` closes its worker processes with SIGTERM) — and after `term_grace_s` SIGKILL to the
  command's group and to every rank's own group (torchrun starts each worker in a session of its own:
  torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py, ``start_new_session=True``).
- **Exit codes per rank** come from the host agent's exit records (``<run>/live/exit-R.json``, written by
  `rankwatch torchrun`); a rank without one is None (its end not observed).
- **What the relaunch is told**, in its environment (`recovery.job`): the checkpoint the policy chose
  (``RANKWATCH_RESUME_FROM``; ``start`` for step 0) — the job's `recovery.Checkpointer` refuses to resume from any
  other, and raises if the script never resumes — the layout the manager declared (``RANKWATCH_LAYOUT``: the
  Checkpointer refuses a mesh that disagrees, so the catalog is judged by the layout that saved it) and the replay
  basis. The command itself is run again unchanged: it must ask its script to resume (e.g. ``--resume``).
- **Placement** off quarantined devices through the device visibility every CUDA program honours
  (``CUDA_VISIBLE_DEVICES``): the job is given `devices` (indices or UUIDs, more than it needs when spares exist);
  a quarantined one is left out, a rotation moves every rank by k devices, and a relaunch that needs more devices
  than are left is refused (ValueError naming what is left). Without `devices` (a CPU job) the ranks are placed by
  local rank and no device can be taken out.
- **Placement off quarantined hosts** through the host list the job's own launcher takes: with `hosts` (spares
  included) and `nodes` (how many it runs on), the command holds ``{hosts}`` where the manager writes the hosts it is
  to use, comma-separated (Slurm's ``srun --nodelist={hosts}``, an MPI hostfile line, a ``pdsh -w {hosts}`` that
  starts torchrun on each), and may hold ``{first_host}`` (torchrun's ``--rdzv-endpoint={first_host}:29500``) and
  ``{nnodes}``. Node i of the job is the i-th host written, its ranks i * per-node ... (torchrun's ``--node-rank``
  order as the launcher gives it). A quarantined host is left out for the next spare; a relaunch with fewer hosts
  than `nodes` left is refused. Without `hosts` the command runs on this host alone, and a quarantine of it is
  refused.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rankwatch.base.rundir import RunDir, claim_launch, read_launches
from rankwatch.base.topology import Layout
from rankwatch.collector.launcher_env import ATTEMPT_ENV, LAUNCH_ENV, RUN_DIR_ENV
from rankwatch.recovery.decision import MembershipSupport
from rankwatch.recovery.job import (
    FROM_START, LAYOUT_ENV, REPLAY_BASIS_ENV, RESUME_FROM_ENV, JobDeclaration, LaunchResult, Launcher, Placement,
)

__all__ = ["COMMAND_JOB", "CommandJob", "CommandLauncher", "command_world_size"]

COMMAND_JOB = "command"
HOSTS_FIELD = "{hosts}"
"""Where a command that takes a host list gets the hosts the manager chose (module docstring)."""
"""The `job` of a launch record `CommandLauncher` wrote (`CommandJob.from_run` reads the latest one back)."""

_LAUNCHERS = ("torchrun", "torch.distributed.run")


def command_world_size(command: Sequence[str]) -> int | None:
    """The world size a torchrun command line starts (``--nproc-per-node`` times a fixed ``--nnodes``, read by
    torchrun's own parser: torch/distributed/run.py `get_args_parser`), for ``torchrun ...``, ``rankwatch torchrun
    ...`` and ``python -m torch.distributed.run ...``; None when it is another command or the size is not fixed
    (``--nproc-per-node gpu``, ``--nnodes 1:4``)."""
    args = list(command)
    at = next((i for i, a in enumerate(args) if Path(a).name in _LAUNCHERS or a in _LAUNCHERS), None)
    if at is None:
        return None
    rest = args[at + 1:]
    if rest[:1] and rest[0].startswith("--run-dir"):  # rankwatch torchrun's own flag
        rest = rest[1:] if "=" in rest[0] else rest[2:]
    from torch.distributed.run import get_args_parser

    try:
        ns = get_args_parser().parse_args(rest)
    except SystemExit:
        return None
    nproc, nnodes = str(ns.nproc_per_node), str(ns.nnodes)
    low, _, high = nnodes.partition(":")  # torchrun's default is "1:1"; a range "1:4" is elastic
    if not nproc.isdigit() or not low.isdigit() or high not in ("", low):
        return None
    return int(nproc) * int(low)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommandJob:
    """One training command as the recovery manager handles it (see the module docstring). Values only."""

    run_dir: Path
    command: tuple[str, ...]
    layout: Layout
    """The layout the job declares (its DeviceMesh's: the Checkpointer records it in every manifest)."""
    membership: MembershipSupport = MembershipSupport.FIXED_SHAPES
    cwd: Path = field(default_factory=Path.cwd)
    host: str = field(default_factory=socket.gethostname)
    devices: tuple[str, ...] = ()
    """The devices of `host` the job may run on (``CUDA_VISIBLE_DEVICES`` entries: indices or UUIDs), spares
    included; () for a job without devices."""
    uuids: tuple[str, ...] = ()
    """Each device's UUID (what a quarantine names), in `devices`' order; an entry that is itself a UUID is its own."""
    excluded: tuple[str, ...] = ()
    """Entries of `devices` taken out of placement (quarantined)."""
    shift: int = 0
    """Each rank sits `shift` usable devices further along (a rotation)."""
    resume_from: str | None = None
    """None: the command as first given; else the checkpoint id a relaunch resumes from, or `FROM_START`."""
    replay_basis: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the command, every attempt."""
    faults: tuple[tuple[str, str], ...] = ()
    """Environment that injects a fault into the job (a drill's), in this launch only: a relaunch drops it unless
    told to keep the faults (`relaunched`), as an injected fault stands for a transient one."""
    hosts: tuple[str, ...] = ()
    """The hosts the job may run on, spares included, for a command that takes a host list (``{hosts}``;
    ``manager serve --host-list``); () for a command on this host alone."""
    nodes: int = 1
    """How many of `hosts` it runs on (its world is `nodes` times the ranks per node)."""
    excluded_hosts: tuple[str, ...] = ()
    """Entries of `hosts` taken out of placement (quarantined)."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("the job's command is empty (give it after `--`)")
        if self.nodes < 1 or self.world_size % self.nodes:
            raise ValueError(f"{self.nodes} nodes for a world of {self.world_size} ranks: each node must hold as many")
        if self.hosts or self.nodes > 1:
            if not any(HOSTS_FIELD in a for a in self.command):
                raise ValueError(f"{shlex.join(self.command)!r}: a job on a host list must take it where the command "
                                 f"says {HOSTS_FIELD} (e.g. srun --nodelist={HOSTS_FIELD})")
            if len(set(self.hosts)) != len(self.hosts):
                raise ValueError(f"hosts {list(self.hosts)}: a host is listed twice")
            if self.devices:
                raise ValueError("devices are per host: give a host list or a device list, not both")
            if len(self.usable_hosts) < self.nodes:
                raise ValueError(f"the job needs {self.nodes} hosts; usable: {list(self.usable_hosts) or 'none'} "
                                 f"(of {list(self.hosts)}, quarantined: {list(self.excluded_hosts) or 'none'})")
        if self.uuids and len(self.uuids) != len(self.devices):
            raise ValueError(f"{len(self.uuids)} device UUIDs for {len(self.devices)} devices")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices {list(self.devices)}: an entry is listed twice")
        if self.devices and len(self.usable) < self.world_size:
            raise ValueError(f"the job needs {self.world_size} devices on {self.host}; usable: "
                             f"{list(self.usable) or 'none'} (of {list(self.devices)}, quarantined: "
                             f"{list(self.excluded) or 'none'})")

    @classmethod
    def from_args(cls, run_dir: Path, command: Sequence[str], *, layout: Layout | None = None,
                  membership: MembershipSupport = MembershipSupport.FIXED_SHAPES, devices: Sequence[str] = (),
                  cwd: Path | None = None, env: Mapping[str, str] | None = None, hosts: Sequence[str] = (),
                  nodes: int = 1) -> CommandJob:
        """The job of `command`: its world size from the torchrun arguments (`command_world_size`) and the layout
        given (dp = the world when none). ValueError when neither says the world size, or they disagree. `hosts`
        and `nodes`: a command that takes a host list (module docstring)."""
        world = command_world_size(command)
        if layout is None:
            if world is None:
                raise ValueError(f"cannot tell the world size of {shlex.join(command)!r}: give --layout")
            layout = Layout(dp=world)
        elif world is not None and world != layout.world_size:
            raise ValueError(f"layout {layout} holds {layout.world_size} ranks, the command starts {world}")
        devs = tuple(str(d) for d in devices)
        return cls(run_dir=Path(run_dir).resolve(), command=tuple(command), layout=layout, membership=membership,
                   cwd=(cwd or Path.cwd()).resolve(), devices=devs, uuids=_uuids(devs),
                   env=tuple(sorted((env or {}).items())), hosts=tuple(str(h) for h in hosts), nodes=nodes)

    @classmethod
    def from_run(cls, run_dir: Path) -> CommandJob:
        """The job of the run's latest launch by `CommandLauncher` (<run>/run.json), as first given (no resume).
        ValueError naming the run file when none is recorded or it is unreadable."""
        run_file = RunDir(Path(run_dir)).run_file
        rec = next((r for r in reversed(read_launches(run_dir)) if r.get("job") == COMMAND_JOB), None)
        if rec is None:
            raise ValueError(f"{run_file}: records no launch of a command by the recovery manager")
        try:
            return cls(run_dir=Path(run_dir).resolve(), command=tuple(str(a) for a in rec["command"]),
                       layout=Layout.parse(str(rec["layout"])),
                       membership=MembershipSupport(rec.get("membership", MembershipSupport.FIXED_SHAPES)),
                       cwd=Path(str(rec["cwd"])), host=str(rec.get("host") or socket.gethostname()),
                       devices=tuple(str(d) for d in rec.get("devices", ())),
                       uuids=tuple(str(u) for u in rec.get("uuids", ())),
                       excluded=tuple(str(d) for d in rec.get("excluded", ())), shift=int(rec.get("shift", 0)),
                       env=tuple((str(k), str(v)) for k, v in dict(rec.get("env", {})).items()),
                       hosts=tuple(str(h) for h in rec.get("host_list", ())), nodes=int(rec.get("nodes", 1)),
                       excluded_hosts=tuple(str(h) for h in rec.get("excluded_hosts", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{run_file}: the command launch record is unreadable ({type(exc).__name__}: {exc})") from None

    # -- the Job protocol ----------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def usable(self) -> tuple[str, ...]:
        return tuple(d for d in self.devices if d not in self.excluded)

    @property
    def usable_hosts(self) -> tuple[str, ...]:
        return tuple(h for h in self.hosts if h not in self.excluded_hosts)

    @property
    def chosen_hosts(self) -> tuple[str, ...]:
        """The hosts this launch runs on, node 0 first (the first `nodes` usable ones); (this host,) without a list."""
        return self.usable_hosts[: self.nodes] if self.hosts else (self.host,)

    def argv(self) -> tuple[str, ...]:
        """The command as launched: ``{hosts}``, ``{first_host}`` and ``{nnodes}`` written in where it has them."""
        if not self.hosts:
            return self.command
        chosen = self.chosen_hosts
        fields = {HOSTS_FIELD: ",".join(chosen), "{first_host}": chosen[0], "{nnodes}": str(self.nodes)}
        out = []
        for a in self.command:
            for k, v in fields.items():
                a = a.replace(k, v)
            out.append(a)
        return tuple(out)

    def declaration(self) -> JobDeclaration:
        """What the job declared: its membership support. Nothing else is assumed (idempotency unknown; the only
        actions are observe, quarantine and a restart of the whole command)."""
        return JobDeclaration(membership=self.membership)

    def _assigned(self) -> tuple[str, ...]:
        """The device of each local rank, in rank order (what CUDA_VISIBLE_DEVICES lists)."""
        use = self.usable
        return tuple(use[(r + self.shift) % len(use)] for r in range(self.world_size)) if use else ()

    def _uuid(self, device: str) -> str:
        return self.uuids[self.devices.index(device)] if self.uuids else device

    def placement(self) -> dict[int, Placement]:
        if self.hosts:
            per = self.world_size // self.nodes
            chosen = self.chosen_hosts
            return {r: (chosen[r // per], r % per, "") for r in range(self.world_size)}
        assigned = self._assigned()
        if not assigned:
            return {r: (self.host, r, "") for r in range(self.world_size)}
        return {r: (self.host, self.devices.index(d), self._uuid(d)) for r, d in enumerate(assigned)}

    def placed_off(self, *, devices: Collection[str] = (), hosts: Collection[str] = ()) -> tuple[CommandJob, tuple[str, ...]]:
        if self.hosts:
            return self._placed_off_hosts(hosts)
        if self.host in hosts:
            raise ValueError(f"host {self.host} is quarantined, and the job's command runs on it alone: nothing left")
        bad = {d for d in self.usable if self._uuid(d) in devices or d in devices}
        used = set(self._assigned())
        if not bad & used:
            return (replace(self, excluded=self.excluded + tuple(sorted(bad))) if bad else self), ()
        moved = replace(self, excluded=self.excluded + tuple(sorted(bad)))  # ValueError when too few are left
        before, after = self.placement(), moved.placement()
        lines = tuple(f"rank {r}: device {before[r][2] or before[r][1]} -> {after[r][2] or after[r][1]} (quarantined)"
                      for r in range(self.world_size) if before[r] != after[r] and before[r][2] in
                      {self._uuid(d) for d in bad})
        return moved, lines

    def _placed_off_hosts(self, hosts: Collection[str]) -> tuple[CommandJob, tuple[str, ...]]:
        """Off the quarantined `hosts`: each is left out of the list; a node on one moves to the next spare, the
        others keep their place (ValueError when fewer than `nodes` are left)."""
        bad = {h for h in self.usable_hosts if h in hosts}
        if not bad:
            return self, ()
        keep = [h for h in self.chosen_hosts if h not in bad]
        spares = [h for h in self.usable_hosts if h not in bad and h not in self.chosen_hosts]
        order = [h if h not in bad else (spares.pop(0) if spares else "") for h in self.chosen_hosts]
        if "" in order:
            raise ValueError(f"the job needs {self.nodes} hosts; usable: {keep + spares or 'none'} (of "
                             f"{list(self.hosts)}, quarantined: {sorted(set(self.excluded_hosts) | bad)})")
        rest = [h for h in self.usable_hosts if h not in bad and h not in order]
        moved = replace(self, hosts=tuple(order) + tuple(rest) + tuple(h for h in self.hosts if h not in order
                                                                      and h not in rest),
                        excluded_hosts=self.excluded_hosts + tuple(sorted(bad)))
        before, after = self.placement(), moved.placement()
        per = self.world_size // self.nodes
        lines = tuple(f"node {i} (ranks {i * per}..{(i + 1) * per - 1}): host {before[i * per][0]} -> "
                      f"{after[i * per][0]} (quarantined)" for i in range(self.nodes)
                      if before[i * per][0] != after[i * per][0])
        return moved, lines

    def rotations(self) -> list[CommandJob]:
        n = len(self.usable)
        return [replace(self, shift=(self.shift + k) % n) for k in range(1, n)] if n > 1 else []

    def resized(self, world_size: int) -> CommandJob:
        """The command on `world_size` ranks: torchrun's ``--nproc-per-node`` rewritten (one node only), the layout
        data parallel over them. ValueError when the layout has tensor or pipeline parallelism, the command is not a
        single-node torchrun command, or `world_size` < 1. Whether the job's algorithm may run on fewer ranks is its
        declaration (`membership`), which the manager checks before it asks."""
        if world_size < 1:
            raise ValueError(f"a world of {world_size} ranks")
        if self.hosts:
            raise ValueError(f"{shlex.join(self.command)!r}: a job on a host list is not resized by the manager")
        if self.layout.tp != 1 or self.layout.pp != 1:
            raise ValueError(f"layout {self.layout}: tensor and pipeline shapes are fixed")
        if command_world_size(self.command) != self.world_size:
            raise ValueError(f"{shlex.join(self.command)!r}: not a single-node torchrun command whose --nproc-per-node "
                             "can be rewritten")
        out = list(self.command)
        flags = ("--nproc-per-node", "--nproc_per_node")
        at = next((i for i, a in enumerate(out) if a in flags or a.split("=", 1)[0] in flags), None)
        if at is None:
            raise ValueError(f"{shlex.join(self.command)!r}: no --nproc-per-node to rewrite")
        if "=" in out[at]:
            out[at] = f"{out[at].split('=', 1)[0]}={world_size}"
        else:
            out[at + 1] = str(world_size)
        return replace(self, command=tuple(out), layout=Layout(dp=world_size), shift=0)

    def relaunched(self, *, checkpoint: str | None, keep_faults: bool, replay_basis: int | None) -> CommandJob:
        """The same command resumed from `checkpoint` (None: from step 0), its environment as given; the injected
        `faults` only when `keep_faults`."""
        return replace(self, resume_from=checkpoint or FROM_START, replay_basis=replay_basis,
                       faults=self.faults if keep_faults else ())

    def environment(self) -> dict[str, str]:
        """What the command's environment gets beyond the manager's own (besides the launch key)."""
        env = {RUN_DIR_ENV: str(self.run_dir), LAYOUT_ENV: str(self.layout), **dict(self.env), **dict(self.faults)}
        if self.resume_from is not None:
            env[RESUME_FROM_ENV] = self.resume_from
        if self.replay_basis is not None:
            env[REPLAY_BASIS_ENV] = str(self.replay_basis)
        assigned = self._assigned()
        if assigned:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(assigned)
        return env

    def launch_record(self) -> dict[str, Any]:
        return {"started_wall_ns": time.time_ns(), "job": COMMAND_JOB, "world_size": self.world_size,
                "layout": str(self.layout), "membership": str(self.membership), "command": list(self.command),
                "cwd": str(self.cwd), "host": self.host, "devices": list(self.devices), "uuids": list(self.uuids),
                "excluded": list(self.excluded), "shift": self.shift, "resume_from": self.resume_from,
                "replay_basis": self.replay_basis, "env": dict(self.env), "faults": dict(self.faults),
                "hosts": self.nodes, "host_list": list(self.hosts), "nodes": self.nodes,
                "excluded_hosts": list(self.excluded_hosts), "argv": list(self.argv()),
                "placement": {str(r): list(p) for r, p in self.placement().items()}}


def _uuids(devices: Sequence[str]) -> tuple[str, ...]:
    """Each device's UUID: an entry that is one (GPU-... / MIG-...) is its own; an index is asked of NVML when a
    driver answers; otherwise the index stands for it (a quarantine by UUID then cannot match it)."""
    if not any(d.isdigit() for d in devices):
        return tuple(devices)
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver: the indices stand for the devices
        return tuple(devices)
    out = []
    for d in devices:
        try:
            u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(int(d))) if d.isdigit() else d
        except Exception:  # an index NVML does not know: it stands for itself
            u = d
        out.append(u.decode() if isinstance(u, bytes) else str(u))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------- launcher


def _rank_pids(run_dir: Path, world: int, attempt: int) -> dict[int, int]:
    """rank -> pid of the ranks whose liveness record belongs to `attempt`."""
    from rankwatch.analytics.liveness import decode_rank_record
    from rankwatch.analytics.liveness.records import TornRecord
    from rankwatch.collector.liveness import rank_record_path

    out = {}
    for r in range(world):
        path = rank_record_path(run_dir, r)
        try:
            rec = decode_rank_record(path.read_bytes(), str(path))
        except (OSError, TornRecord, ValueError):
            continue
        if rec.attempt == attempt and rec.pid is not None:
            out[r] = rec.pid
    return out


def _exit_codes(run_dir: Path, world: int, attempt: int) -> tuple[int | None, ...]:
    """Per rank, from the host agent's exit records of `attempt`: the exit code, or minus the signal; None unseen."""
    import json

    from rankwatch.analytics.liveness import parse_exit_record
    from rankwatch.collector.liveness import exit_record_path

    codes: list[int | None] = []
    for r in range(world):
        try:
            rec = parse_exit_record(json.loads(exit_record_path(run_dir, r).read_text()))
        except (OSError, ValueError):
            codes.append(None)
            continue
        if rec.attempt != attempt:
            codes.append(None)
        elif rec.signal is not None:
            codes.append(-rec.signal)
        else:
            codes.append(rec.exit_code)
    return tuple(codes)


def _kill_group(pgid: int, sig: int) -> None:
    if pgid > 1 and pgid != os.getpgrp():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


class CommandLauncher(Launcher):
    """Runs a `CommandJob`'s command to its end (see the module docstring). `term_grace_s`: from SIGTERM to SIGKILL;
    `start_wait_s`: how long to wait for every rank's liveness record before `on_start` is called with the command's
    own pid for the ranks not seen (a script without `collector.attach()`)."""

    def __init__(self, *, term_grace_s: float = 10.0, start_wait_s: float = 120.0, poll_s: float = 0.1) -> None:
        self.term_grace_s, self.start_wait_s, self.poll_s = term_grace_s, start_wait_s, poll_s

    def __call__(self, job: CommandJob, *, stop: threading.Event | None = None,
                 on_start: Callable[[tuple[int, ...]], None] | None = None, timeout_s: float | None = None,
                 **kw: Any) -> LaunchResult:
        import subprocess

        stop = stop if stop is not None else threading.Event()
        on_start = on_start if on_start is not None else (lambda pids: None)

        run_dir = Path(job.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        key = f"manager:{uuid.uuid4().hex}"
        attempt = claim_launch(run_dir, f"{key}:0", job.launch_record())
        env = {k: v for k, v in os.environ.items() if k not in (ATTEMPT_ENV, RESUME_FROM_ENV, REPLAY_BASIS_ENV)}
        env.update({**job.environment(), LAUNCH_ENV: key})
        log_path = RunDir(run_dir).job_log(attempt)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(list(job.argv()), cwd=job.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        pids: dict[int, int] = {}
        groups: set[int] = {proc.pid}
        announced = False
        stopped = False
        term_at: float | None = None
        terminated: tuple[int, ...] = ()
        try:
            while True:
                ended = proc.poll() is not None
                if not announced:
                    pids.update(_rank_pids(run_dir, job.world_size, attempt))
                    for pid in pids.values():
                        with contextlib.suppress(OSError):
                            groups.add(os.getpgid(pid))
                    if len(pids) == job.world_size or ended or time.monotonic() - t0 > self.start_wait_s:
                        on_start(tuple(pids.get(r, proc.pid) for r in range(job.world_size)))
                        announced = True
                if ended:
                    break
                now = time.monotonic()
                over = timeout_s is not None and now - t0 > timeout_s
                if term_at is None and (stop.is_set() or over):
                    stopped = stop.is_set()
                    codes = _exit_codes(run_dir, job.world_size, attempt)
                    terminated = tuple(r for r in range(job.world_size) if codes[r] is None)
                    _kill_group(proc.pid, signal.SIGTERM)
                    term_at = now
                elif term_at is not None and now - term_at > self.term_grace_s:
                    for g in groups:
                        _kill_group(g, signal.SIGKILL)
                    proc.wait(30.0)
                    break
                time.sleep(self.poll_s)
        except BaseException:
            for g in groups:
                _kill_group(g, signal.SIGKILL)
            proc.wait(30.0)
            raise
        # a worker whose agent was killed with the command keeps its own session: nothing of the attempt outlives it
        for g in groups - {proc.pid}:
            _kill_group(g, signal.SIGKILL)
        codes = _exit_codes(run_dir, job.world_size, attempt)
        if proc.returncode == 0 and any(c is None for c in codes):  # a job without the host agent: torchrun's word
            codes = tuple(0 if c is None else c for c in codes)
        checks: tuple[Any, ...] = ()
        warnings: list[str] = []
        if job.resume_from is not None:
            from rankwatch.recovery.promises import record_replay_verification  # the analysis stack, here only

            try:
                checks = record_replay_verification(run_dir, attempt)
            except ValueError as exc:
                warnings.append(f"replay verification not recorded: {exc}")
        return LaunchResult(run_dir=run_dir, exit_codes=codes, pids=tuple(pids.get(r, proc.pid)
                                                                          for r in range(job.world_size)),
                            duration_s=time.monotonic() - t0, terminated=terminated, replay=checks,
                            warnings=tuple(warnings), stopped=stopped)

