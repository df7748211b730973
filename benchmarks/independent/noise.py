"""The healthy job and its benign variation: what every run carries before any phenomenon is laid over it.

Noise model (none of it iid gaussian per rank and step):

- device spread: each device has a fixed speed (lognormal, sigma 0.6 %), for the whole run;
- batch content: every step each data-parallel replica draws one shared factor (gamma: sequence lengths), so all
  ranks of a replica are slow together; small unless the scenario is a data-skew one;
- per rank and step: a Student-t (3 degrees of freedom) residual, and rare one-off spikes (+10..60 %);
- per host: a slow AR(1) drift (noisy neighbours), and an AR(1) factor on the input pipeline;
- global hiccups: a few steps where every rank's work, or the network, is slower together;
- warm-up: the first steps slower (compilation, autotuning), decaying;
- clocks: wall-clock offsets between hosts (milliseconds, or hundreds in a skew scenario), unrelated monotonic
  origins per host, heartbeat and sampler jitter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .timeline import Death, Plan
from .world import World


@dataclass(slots=True)
class Hardware:
    """What NVML reports per device and step (the sampler interpolates it at its sample times)."""

    clock: np.ndarray
    """(S, N) SM clock as a fraction of the maximum."""
    bits: np.ndarray
    """(S, N) int throttle-reason bitmask."""
    temp: np.ndarray
    """(S, N) temperature, °C."""
    power_frac: np.ndarray
    """(S, N) board power as a fraction of the limit."""
    sbe_agg0: np.ndarray
    """(N,) corrected ECC errors over the device's life, at the run's start."""
    sbe_new: np.ndarray
    """(S, N) new corrected errors during step s (volatile and aggregate both grow)."""
    dbe_new: np.ndarray
    """(S, N) new uncorrected errors during step s."""
    remap_new: np.ndarray
    """(S, N) rows remapped for correctable errors during step s."""
    xid: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(step, rank) -> XID codes reported during that step."""
    max_mhz: int = 1980
    mem_mhz: int = 2619
    power_limit_w: float = 700.0


@dataclass(slots=True)
class Numerics:
    """Loss, local gradient norms and the state fingerprints (what replicas must agree on)."""

    loss: np.ndarray
    """(S, dp) loss of each replica (the last stage reports it)."""
    gnorm: np.ndarray
    """(S, N) local gradient norm before the all-reduce."""
    fp_every: int
    global_batch: int
    salt: dict[str, np.ndarray] = field(default_factory=dict)
    """fingerprint field -> (N,) first step from which the rank's value differs from its domain's (-1: never)."""
    fp_step_offset: tuple[np.ndarray, int] | None = None
    """((N,) offset added to the step the rank fingerprints, from this step on)."""
    dpos_offset: tuple[np.ndarray, int] | None = None
    non_finite_loss: list[tuple[int, int, int]] = field(default_factory=list)
    """(rank, first step, steps): the rank's loss (where it has one) is non-finite for those steps."""


@dataclass(slots=True)
class Ending:
    """How the run ends: normally, or a rank fails or hangs, or the launcher kills every rank."""

    kind: str = "ok"
    """ok | fail | hang | kill"""
    cause: str = ""
    """fail: exit | signal | exception | vanished; kill: sigkill | sigterm; hang: collective | step."""
    rank: int = -1
    timeout_s: float = 60.0
    """Process-group timeout (peers of a vanished rank raise after it; with a closed socket they raise at once)."""
    tail_s: float = 90.0
    """Hang: seconds the run is observed stuck before the telemetry is read."""
    message: str = ""
    exc_type: str = "RuntimeError"


@dataclass(slots=True)
class Draw:
    world: World
    plan: Plan
    hw: Hardware
    num: Numerics
    ending: Ending
    wall_offset: np.ndarray
    """(hosts,) wall − true clock, seconds."""
    mono_origin: np.ndarray
    """(hosts,) true time minus monotonic clock, seconds."""
    t0_wall_s: float
    labels: list[dict[str, object]] = field(default_factory=list)
    benign: list[str] = field(default_factory=list)
    ntp_step: tuple[int, int, float] | None = None
    """(host, step, seconds): the host's wall clock jumps by `seconds` at the start of `step`."""


def _ar1(rng: np.random.Generator, steps: int, k: int, rho: float, sigma: float) -> np.ndarray:
    e = rng.normal(0.0, sigma * np.sqrt(1 - rho**2), size=(steps, k))
    out = np.empty_like(e)
    out[0] = rng.normal(0.0, sigma, size=k)
    for s in range(1, steps):
        out[s] = rho * out[s - 1] + e[s]
    return out


