"""The phenomena a scenario lays over a healthy run, each with its label.

Every function takes the run's `Draw` and a generator, changes the plan, the hardware or the numerics, and appends
the labels it is responsible for. `KINDS` maps a phenomenon name to its function; `NEEDS` says what a layout must have
for it (data-parallel replicas, pipeline stages, tensor parallelism, links between hosts).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .noise import Draw
from .timeline import Death

Label = dict[str, object]


def _label(draw: Draw, cls: str, kind: str, subject: str, ranks: list[int], onset: int, cause: str,
           **extra: object) -> None:
    draw.labels.append({"class": cls, "subject_kind": kind, "subject": subject, "ranks": sorted(int(r) for r in ranks),
                        "onset_step": int(onset), "cause": cause, **extra})


def _onset(draw: Draw, rng: np.random.Generator, lo: float = 0.15, hi: float = 0.55) -> int:
    S = draw.plan.steps
    return int(rng.integers(max(8, int(lo * S)), max(9, int(hi * S))))


def _rank(draw: Draw, rng: np.random.Generator) -> int:
    return int(rng.integers(draw.world.n))


def _slow_cause(draw: Draw, mechanism: str) -> str:
    """On gloo the thread's clock holds device and host work alike: the evidence cannot tell them apart."""
    if draw.plan.timing == "cpu":
        return "unknown"
    return {"device": "device_slow", "host": "host_stall"}[mechanism]


def _slow(draw: Draw, rng: np.random.Generator, rank: int, steps: np.ndarray | slice, mag: float, mechanism: str) -> None:
    p = draw.plan
    if mechanism == "device":
        p.work[steps, rank] *= 1.0 + mag
    else:  # host-side: a stall inside forward, exponential per step around its mean
        k = len(range(p.steps)[steps]) if isinstance(steps, slice) else int(np.sum(steps))
        p.fwd_stall[steps, rank] += mag * p.base_work_s * rng.exponential(1.0, size=k).clip(0.2, 4.0)


# -- stragglers ----------------------------------------------------------------------------------------------------
def straggler_persistent(draw: Draw, rng: np.random.Generator) -> None:
    r, s0 = _rank(draw, rng), _onset(draw, rng)
    mag = float(np.exp(rng.uniform(np.log(0.03), np.log(0.5))))
    mech = str(rng.choice(["device", "host"]))
    _slow(draw, rng, r, slice(s0, None), mag, mech)
    _label(draw, "straggler", "rank", str(r), [r], s0, _slow_cause(draw, mech), magnitude=round(mag, 3))


def straggler_subtle(draw: Draw, rng: np.random.Generator) -> None:
    r, s0 = _rank(draw, rng), _onset(draw, rng, 0.1, 0.3)
    mag = float(rng.uniform(0.05, 0.08))
    _slow(draw, rng, r, slice(s0, None), mag, "device")
    _label(draw, "straggler", "rank", str(r), [r], s0, _slow_cause(draw, "device"), magnitude=round(mag, 3))


def straggler_intermittent(draw: Draw, rng: np.random.Generator) -> None:
    r, s = _rank(draw, rng), _onset(draw, rng, 0.1, 0.3)
    S, mag = draw.plan.steps, float(rng.uniform(0.25, 0.8))
    mask = np.zeros(S, bool)
    first = s
    while s < S:
        length = int(rng.integers(3, 9))
        mask[s:s + length] = True
        s += length + int(rng.integers(8, 30))
    mech = str(rng.choice(["device", "host"]))
    _slow(draw, rng, r, mask, mag, mech)
    _label(draw, "straggler", "rank", str(r), [r], first, _slow_cause(draw, mech), magnitude=round(mag, 3),
           intermittent=True)


