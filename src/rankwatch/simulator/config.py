"""What to simulate: `SimConfig` (layout, hosts, steps, seed, faults and the knobs of the healthy run), a named
`Scenario`, and `standard_suite`, the labeled benchmark of scenarios covering every incident class and cause at
64..2048 ranks, with clean controls carrying benign variation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

from rankwatch.base.topology import Hosts, Layout
from rankwatch.simulator.faults import (
    Corruption, CorruptionKind, DataSkew, DivergeField, Divergence, FailHow, FailStop, Hang, HostDataloader, SimFault,
    SlowHardware, SlowLink, StageImbalance, SteadyCounters, Straggler, StragglerCause, ThrottleBitOnly,
)


class Timing(StrEnum):
    """Which clock semantics the simulated collector records (base/schema.py, "Which clock carries the signal")."""

    CPU = "cpu"
    """gloo: collectives block the training thread, whose clock sees all the work; device columns are null."""
    GPU = "gpu"
    """CUDA + NCCL: the thread only enqueues, so its collectives take launch latency and every rank's step ends at
    one synchronization point (CPU compute_ns about equal on every rank); the device columns carry the straggler
    signal."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    name: str = "sim"
    """Scenario name written into labels.json."""
    layout: Layout = field(default_factory=lambda: Layout(dp=4, tp=2, pp=2))
    """Parallel layout; its world size is the number of ranks."""
    hosts: int = 4
    """Hosts the ranks fill contiguously."""
    steps: int = 100
    """Training steps."""
    seed: int = 0
    """Seed of every random draw: the same config writes the same telemetry."""
    faults: tuple[SimFault, ...] = ()
    """Faults and benign variations to lay over the healthy run."""
    checkpoint_every: int = 0
    """Checkpoint after every N steps (0 = never): a benign stall on every rank at once."""
    fingerprint_every: int = 50
    """Fingerprint every N steps (and after the last step of a clean run)."""
    compute_s: float = 0.08
    """Nominal per-step compute of one rank (its stage's share)."""
    global_batch: int = 0
    """Samples per step over all replicas (0 = 8 per replica)."""
    pg_timeout_s: float = 10.0
    """How long a peer blocks in a collective with a dead rank before it errors."""
    heartbeat_s: float = 1.0
    """Heartbeat interval."""
    phases: bool = True
    """Write the phases table (data, forward, backward, optimizer per step)."""
    timing: Timing = Timing.CPU
    """Clock semantics of the telemetry (`Timing`); the CPU output does not depend on this field's existence."""

    def __post_init__(self) -> None:
        world = self.layout.world_size
        Hosts(count=self.hosts, world_size=world)
        if self.steps < 2:
            raise ValueError(f"sim {self.name}: steps must be >= 2, got {self.steps}")
        if self.checkpoint_every < 0 or self.fingerprint_every < 1:
            raise ValueError(f"sim {self.name}: checkpoint_every must be >= 0 and fingerprint_every >= 1")
        for f in self.faults:
            for name in ("rank", "ranks"):
                rs = getattr(f, name, None)
                for r in (rs if isinstance(rs, tuple) else () if rs is None else (rs,)):
                    if not 0 <= r < world:
                        raise ValueError(f"sim {self.name}: {type(f).__name__} rank {r} outside world size {world}")
            for name in ("host", "host_a", "host_b"):
                h = getattr(f, name, None)
                if h is not None and not 0 <= h < self.hosts:
                    raise ValueError(f"sim {self.name}: {type(f).__name__} host {h} outside {self.hosts} hosts")
            if isinstance(f, StageImbalance) and not (self.layout.pp > 1 and 0 <= f.stage < self.layout.pp):
                raise ValueError(f"sim {self.name}: stage_imbalance stage {f.stage} needs pp > 1 and a valid stage")
            if isinstance(f, Divergence) and f.replica is not None and not 0 <= f.replica < self.layout.dp:
                raise ValueError(f"sim {self.name}: divergence replica {f.replica} outside dp={self.layout.dp}")
            step = getattr(f, "step", None)
            if step is not None and not 0 < step < self.steps:
                raise ValueError(f"sim {self.name}: {type(f).__name__} step {step} outside 1..{self.steps - 1}")

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def batch(self) -> int:
        return self.global_batch or 8 * self.layout.dp


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    name: str
    config: SimConfig


# ------------------------------------------------------------------------------------------------ suite

_L64, _L128, _L256 = Layout(dp=4, tp=4, pp=4), Layout(dp=8, tp=4, pp=4), Layout(dp=8, tp=8, pp=4)
_L64_DP2, _L1024, _L2048 = Layout(dp=2, tp=8, pp=4), Layout(dp=32, tp=8, pp=4), Layout(dp=64, tp=8, pp=4)
_HOSTS = {64: 8, 128: 16, 256: 32, 1024: 128, 2048: 256}


