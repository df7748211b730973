"""The canary job's configuration, and what the recovery side needs of it (`recovery.job.Job`): its declaration,
its placement on the (virtual) machine, how it is placed off quarantined devices, how it relaunches, and how a run
directory's latest launch is read back into a config.

The canary relaunches every process to recover: it declares no live membership change and no in-place retry
(`canary_declaration`), and the recovery manager escalates a narrower action to a restart from a checkpoint.
Placement is a virtual topology: ranks fill hosts contiguously, local rank l sits on device slot
(l + device_shift) mod slots-per-host, and a device's UUID is the replay sampler's for its (host, slot).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rankwatch.base.rundir import RunDir, read_launches
from rankwatch.base.topology import Hosts, Layout
from rankwatch.canary.faults import Faults
from rankwatch.canary.model import ModelConfig
from rankwatch.collector.gpu import replay_uuid
from rankwatch.recovery.decision import Idempotency, MembershipSupport
from rankwatch.recovery.determinism import DDP_BUCKET_CAP_MB, DETERMINISM_KEY, DeterminismInputs
from rankwatch.recovery.job import JobDeclaration, Placement

__all__ = ["GPU_MODES", "CanaryConfig", "canary_declaration", "config_from_run", "determinism_inputs", "place_off",
           "placement", "slot_of"]

GPU_MODES = ("auto", "nvml", "replay", "off")


@dataclass(frozen=True, kw_only=True, slots=True)
class CanaryConfig:
    run_dir: Path
    """Run directory (telemetry, checkpoints, run.json)."""
    steps: int
    """Training steps to run."""
    layout: Layout
    """Parallel layout; its world size is the number of ranks."""
    hosts: int = 1
    """Virtual hosts the ranks are spread over (contiguously)."""
    seed: int = 0
    """Seed of model init, data and RNGs."""
    faults: Faults = field(default_factory=Faults)
    """Faults to inject."""
    checkpoint_every: int = 0
    """Save a checkpoint after every N steps (0 = never)."""
    global_batch: int = 32
    """Samples per step over all data-parallel replicas."""
    microbatches: int = 2
    """Pipeline microbatches per step."""
    lr: float = 1e-3
    """AdamW learning rate."""
    threads: int = 1
    """torch intra-op threads per rank (part of the numerics: keep it fixed to compare runs)."""
    pg_timeout_s: float = 60.0
    """Process-group timeout: how long a peer blocks in a collective with a dead or hung rank."""
    backend: str | None = None
    """torch.distributed backend; None = nccl with CUDA, else gloo."""
    gpu: str = "auto"
    """GPU sampler: auto (NVML if present) | nvml | replay | off."""
    collector: bool = True
    """Embed the collector (False = the no-op collector, for overhead comparisons)."""
    fingerprint_every: int = 50
    """Fingerprint the training state every N steps (0: only the last step and the first step after each
    checkpoint, which replay verification compares)."""
    pin_ddp_buckets: bool = True
    """Fix DDP's gradient buckets at construction (`recovery.determinism.pin_ddp_buckets`): without it the first step
    of every fresh process reduces in another bucket layout, and a resume with dp >= 4 is not bitwise."""
    deterministic_algorithms: bool = False
    """`torch.use_deterministic_algorithms` on every rank (on CUDA a bitwise replay needs it)."""
    grad_norm: bool = True
    """The collector measures each rank's local gradient norm before the all-reduce (off: only for overhead
    breakdowns; the steps table's local_grad_norm is then empty)."""
    flush_interval_s: float = 5.0
    """Collector part-file interval."""
    heartbeat_interval_s: float = 1.0
    """Collector heartbeat interval."""
    gpu_interval_s: float = 1.0
    """GPU sampling period of each rank's collector."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model size."""
    attempt: int = 0
    """Incarnation of this launch in the run directory."""
    resume: bool = False
    """Resume from the newest usable checkpoint in `run_dir` (`recovery.resume`): load it, pass the consistency
    gate, and train from its step + 1 to `steps`."""
    device_shift: int = 0
    """Place local rank l on device slot (l + device_shift) mod slots-per-host: a restart that lands ranks on other
    GPUs of their host (replay device UUIDs follow the slot, so cross-run localization can tell device from rank)."""
    slots_per_host: int = 0
    """Device slots of each virtual host; 0: one per rank of the host. More slots than ranks leave spare devices a
    relaunch can move ranks to, off a quarantined one (`place_off`)."""
    resume_from: str | None = None
    """With `resume`: this checkpoint ('step-XXXXXXXX') instead of the newest usable one (a rollback to before an
    incident's onset); it must be committed, verified and loadable, or the resume fails naming why."""
    pace_s: float = 0.0
    """Every rank computes this much longer per step (a sleep in its forward phase; the numerics are untouched), as a
    bigger model would: the drills pace their small canary so a fault lands mid-run, not after its last step."""
    replay_basis: int | None = None
    """Set by a recovery that undoes a state fault (corruption, divergence) that may have begun at this step: the
    attempts this one replaces are a replay reference only before it (rank 0 records a `replay_basis` event), so
    their corrupted steps are not read as a nondeterministic replay."""
    record_step_times: bool = False
    """Write each rank's step end times (perf_counter ns, measured outside the collector), and its training
    thread's and process's CPU time at each step end, to <run>/step_times/rank-<r>.json: the same clocks for
    collector-on and -off runs, for benchmarks."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.gpu not in GPU_MODES:
            raise ValueError(f"--gpu {self.gpu!r}: valid values are {', '.join(GPU_MODES)}")
        if self.device_shift < 0:
            raise ValueError(f"device shift must be >= 0, got {self.device_shift}")
        if self.pace_s < 0:
            raise ValueError(f"pace must be >= 0 s, got {self.pace_s}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.global_batch % (self.layout.dp * self.microbatches):
            raise ValueError(
                f"global batch {self.global_batch} must be divisible by dp*microbatches={self.layout.dp * self.microbatches}"
            )
        per_host = Hosts(count=self.hosts, world_size=self.layout.world_size).per_host
        if self.slots_per_host and self.slots_per_host < per_host:
            raise ValueError(f"slots per host {self.slots_per_host}: fewer than the {per_host} ranks of each host")
        self.faults.validate(world_size=self.layout.world_size, hosts=self.hosts)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    # ------------------------------------------------------------------ what the recovery side needs (`recovery.job.Job`)

    def declaration(self) -> JobDeclaration:
        return canary_declaration(self.layout)

    def placement(self) -> dict[int, Placement]:
        return placement(self)

    def placed_off(self, *, devices: Collection[str] = (), hosts: Collection[str] = ()
                   ) -> tuple[CanaryConfig, tuple[str, ...]]:
        return place_off(self, devices=devices, hosts=hosts)

    def rotations(self) -> list[CanaryConfig]:
        """The config with every rank moved by k device slots of its host, k = 1 .. slots-1 (`device_shift`)."""
        n = _slots(self)
        return [replace(self, device_shift=(self.device_shift + k) % n) for k in range(1, n)]

    def resized(self, world_size: int) -> CanaryConfig:
        """The canary on `world_size` data-parallel replicas: its global batch is kept and re-split (so dp must
        divide it), only a pure-dp layout. ValueError otherwise."""
        if self.layout.tp != 1 or self.layout.pp != 1:
            raise ValueError(f"layout {self.layout}: tensor and pipeline shapes are fixed; the canary cannot run on "
                             f"{world_size} ranks")
        return replace(self, layout=Layout(dp=world_size))

    def relaunched(self, *, checkpoint: str | None, keep_faults: bool, replay_basis: int | None) -> CanaryConfig:
        """Only the machine's own faults (`Faults.hardware`: a bad device slot, a slow link) are kept unless
        `keep_faults`: the injected ones stood for a transient fault."""
        faults = self.faults if keep_faults else self.faults.hardware()
        return replace(self, replay_basis=replay_basis, faults=faults, resume=checkpoint is not None,
                       resume_from=checkpoint)

    def launch_record(self) -> dict[str, Any]:
        return {
            "started_wall_ns": time.time_ns(),
            "world_size": self.world_size,
            "layout": str(self.layout),
            "hosts": self.hosts,
            "seed": self.seed,
            "steps": self.steps,
            "faults": self.faults.specs(),
            "checkpoint_every": self.checkpoint_every,
            "threads": self.threads,
            "collector": self.collector,
            # the rest of the config, so a recovery manager can relaunch the same job (`config_from_run`)
            "model": dataclasses.asdict(self.model),
            "global_batch": self.global_batch,
            "microbatches": self.microbatches,
            "lr": self.lr,
            "gpu": self.gpu,
            "pg_timeout_s": self.pg_timeout_s,
            "fingerprint_every": self.fingerprint_every,
            "grad_norm": self.grad_norm,
            "flush_interval_s": self.flush_interval_s,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "gpu_interval_s": self.gpu_interval_s,
            "backend": self.backend,
            "resume": self.resume,
            "resume_from": self.resume_from,
            "replay_basis": self.replay_basis,
            "pace_s": self.pace_s,
            "device_shift": self.device_shift,
            "slots_per_host": self.slots_per_host,
            "pin_ddp_buckets": self.pin_ddp_buckets,
            "deterministic_algorithms": self.deterministic_algorithms,
            # what decides the numerics beyond the config: a resume that changes one is CHANGED in the lineage
            DETERMINISM_KEY: determinism_inputs(self).to_dict(),
        }

    @classmethod
    def from_run(cls, run_dir: Path) -> CanaryConfig:
        return config_from_run(run_dir)


def _slots(cfg: CanaryConfig) -> int:
    """Device slots of each virtual host."""
    return cfg.slots_per_host or Hosts(count=cfg.hosts, world_size=cfg.world_size).per_host


def slot_of(cfg: CanaryConfig, rank: int) -> int:
    """The device slot (GPU index) of `rank` on its virtual host."""
    hosts = Hosts(count=cfg.hosts, world_size=cfg.world_size)
    return (hosts.local_rank(rank) + cfg.device_shift) % (cfg.slots_per_host or hosts.per_host)


def placement(cfg: CanaryConfig) -> dict[int, tuple[str, int, str]]:
    """rank -> (virtual host, device slot, that device's UUID in the virtual topology: the replay sampler's)."""
    hosts = Hosts(count=cfg.hosts, world_size=cfg.world_size)
    out = {}
    for rank in range(cfg.world_size):
        host, slot = hosts.host_of(rank), slot_of(cfg, rank)
        out[rank] = (host, slot, replay_uuid(host, slot))
    return out


def place_off(cfg: CanaryConfig, *, devices: Collection[str] = (), hosts: Collection[str] = ()
              ) -> tuple[CanaryConfig, tuple[str, ...]]:
    """`cfg` placed so that no rank is on a quarantined device (UUID) or host of the virtual topology, and one line
    per rank that moved ('rank 1: host0 slot 1 GPU-... -> slot 2 GPU-...'); `cfg` itself when nothing it uses is
    quarantined. The canary moves ranks by one `device_shift` for every host, the nearest one from the current that
    is clear. ValueError naming what is left when nothing is: a quarantined host (every host holds ranks, and the
    canary has no spare host), or no shift clear of the quarantined devices (spares come from `slots_per_host`)."""
    devices, hosts = set(devices), set(hosts)
    now = placement(cfg)
    used_hosts = sorted({h for h, _, _ in now.values()} & hosts)
    if used_hosts:
        raise ValueError(f"host(s) {', '.join(used_hosts)} quarantined, and every virtual host holds ranks (no spare "
                         "host): refusing to place the job")
    if not {u for _, _, u in now.values()} & devices:
        return cfg, ()
    n_slots = _slots(cfg)
    for moved in cfg.rotations():
        there = placement(moved)
        if not {u for _, _, u in there.values()} & devices:
            lines = tuple(f"rank {r}: {h} slot {s} {u} -> slot {there[r][1]} {there[r][2]}"
                          for r, (h, s, u) in now.items() if there[r][1] != s)
            return moved, lines
    names = Hosts(count=cfg.hosts, world_size=cfg.world_size).names
    bad = sorted(devices & {replay_uuid(h, s) for h in names for s in range(n_slots)})
    raise ValueError(f"every placement of {cfg.world_size} rank(s) on {n_slots} slot(s) per host touches a quarantined "
                     f"device ({', '.join(bad)}): nothing is left; refusing to place the job (more slots_per_host "
                     "give it spares)")


def determinism_inputs(cfg: CanaryConfig) -> DeterminismInputs:
    """The determinism inputs the ranks of `cfg` run with (the launcher records them in run.json)."""
    backend = cfg.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return DeterminismInputs.current(threads=cfg.threads, backend=backend,
                                     deterministic_algorithms=cfg.deterministic_algorithms,
                                     buckets_pinned=cfg.pin_ddp_buckets, bucket_cap_mb=DDP_BUCKET_CAP_MB)


def canary_declaration(layout: Layout) -> JobDeclaration:
    """The canary: a pure-dp layout can be resumed at another dp size (a reconfigurable global batch); any tp or pp
    fixes the shapes. Its collectives are in-place all-reduces and its optimizer steps in place: not idempotent.
    It relaunches every process to recover (no live membership change, no in-place retry)."""
    pure_dp = layout.tp == 1 and layout.pp == 1 and layout.dp > 1
    return JobDeclaration(
        membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH if pure_dp else MembershipSupport.FIXED_SHAPES,
        idempotent=Idempotency.NOT_IDEMPOTENT,
    )


def config_from_run(run_dir: Path) -> CanaryConfig:
    """The latest launch's config as <run>/run.json recorded it. Of its faults only the machine's are kept
    (`Faults.hardware()`: a bad device slot, a slow link, which a relaunch on the same machine meets again); an
    attempt's injected faults are not re-injected."""
    run_file = RunDir(Path(run_dir)).run_file
    launches = read_launches(run_dir)
    if not launches:
        raise ValueError(f"{run_file}: records no launch")
    last = launches[-1]
    try:
        faults = Faults.parse(list(last.get("faults", []))).hardware()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{run_file}: launch record's faults unreadable ({exc})") from None
    try:
        return CanaryConfig(
            run_dir=Path(run_dir), steps=int(last["steps"]), layout=Layout.parse(last["layout"], nproc=last["world_size"]),
            hosts=int(last["hosts"]), seed=int(last["seed"]), checkpoint_every=int(last["checkpoint_every"]),
            threads=int(last["threads"]), collector=bool(last["collector"]),
            model=ModelConfig(**last["model"]), global_batch=int(last["global_batch"]),
            microbatches=int(last["microbatches"]), lr=float(last["lr"]), gpu=str(last["gpu"]),
            pg_timeout_s=float(last["pg_timeout_s"]), fingerprint_every=int(last["fingerprint_every"]),
            flush_interval_s=float(last["flush_interval_s"]), heartbeat_interval_s=float(last["heartbeat_interval_s"]),
            gpu_interval_s=float(last["gpu_interval_s"]), backend=last["backend"],
            device_shift=int(last.get("device_shift", 0)), slots_per_host=int(last.get("slots_per_host", 0)),
            grad_norm=bool(last.get("grad_norm", True)),
            pin_ddp_buckets=bool(last.get("pin_ddp_buckets", True)),
            deterministic_algorithms=bool(last.get("deterministic_algorithms", False)),
            pace_s=float(last.get("pace_s", 0.0)), faults=faults,
        )
    except KeyError as exc:
        raise ValueError(f"{run_file}: launch record lacks {exc} (written by an older rankwatch)") from None
    except (TypeError, AttributeError) as exc:  # a value of the wrong shape (e.g. "model": 3)
        raise ValueError(f"{run_file}: launch record of the wrong shape ({exc})") from None