def healthy(world: World, steps: int, timing: str, rng: np.random.Generator, *, skew_cv: float = 0.0) -> Draw:
    """A healthy run with benign variation; `skew_cv` > 0 makes per-replica batch content the dominant spread."""
    n, S, D = world.n, steps, world.dp
    base = float(rng.uniform(0.25, 0.9))
    device_speed = np.clip(rng.lognormal(0.0, 0.006, size=n), 0.98, 1.02)
    cv = skew_cv if skew_cv > 0 else float(rng.uniform(0.006, 0.02))
    k = 1.0 / cv**2
    replica = rng.gamma(k, 1.0 / k, size=(S, D))
    resid = 1.0 + np.clip(rng.standard_t(3, size=(S, n)) * 0.0035, -0.03, 0.08)
    host_drift = np.exp(_ar1(rng, S, world.n_hosts, 0.97, 0.004))[:, world.host_index]
    work = base * device_speed[None, :] * replica[:, world.dp_of] * resid * host_drift
    spikes = rng.random((S, n)) < 4e-4
    work = np.where(spikes, work * rng.uniform(1.1, 1.6, size=(S, n)), work)
    warm = int(rng.integers(2, 7))
    amp = float(rng.uniform(0.8, 3.0))
    decay = np.exp(-np.arange(S) / max(1.0, warm / 2))[:, None]
    work = work * (1.0 + amp * decay * (np.arange(S)[:, None] < warm))
    net = np.ones(S)
    hiccup = rng.random(S) < 0.02
    hiccup[:warm] = False
    net[hiccup] = rng.uniform(1.5, 4.0, size=int(hiccup.sum()))
    slow_all = rng.random(S) < 0.015
    slow_all[:warm] = False
    work[slow_all] *= rng.uniform(1.04, 1.2, size=(int(slow_all.sum()), 1))

    dl_med = float(rng.uniform(0.5e-3, 3e-3))
    host_pipe = np.exp(_ar1(rng, S, world.n_hosts, 0.9, 0.25))[:, world.host_index]
    dl = dl_med * rng.lognormal(0.0, 0.5, size=(S, n)) * host_pipe
    dl_spike = rng.random((S, n)) < 1.5e-3
    dl = np.where(dl_spike, dl + rng.uniform(0.02, 0.08, size=(S, n)), dl)

    plan = Plan(
        world=world, steps=S, timing=timing, base_work_s=base, work=work, fwd_stall=np.zeros((S, n)), dl_wait=dl,
        stage_mult=np.ones(world.pp), net_mult=net,
        tp_bytes=int(rng.choice([16, 32, 64, 128])) << 20,
        dp_bytes=int(rng.uniform(100, 900)) << 20,
        pp_bytes=int(rng.choice([8, 16, 32, 64])) << 20,
        intra_bw=float(rng.uniform(150e9, 300e9)),
        inter_bw=float(rng.uniform(12e9, 45e9)),
        fwd_frac=float(rng.uniform(0.28, 0.36)),
        opt_frac=float(rng.uniform(0.04, 0.09)),
    )
    benign = [f"warm-up: the first {warm} steps up to {1 + amp:.1f}x slower"]
    if hiccup.any():
        benign.append(f"global network hiccups on {int(hiccup.sum())} steps (every group's transfers 1.5-4x slower)")
    if slow_all.any():
        benign.append(f"global compute hiccups on {int(slow_all.sum())} steps (every rank 4-20 % slower together)")
    if spikes.any():
        benign.append(f"{int(spikes.sum())} one-off noisy rank-steps (+10..60 %)")
    if dl_spike.any():
        benign.append(f"{int(dl_spike.sum())} one-off input-pipeline hiccups (20-80 ms)")

    temp = rng.normal(60.0, 4.0, size=n)[None, :] + rng.normal(0, 0.8, size=(S, n)) + 6 * (work / base - 1).clip(0, 1)
    hw = Hardware(
        clock=np.clip(1.0 - np.abs(rng.normal(0, 0.004, size=(S, n))), 0.97, 1.0),
        bits=np.zeros((S, n), dtype=np.int64),
        temp=temp,
        power_frac=np.clip(rng.normal(0.78, 0.05, size=n)[None, :] + rng.normal(0, 0.02, size=(S, n)), 0.4, 0.99),
        sbe_agg0=np.zeros(n, dtype=np.int64),
        sbe_new=np.zeros((S, n), dtype=np.int64),
        dbe_new=np.zeros((S, n), dtype=np.int64),
        remap_new=np.zeros((S, n), dtype=np.int64),
    )
    gb = int(rng.choice([256, 512, 1024, 2048]))
    fp_every = int(rng.choice([5, 10, 10, 20])) if S >= 150 else int(rng.choice([5, 10]))
    s_axis = np.arange(S, dtype=float)[:, None]
    loss_curve = 2.2 + 8.0 * (s_axis + 20.0) ** -0.45
    loss = loss_curve * (1.0 + 0.015 * (replica - 1.0) / max(cv, 1e-3) * 0.5 + rng.normal(0, 0.01, size=(S, D)))
    shard = rng.uniform(0.6, 1.4, size=world.pp * world.tp)[world.pp_of * world.tp + world.tp_of]
    g_curve = 1.8 * (s_axis + 5.0) ** -0.2 * np.exp(_ar1(rng, S, 1, 0.8, 0.08))
    gnorm = g_curve * shard[None, :] * rng.lognormal(0.0, 0.04, size=(S, n)) * replica[:, world.dp_of] ** 0.5
    num = Numerics(loss=loss, gnorm=gnorm, fp_every=fp_every, global_batch=gb)

    hosts = world.n_hosts
    wall_offset = rng.normal(0.0, 0.002, size=hosts)
    mono_origin = rng.uniform(2e3, 4e6, size=hosts)
    t0 = 1.76e9 + float(rng.uniform(0, 3e7))
    return Draw(world=world, plan=plan, hw=hw, num=num, ending=Ending(), wall_offset=wall_offset,
                mono_origin=mono_origin, t0_wall_s=t0, benign=benign)