def straggler_two_in_stage(draw: Draw, rng: np.random.Generator) -> None:
    w = draw.world
    k = int(rng.integers(w.pp))
    d1, d2 = rng.choice(w.dp, size=2, replace=False)
    s0 = _onset(draw, rng)
    for d in (d1, d2):
        r = w.rank_of(k, int(d), int(rng.integers(w.tp)))
        mag = float(rng.uniform(0.1, 0.4))
        _slow(draw, rng, r, slice(s0, None), mag, "device")
        _label(draw, "straggler", "rank", str(r), [r], s0, _slow_cause(draw, "device"), magnitude=round(mag, 3))


def straggler_host_stall(draw: Draw, rng: np.random.Generator) -> None:
    r, s0 = _rank(draw, rng), _onset(draw, rng)
    mag = float(rng.uniform(0.08, 0.4))
    _slow(draw, rng, r, slice(s0, None), mag, "host")
    _label(draw, "straggler", "rank", str(r), [r], s0, _slow_cause(draw, "host"), magnitude=round(mag, 3))


def straggler_dataloader_rank(draw: Draw, rng: np.random.Generator) -> None:
    r, s0 = _rank(draw, rng), _onset(draw, rng)
    p = draw.plan
    mag = float(rng.uniform(0.1, 0.6))
    p.dl_wait[s0:, r] += mag * p.base_work_s * rng.lognormal(0.0, 0.4, size=p.steps - s0)
    _label(draw, "straggler", "rank", str(r), [r], s0, "dataloader", magnitude=round(mag, 3))


def straggler_dataloader_host(draw: Draw, rng: np.random.Generator) -> None:
    w, p = draw.world, draw.plan
    h, s0 = int(rng.integers(w.n_hosts)), _onset(draw, rng)
    ranks = w.ranks_of_host(h)
    mag = float(rng.uniform(0.1, 0.5))
    shared = mag * p.base_work_s * rng.lognormal(0.0, 0.3, size=(p.steps - s0, 1))
    p.dl_wait[s0:, ranks] += shared * rng.lognormal(0.0, 0.1, size=(p.steps - s0, len(ranks)))
    _label(draw, "straggler", "host", w.hosts[h], ranks, s0, "dataloader", magnitude=round(mag, 3))


def _throttle(draw: Draw, rng: np.random.Generator, cause: str) -> None:
    """A device whose clocks drop with NVML reasons set: its work grows as its clock falls."""
    w, p, hw = draw.world, draw.plan, draw.hw
    r, s0 = _rank(draw, rng), _onset(draw, rng)
    S = p.steps
    loss = float(rng.uniform(0.15, 0.4)) if cause != "hw_slowdown" else float(rng.uniform(0.3, 0.55))
    ramp = np.clip((np.arange(S) - s0) / max(1, int(rng.integers(3, 15))), 0, 1)
    if cause == "thermal_throttle":
        hw.temp[:, r] += ramp * (float(rng.uniform(89, 94)) - hw.temp[:, r].mean())
        on = (ramp > 0.6) & (rng.random(S) < 0.9)
        bit = int(rng.choice([0x20, 0x40, 0x60]))
    elif cause == "power_throttle":
        on = (np.arange(S) >= s0) & (rng.random(S) < 0.9)
        hw.power_frac[on, r] = rng.uniform(0.97, 1.0, size=int(on.sum()))
        bit = int(rng.choice([0x4, 0x80, 0x84]))
    else:
        on = np.arange(S) >= s0
        bit = 0x8
    s0 = int(np.argmax(on)) if on.any() else s0
    hw.bits[on, r] |= bit
    hw.clock[on, r] = (1.0 - loss) * rng.uniform(0.97, 1.0, size=int(on.sum()))
    p.work[on, r] *= (1.0 / hw.clock[on, r]) ** 0.85
    _label(draw, "straggler", "device", w.uuids[r], [r], s0, cause, device_fault=True, device=w.uuids[r],
           magnitude=round(float((1 / (1 - loss)) ** 0.85 - 1), 3))


def straggler_thermal(draw: Draw, rng: np.random.Generator) -> None:
    _throttle(draw, rng, "thermal_throttle")


def straggler_power(draw: Draw, rng: np.random.Generator) -> None:
    _throttle(draw, rng, "power_throttle")