def _sc(name: str, layout: Layout, steps: int, *faults: SimFault, ckpt: int = 50) -> Scenario:
    seed = int(hashlib.blake2b(name.encode(), digest_size=4).hexdigest(), 16)
    cfg = SimConfig(name=name, layout=layout, hosts=_HOSTS[layout.world_size], steps=steps, seed=seed,
                    faults=faults, checkpoint_every=ckpt)
    return Scenario(name=name, config=cfg)


def standard_suite() -> tuple[Scenario, ...]:
    """The labeled benchmark: every class and cause, 64..2048 ranks, with clean controls carrying benign variation.
    Each scenario runs under either timing (`dataclasses.replace(s.config, timing=Timing.GPU)`)."""
    S, D, T = Straggler, Divergence, StragglerCause
    C, K, F = Corruption, CorruptionKind, FailHow
    return (
        # single-rank stragglers: subtle persistent, late, intermittent, transient, throttled, dataloader
        _sc("straggler_5pct_64", _L64, 200, S(rank=13, from_step=80, slow=0.05)),
        _sc("straggler_8pct_128", _L128, 200, S(rank=70, from_step=60, slow=0.08)),
        _sc("straggler_12pct_256", _L256, 150, S(rank=201, from_step=50, slow=0.12)),
        _sc("straggler_20pct_64", _L64, 150, S(rank=40, from_step=30, slow=0.20), SlowHardware(rank=3)),
        _sc("straggler_late_onset_128", _L128, 300, S(rank=99, from_step=250, slow=0.10)),
        _sc("straggler_late_onset_64", _L64, 300, S(rank=5, from_step=270, slow=0.08), ckpt=0),
        _sc("straggler_burst_64", _L64, 200, S(rank=22, from_step=40, slow=0.30, period=20, burst=5)),
        _sc("straggler_burst_256", _L256, 200, S(rank=130, from_step=60, slow=0.20, period=10, burst=3)),
        _sc("straggler_transient_128", _L128, 200, S(rank=17, from_step=50, until_step=150, slow=0.15)),
        _sc("straggler_thermal_64", _L64, 150, S(rank=9, from_step=40, slow=0.25, cause=T.THERMAL)),
        _sc("straggler_thermal_burst_128", _L128, 200, S(rank=64, from_step=50, slow=0.3, period=25, burst=8,
                                                         cause=T.THERMAL)),
        _sc("straggler_power_128", _L128, 150, S(rank=31, from_step=70, slow=0.15, cause=T.POWER)),
        _sc("straggler_dataloader_64", _L64, 150, S(rank=50, from_step=60, slow=0.30, cause=T.DATALOADER)),
        _sc("straggler_dataloader_256", _L256, 150, S(rank=255, from_step=40, slow=0.15, cause=T.DATALOADER)),
        # a host-thread stall in forward (the trainer's `slow` fault): on the device clock told apart from a slow GPU
        _sc("straggler_host_stall_64", _L64, 150, S(rank=29, from_step=50, slow=0.15, cause=T.HOST_STALL)),
        _sc("straggler_host_stall_128", _L128, 200, S(rank=90, from_step=60, slow=0.10, cause=T.HOST_STALL)),
        _sc("straggler_1024", _L1024, 120, S(rank=517, from_step=60, slow=0.10)),
        _sc("straggler_2048", _L2048, 100, S(rank=1999, from_step=50, slow=0.15), ckpt=0),
        # host input pipeline, slow link, imbalance
        _sc("host_dataloader_64", _L64, 150, HostDataloader(host=3, from_step=50, slow=0.3)),
        _sc("host_dataloader_256", _L256, 150, HostDataloader(host=10, from_step=70, slow=0.2)),
        _sc("slow_link_64", _L64, 150, SlowLink(host_a=0, host_b=1, from_step=50, factor=4.0)),
        _sc("slow_link_128", _L128, 150, SlowLink(host_a=2, host_b=3, from_step=60, factor=3.0)),
        # a link between pipeline stages: point-to-point traffic pins it down exactly
        _sc("slow_link_p2p_256", _L256, 150, SlowLink(host_a=2, host_b=10, from_step=70, factor=2.0)),
        _sc("stage_imbalance_64", _L64, 150, StageImbalance(stage=2, factor=1.3)),
        _sc("stage_imbalance_256", _L256, 150, StageImbalance(stage=0, factor=1.2, from_step=40)),
        _sc("data_skew_64", _L64, 150, DataSkew(extra=0.3)),
        _sc("data_skew_128", _L128, 150, DataSkew(extra=0.25, count=2)),
        # pure data parallelism: every replica one rank, told from per-rank noise by the batches' tokens only
        _sc("data_skew_dp64", Layout(dp=64), 150, DataSkew(extra=0.3)),
        # fail-stop
        _sc("fail_exit_64", _L64, 150, FailStop(rank=11, step=90, how=F.EXIT)),
        _sc("fail_exit_in_collective_128", _L128, 150, FailStop(rank=77, step=80, how=F.EXIT, in_collective=True)),
        _sc("fail_sigkill_64", _L64, 150, FailStop(rank=60, step=70, how=F.SIGNAL, signal=9)),
        _sc("fail_sigterm_128", _L128, 150, FailStop(rank=3, step=100, how=F.SIGNAL, signal=15)),
        _sc("fail_vanished_256", _L256, 150, FailStop(rank=144, step=75, how=F.VANISHED)),
        _sc("fail_killed_all_64", _L64, 150, FailStop(rank=33, step=60, how=F.KILLED_ALL)),
        _sc("fail_killed_all_256", _L256, 120, FailStop(rank=200, step=90, how=F.KILLED_ALL)),
        _sc("fail_vanished_1024", _L1024, 100, FailStop(rank=1000, step=70, how=F.VANISHED), ckpt=0),
        # hangs
        _sc("hang_64", _L64, 150, Hang(rank=21, step=80)),
        _sc("hang_killed_128", _L128, 150, Hang(rank=100, step=90, killed=True)),
        _sc("hang_256", _L256, 120, Hang(rank=7, step=60)),
        _sc("hang_killed_1024", _L1024, 100, Hang(rank=300, step=50, killed=True), ckpt=0),
        # divergence
        _sc("div_rng_rank_64", _L64, 200, D(ranks=(18,), step=100, field=DivergeField.RNG)),
        _sc("div_data_rank_128", _L128, 200, D(ranks=(45,), step=50, field=DivergeField.DATA)),
        _sc("div_step_rank_64", _L64, 200, D(ranks=(6,), step=150, field=DivergeField.STEP)),
        _sc("div_rng_replica_64", _L64, 200, D(replica=1, step=100, field=DivergeField.RNG)),
        _sc("div_data_replica_128", _L128, 200, D(replica=6, step=100, field=DivergeField.DATA)),
        _sc("div_two_replica_domain_64", _L64_DP2, 200, D(ranks=(9,), step=100, field=DivergeField.RNG)),
        _sc("div_two_replica_job_64", _L64_DP2, 200, D(replica=1, step=50, field=DivergeField.DATA)),
        _sc("div_rng_rank_2048", _L2048, 100, D(ranks=(1234,), step=50, field=DivergeField.RNG), ckpt=0),
        # corruption
        _sc("bitflip_64", _L64, 200, C(rank=27, step=100, kind=K.BITFLIP_PARAM)),
        _sc("bitflip_hw_128", _L128, 200, C(rank=88, step=50, kind=K.BITFLIP_PARAM, hardware=True)),
        _sc("nan_64", _L64, 150, C(rank=55, step=90, kind=K.NAN)),
        _sc("nan_hw_128", _L128, 150, C(rank=12, step=70, kind=K.NAN, hardware=True)),
        _sc("grad_spike_64", _L64, 150, C(rank=14, step=80, kind=K.GRAD_SPIKE, factor=50.0)),
        _sc("grad_spike_hw_256", _L256, 150, C(rank=222, step=100, kind=K.GRAD_SPIKE, factor=200.0, hardware=True)),
        _sc("grad_spike_burst_128", _L128, 150, C(rank=5, step=60, kind=K.GRAD_SPIKE, factor=20.0, duration=3)),
        _sc("grad_spike_1024", _L1024, 100, C(rank=640, step=60, kind=K.GRAD_SPIKE, factor=100.0), ckpt=0),
        # clean controls, each with benign variation
        _sc("clean_ckpt_64", _L64, 200),
        _sc("clean_slow_hw_128", _L128, 200, SlowHardware(rank=42)),
        _sc("clean_throttle_bit_256", _L256, 150, ThrottleBitOnly(rank=100)),
        _sc("clean_counters_64", _L64, 200, SteadyCounters(rank=7)),
        _sc("clean_all_benign_128", _L128, 200, SlowHardware(rank=1), ThrottleBitOnly(rank=66),
            SteadyCounters(rank=90), ckpt=25),
        _sc("clean_slow_hw_throttle_256", _L256, 150, SlowHardware(rank=250), ThrottleBitOnly(rank=250)),
        _sc("clean_dp2_64", _L64_DP2, 200, SteadyCounters(rank=30, sbe=3, pcie_replay=40)),
        _sc("clean_long_64", _L64, 300, SlowHardware(rank=63, slow=0.02), ckpt=100),
        _sc("clean_1024", _L1024, 100, SlowHardware(rank=512), SteadyCounters(rank=3)),
        _sc("clean_2048", _L2048, 100, ThrottleBitOnly(rank=2047), ckpt=40),
        _sc("clean_counters_throttle_128", _L128, 150, SteadyCounters(rank=127), ThrottleBitOnly(rank=0)),
    )