def add_benign(draw: Draw, rng: np.random.Generator, *, heavy: bool = False) -> None:
    """Lay a random subset of benign events over a run (all of them, with `heavy`); each is described in
    `draw.benign`."""
    w, p, hw = draw.world, draw.plan, draw.hw
    S, n = p.steps, w.n
    pick = (lambda prob: True) if heavy else (lambda prob: bool(rng.random() < prob))
    if pick(0.5):
        p.ckpt_every = int(rng.choice([25, 40, 50]))
        p.ckpt_write_s = float(rng.uniform(1.5, 12.0))
        draw.benign.append(f"checkpoint every {p.ckpt_every} steps: every rank stalls ~{p.ckpt_write_s:.1f} s at once")
    if pick(0.35):
        a = int(rng.integers(S // 4, S // 2))
        b = min(S, a + int(rng.integers(15, 40)))
        f = float(rng.uniform(1.08, 1.25))
        p.work[a:b] *= f
        draw.benign.append(f"global slowdown steps {a}-{b - 1}: every rank {100 * (f - 1):.0f} % slower together")
        if pick(0.5):
            hw.bits[a:b] |= 0x4
            hw.clock[a:b] *= 0.97
            hw.power_frac[a:b] = 0.99
            draw.benign.append(f"brief power-cap bit (0x4) on every device during steps {a}-{b - 1}")
    if pick(0.3):
        big = rng.choice(w.n_hosts, size=max(1, w.n_hosts // 4), replace=False)
        draw.wall_offset[big] += rng.uniform(-0.4, 0.4, size=len(big))
        draw.benign.append(f"wall-clock skew: {len(big)} hosts off by up to 400 ms")
    if pick(0.2):
        h = int(rng.integers(w.n_hosts))
        draw.ntp_step = (h, int(rng.integers(S // 3, 2 * S // 3)), float(rng.uniform(-0.2, 0.2)))
        draw.benign.append(f"NTP step on {w.hosts[h]}: its wall clock jumps {draw.ntp_step[2] * 1e3:.0f} ms mid-run")
    if pick(0.4):
        r = int(rng.integers(n))
        f = float(rng.uniform(1.02, 1.03))
        p.work[:, r] *= f
        draw.benign.append(f"slowest healthy device: rank {r} {100 * (f - 1):.1f} % slower all run, no hardware flags")
    if pick(0.3):
        r = int(rng.integers(n))
        hw.sbe_agg0[r] = int(rng.integers(1, 4))
        draw.benign.append(f"rank {r}'s GPU logged {hw.sbe_agg0[r]} corrected ECC error(s) long ago (aggregate only)")
    if pick(0.3):
        r = int(rng.integers(n))
        hw.temp[:, r] += float(rng.uniform(14, 20))
        draw.benign.append(f"rank {r}'s GPU runs hot (~{hw.temp[:, r].mean():.0f} °C) without throttling")
    if pick(0.25):
        r = int(rng.integers(n))
        s = int(rng.integers(S // 5, S))
        p.work[s, r] *= float(rng.uniform(2.0, 4.0))
        draw.benign.append(f"one very slow step on rank {r} (step {s}, 2-4x)")


def death(rank: int, step: int, where: str, frac: float, stuck_only: bool = False) -> Death:
    return Death(rank=rank, step=step, where=where, frac=frac, stuck_only=stuck_only)