def device_hw_slowdown(draw: Draw, rng: np.random.Generator) -> None:
    _throttle(draw, rng, "hw_slowdown")


# -- imbalance ------------------------------------------------------------------------------------------------------
def imbalance_data_skew(draw: Draw, rng: np.random.Generator) -> None:
    """Set by `noise.healthy(skew_cv=...)`: the replicas' batch content is the dominant spread."""
    _label(draw, "imbalance", "job", "job", list(range(draw.world.n)), 0, "data_skew")


def imbalance_stage(draw: Draw, rng: np.random.Generator) -> None:
    w = draw.world
    k = int(rng.integers(w.pp))
    f = float(rng.uniform(1.15, 1.6))
    draw.plan.stage_mult[k] = f
    _label(draw, "imbalance", "stage", f"pp={k}", [int(r) for r in np.where(w.pp_of == k)[0]], 0,
           "stage_imbalance", magnitude=round(f - 1, 3))


# -- slow links -----------------------------------------------------------------------------------------------------
def _slow_link(draw: Draw, rng: np.random.Generator, intermittent: bool) -> None:
    w, p = draw.world, draw.plan
    links = w.inter_host_links()
    link = str(rng.choice(links))
    s0 = _onset(draw, rng)
    S = p.steps
    f = np.ones(S)
    factor = float(rng.uniform(0.2, 0.55))
    if intermittent:
        s = s0
        while s < S:
            on = int(rng.integers(4, 15))
            f[s:s + on] = factor
            s += on + int(rng.integers(6, 25))
    else:
        f[s0:] = factor
    p.link_bw[link] = f
    a, b = link.split("<->")
    ranks = w.ranks_of_host(w.hosts.index(a)) + w.ranks_of_host(w.hosts.index(b))
    _label(draw, "straggler", "link", link, ranks, s0, "slow_link", bandwidth_factor=round(factor, 3),
           indistinguishable=w.indistinguishable_links(link), **({"intermittent": True} if intermittent else {}))


def slow_link_persistent(draw: Draw, rng: np.random.Generator) -> None:
    _slow_link(draw, rng, False)


def slow_link_intermittent(draw: Draw, rng: np.random.Generator) -> None:
    _slow_link(draw, rng, True)


# -- fail-stop, hangs, freezes --------------------------------------------------------------------------------------
_WHERE = ("forward", "backward", "optimizer")


def _ops_of(draw: Draw) -> list[str]:
    w = draw.world
    keys = []
    if w.tp > 1:
        keys += ["tp_fwd", "tp_bwd"]
    if w.dp > 1:
        keys.append("dp_grad")
    if w.tp * w.pp > 1:
        keys.append("mp_norm")
    return keys


def _fail(draw: Draw, rng: np.random.Generator, cause: str, *, in_op: bool | None = None) -> None:
    r, F = _rank(draw, rng), _onset(draw, rng, 0.3, 0.85)
    if in_op is None:
        in_op = bool(rng.random() < 0.4)
    where = str(rng.choice(_ops_of(draw))) if in_op else str(rng.choice(_WHERE))
    draw.plan.death = Death(rank=r, step=F, where=where, frac=float(rng.uniform(0.1, 0.9)))
    e = draw.ending
    e.kind, e.cause, e.rank = "fail", cause, r
    e.timeout_s = float(rng.choice([30.0, 60.0, 120.0]))
    if cause == "exception":
        e.exc_type, e.message = [
            ("RuntimeError", "CUDA error: an illegal memory access was encountered"),
            ("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"),
            ("ValueError", "batch has an unexpected shape"),
        ][int(rng.integers(3))]
    _label(draw, "fail_stop", "rank", str(r), [r], F, cause, where=where)


def failstop_exit(draw: Draw, rng: np.random.Generator) -> None:
    _fail(draw, rng, "exit")


def failstop_signal(draw: Draw, rng: np.random.Generator) -> None:
    _fail(draw, rng, "signal")


def failstop_exception(draw: Draw, rng: np.random.Generator) -> None:
    _fail(draw, rng, "exception")


def failstop_vanished(draw: Draw, rng: np.random.Generator) -> None:
    """A rank that disappears without a trace (host lost, or SIGKILL): no exit event; about half of them die
    outside any collective, so they leave no in-flight row either."""
    _fail(draw, rng, "vanished")


def failstop_launcher_kill(draw: Draw, rng: np.random.Generator) -> None:
    """The launcher kills every rank at once. Label convention: one fail_stop label, subject job, ranks = every
    rank, cause signal (an outside kill; with SIGKILL no rank records it, with SIGTERM every rank does)."""
    F = _onset(draw, rng, 0.3, 0.85)
    e = draw.ending
    e.kind, e.cause = "kill", str(rng.choice(["sigkill", "sigkill", "sigterm"]))
    draw.plan.steps = F + 1
    e.rank = -1
    _label(draw, "fail_stop", "job", "job", list(range(draw.world.n)), F, "signal", how=e.cause)


def hang_collective(draw: Draw, rng: np.random.Generator) -> None:
    r, F = _rank(draw, rng), _onset(draw, rng, 0.3, 0.85)
    where = str(rng.choice(_ops_of(draw)))
    draw.plan.death = Death(rank=r, step=F, where=where, frac=0.5, stuck_only=True)
    e = draw.ending
    e.kind, e.cause, e.rank = "hang", "collective", r
    e.tail_s = float(rng.uniform(45, 150))
    _label(draw, "hang", "rank", str(r), [r], F, "stuck_in_collective", where=where)


def hang_step(draw: Draw, rng: np.random.Generator) -> None:
    r, F = _rank(draw, rng), _onset(draw, rng, 0.3, 0.85)
    where = str(rng.choice(_WHERE))
    draw.plan.death = Death(rank=r, step=F, where=where, frac=float(rng.uniform(0.1, 0.9)))
    e = draw.ending
    e.kind, e.cause, e.rank = "hang", "step", r
    e.tail_s = float(rng.uniform(45, 150))
    _label(draw, "hang", "rank", str(r), [r], F, "stuck_in_step", where=where)


def transient_freeze(draw: Draw, rng: np.random.Generator) -> None:
    """SIGSTOP/SIGCONT-like: every thread of the rank stops (no heartbeats, no samples), then it carries on.
    Label convention: class hang, cause stuck_in_step, "transient": true, "duration_s" the freeze."""
    r, F = _rank(draw, rng), _onset(draw, rng, 0.2, 0.8)
    sec = float(rng.uniform(15.0, 25.0))
    draw.plan.freeze = (r, F, sec)
    _label(draw, "hang", "rank", str(r), [r], F, "stuck_in_step", transient=True, duration_s=round(sec, 2))


# -- divergence and corruption ---------------------------------------------------------------------------------------
def _fp_onset(draw: Draw, rng: np.random.Generator) -> int:
    every = draw.num.fp_every
    s = _onset(draw, rng, 0.2, 0.7)
    return max(every, (s // every) * every)


def _replica_ranks(draw: Draw, d: int) -> list[int]:
    return [int(r) for r in np.where(draw.world.dp_of == d)[0]]


def _diverge(draw: Draw, rng: np.random.Generator, fields: list[str], ranks: list[int], s0: int) -> None:
    n = draw.world.n
    for f in fields:
        arr = draw.num.salt.setdefault(f, np.full(n, -1, dtype=np.int64))
        arr[ranks] = s0


def div_rng(draw: Draw, rng: np.random.Generator) -> None:
    d, s0 = int(rng.integers(draw.world.dp)), _fp_onset(draw, rng)
    ranks = _replica_ranks(draw, d)
    field = str(rng.choice(["rng_torch_hash", "rng_cuda_hash", "rng_numpy_hash", "rng_python_hash"]))
    _diverge(draw, rng, [field], ranks, s0)
    _label(draw, "divergence", "replica", f"dp={d}", ranks, s0, "rng_mismatch", field=field)


def div_data_position(draw: Draw, rng: np.random.Generator) -> None:
    d, s0 = int(rng.integers(draw.world.dp)), _fp_onset(draw, rng)
    ranks = _replica_ranks(draw, d)
    off = np.zeros(draw.world.n, dtype=np.int64)
    off[ranks] = int(rng.choice([-2, -1, 1, 3])) * draw.num.global_batch // draw.world.dp
    draw.num.dpos_offset = (off, s0)
    _label(draw, "divergence", "replica", f"dp={d}", ranks, s0, "data_position_mismatch")


def div_step(draw: Draw, rng: np.random.Generator) -> None:
    """The replica's step counter is off from `s0` (it fingerprints a step its peers do not): its fingerprint rows
    carry step + offset and the state of that step."""
    d, s0 = int(rng.integers(draw.world.dp)), _fp_onset(draw, rng)
    ranks = _replica_ranks(draw, d)
    off = np.zeros(draw.world.n, dtype=np.int64)
    off[ranks] = int(rng.choice([-1, 1, 2]))
    draw.num.fp_step_offset = (off, s0)
    _label(draw, "divergence", "replica", f"dp={d}", ranks, s0, "step_mismatch")


def div_state(draw: Draw, rng: np.random.Generator) -> None:
    d, s0 = int(rng.integers(draw.world.dp)), _fp_onset(draw, rng)
    ranks = _replica_ranks(draw, d)
    _diverge(draw, rng, ["optim_hash", "param_hash"], ranks, s0)
    _label(draw, "divergence", "replica", f"dp={d}", ranks, s0, "state_mismatch")


def corr_value_mismatch(draw: Draw, rng: np.random.Generator) -> None:
    """A bit flip in one rank's parameters: its shard's fingerprint differs from its domain's from then on."""
    r, s0 = _rank(draw, rng), _fp_onset(draw, rng)
    _diverge(draw, rng, ["param_hash"], [r], s0)
    w = draw.world
    _label(draw, "corruption", "rank", str(r), [r], s0, "value_mismatch",
           domain=w.groups[int(w.dp_group[r])].name)


def corr_non_finite(draw: Draw, rng: np.random.Generator) -> None:
    """One rank's local computation produces inf/nan for a few steps (the grad scaler skips those steps)."""
    w, num = draw.world, draw.num
    last = np.where(w.pp_of == w.pp - 1)[0]
    r = int(rng.choice(last)) if rng.random() < 0.6 else _rank(draw, rng)
    s0 = _onset(draw, rng)
    k = int(rng.integers(1, 4))
    num.gnorm[s0:s0 + k, r] = float(rng.choice([np.inf, np.nan]))
    num.non_finite_loss.append((r, s0, k))
    _label(draw, "corruption", "rank", str(r), [r], s0, "non_finite", steps=k)


def corr_grad_norm(draw: Draw, rng: np.random.Generator) -> None:
    """Pre-all-reduce corruption seen only as 1.5-3x blips of one rank's local gradient norm (after the all-reduce
    replicas agree); sometimes its replica's loss bumps with it."""
    r, s0 = _rank(draw, rng), _onset(draw, rng, 0.15, 0.4)
    num, S = draw.num, draw.plan.steps
    blips = [s0] + sorted(int(s) for s in rng.choice(np.arange(s0 + 1, S), size=min(S - s0 - 1, int(rng.integers(3, 9))), replace=False))
    f = rng.uniform(1.5, 3.0, size=len(blips))
    num.gnorm[blips, r] *= f
    loss_too = bool(rng.random() < 0.4)
    if loss_too:
        num.loss[blips, int(draw.world.dp_of[r])] *= 1.0 + (f - 1.0) * 0.1
    _label(draw, "corruption", "rank", str(r), [r], s0, "grad_norm_outlier", blips=len(blips), loss_too=loss_too)


# -- device faults with direct hardware evidence ----------------------------------------------------------------------
def device_dbe_crash(draw: Draw, rng: np.random.Generator) -> None:
    """A double-bit ECC error (XID 48) kills the rank's CUDA context: it raises and exits; its peers fail after."""
    w = draw.world
    _fail(draw, rng, "exception", in_op=False)
    label = draw.labels.pop()
    r, F = draw.ending.rank, int(label["onset_step"])  # type: ignore[call-overload]
    draw.ending.exc_type = "RuntimeError"
    draw.ending.message = "CUDA error: uncorrectable ECC error encountered"
    draw.hw.dbe_new[F, r] = 1
    draw.hw.xid[(F, r)] = [48]
    _label(draw, "fail_stop", "device", w.uuids[r], [r], F, "exception", device_fault=True, device=w.uuids[r])


def device_sbe_rising(draw: Draw, rng: np.random.Generator) -> None:
    """Corrected ECC errors climbing on one device only, rows remapped (XID 63 on each remap): a failing HBM."""
    w, hw = draw.world, draw.hw
    r, s0 = _rank(draw, rng), _onset(draw, rng)
    S = draw.plan.steps
    rate = float(rng.uniform(0.3, 3.0))
    hw.sbe_new[s0:, r] = rng.poisson(rate * np.linspace(1, 3, S - s0))
    hw.sbe_new[s0, r] = max(1, int(hw.sbe_new[s0, r]))
    remaps = rng.random(S - s0) < 0.03
    remaps[0] = True
    hw.remap_new[s0:, r] = remaps.astype(np.int64)
    for s in np.where(remaps)[0]:
        hw.xid[(s0 + int(s), r)] = [63]
    _label(draw, "corruption", "device", w.uuids[r], [r], s0, "hardware_error", device_fault=True, device=w.uuids[r])


KINDS: dict[str, Callable[[Draw, np.random.Generator], None]] = {
    "straggler_persistent": straggler_persistent,
    "straggler_subtle": straggler_subtle,
    "straggler_intermittent": straggler_intermittent,
    "straggler_two_in_stage": straggler_two_in_stage,
    "straggler_host_stall": straggler_host_stall,
    "straggler_dataloader_rank": straggler_dataloader_rank,
    "straggler_dataloader_host": straggler_dataloader_host,
    "straggler_thermal": straggler_thermal,
    "straggler_power": straggler_power,
    "device_hw_slowdown": device_hw_slowdown,
    "imbalance_data_skew": imbalance_data_skew,
    "imbalance_stage": imbalance_stage,
    "slow_link_persistent": slow_link_persistent,
    "slow_link_intermittent": slow_link_intermittent,
    "failstop_exit": failstop_exit,
    "failstop_signal": failstop_signal,
    "failstop_exception": failstop_exception,
    "failstop_vanished": failstop_vanished,
    "failstop_launcher_kill": failstop_launcher_kill,
    "hang_collective": hang_collective,
    "hang_step": hang_step,
    "transient_freeze": transient_freeze,
    "div_rng": div_rng,
    "div_data_position": div_data_position,
    "div_step": div_step,
    "div_state": div_state,
    "corr_value_mismatch": corr_value_mismatch,
    "corr_non_finite": corr_non_finite,
    "corr_grad_norm": corr_grad_norm,
    "device_dbe_crash": device_dbe_crash,
    "device_sbe_rising": device_sbe_rising,
}

#: What a layout needs for the phenomenon: min dp, min pp, min tp.
NEEDS: dict[str, tuple[int, int, int]] = {
    "straggler_two_in_stage": (2, 1, 1),
    "imbalance_data_skew": (4, 1, 1),
    "imbalance_stage": (1, 2, 1),
    "slow_link_persistent": (2, 1, 1),
    "slow_link_intermittent": (2, 1, 1),
    "div_rng": (3, 1, 1),
    "div_data_position": (3, 1, 1),
    "div_step": (3, 1, 1),
    "div_state": (3, 1, 1),
    "corr_value_mismatch": (3, 1, 1),
}
