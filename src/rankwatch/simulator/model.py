"""The time model of a simulated run. Synchronous training, one loop over steps, vectorized over ranks. Each rank
reads its batch (dataloader wait), computes forward (with a tensor-parallel all-reduce in the middle), passes
activations down the pipeline (blocking send/recv), computes backward (another tp all-reduce, gradients back up the
pipeline), joins the data-parallel gradient all-reduce, steps the optimizer and, on checkpoint steps, saves. Every
blocking operation completes when its last member arrives plus the transfer time (bytes over the link bandwidth;
groups crossing hosts are slower), so a late rank shows as higher compute on itself and higher collective wait on its
peers. A rank that is gone or stuck arrives at +inf, which propagates: whoever waits for it enters an operation that
never completes. Faults become per-step inputs (`_inputs`), the step loop turns them into a trace (`_step_loop`), and
`_lifecycle` decides when each rank's records end and which events it emits.

Under `Timing.GPU` the same loop is the device's timeline (a kernel waits for its peers as a blocking call does on
CPU) and each step ends on the host at one synchronization point; `timing._gpu_view` then derives what the training
thread saw, which is what the CPU columns record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankwatch.base.schema import EventKind, GroupKind, ThrottleReason
from rankwatch.base.topology import GroupInfo, Hosts, group_specs, link_name
from rankwatch.collector.gpu import H100_SXM
from rankwatch.simulator.config import SimConfig
from rankwatch.simulator.faults import (
    DataSkew, FailHow, FailStop, Hang, HostDataloader, SlowHardware, SlowLink, StageImbalance, Straggler,
    StragglerCause, ThrottleBitOnly,
)

_NS = 1_000_000_000


# ------------------------------------------------------------------------------------------------ topology


class _Topo:
    """Layout facts as arrays over ranks."""

    def __init__(self, cfg: SimConfig) -> None:
        lay = cfg.layout
        self.layout, self.n = lay, lay.world_size
        self.hosts = Hosts(count=cfg.hosts, world_size=self.n)
        r = np.arange(self.n)
        self.tp, self.dp, self.pp = r % lay.tp, (r // lay.tp) % lay.dp, r // (lay.tp * lay.dp)
        self.host = r // self.hosts.per_host
        self.local = r % self.hosts.per_host
        self.infos: list[GroupInfo] = [GroupInfo(name="world", kind=GroupKind.WORLD, ranks=tuple(range(self.n)),
                                                 hosts=tuple(self.hosts.host_of(i) for i in range(self.n)))]
        self.infos += [GroupInfo(name=name, kind=kind, ranks=tuple(ranks),
                                 hosts=tuple(self.hosts.host_of(i) for i in ranks))
                       for kind, name, ranks in group_specs(lay)]
        self.gid: dict[GroupKind, np.ndarray] = {}
        for kind in (GroupKind.DP, GroupKind.TP, GroupKind.PP):
            ids = np.zeros(self.n, dtype=np.int64)
            for i, g in enumerate(self.infos):
                if g.kind is kind:
                    ids[list(g.ranks)] = i
            self.gid[kind] = ids

    def links_of(self, kind: GroupKind) -> list[tuple[str, ...]]:
        return [self.infos[g].links for g in self.gid[kind]]

    def host_ranks(self, h: int) -> tuple[int, ...]:
        return tuple(int(x) for x in np.flatnonzero(self.host == h))


# ------------------------------------------------------------------------------------------------ time model

# op slots in execution order, each rank uses the applicable subset
_RECV_F, _TP_F, _SEND_F, _RECV_B, _TP_B, _SEND_B, _DP = range(7)
_SLOT_OP = ("recv", "all_reduce", "send", "recv", "all_reduce", "send", "all_reduce")
_SLOT_KIND = (GroupKind.PP, GroupKind.TP, GroupKind.PP, GroupKind.PP, GroupKind.TP, GroupKind.PP, GroupKind.DP)
_INTRA_BPS, _INTER_BPS = 200e9, 25e9
_FWD1, _FWD2, _BWD1, _BWD2, _OPT = 0.16, 0.16, 0.28, 0.28, 0.12


@dataclass(slots=True)
class _Trace:
    """Everything the step loop produces, in relative simulated ns (float; inf = never)."""

    start: np.ndarray  # (S, N)
    end: np.ndarray
    dl: np.ndarray
    comp: np.ndarray
    ckpt: np.ndarray
    enter: np.ndarray  # (S, 7, N)
    exit: np.ndarray
    applies: np.ndarray  # (7, N) bool
    nbytes: np.ndarray  # (7, N)
    peer: np.ndarray  # (7, N), -1 = none
    stall: np.ndarray  # (S, N) host stall at the start of forward
    dev_enter: np.ndarray | None = None  # (S, 7, N) device timeline under Timing.GPU (enter/exit are then the CPU's)
    dev_exit: np.ndarray | None = None
    dev_end: np.ndarray | None = None  # (S, N) device reaches the step's end event
    cpu_phases: np.ndarray | None = None  # (4, S, N) CPU durations of data, forward, backward, optimizer


def _step_loop(cfg: SimConfig, topo: _Topo, rng: np.random.Generator, comp: np.ndarray, dl: np.ndarray,
               ckpt: np.ndarray, link_mult: list[tuple[int, np.ndarray]], stop: np.ndarray, stuck_dp: np.ndarray,
               stall: np.ndarray, *, gpu: bool = False) -> _Trace:
    """Run the synchronous-step model. `stop[s, r]`: rank r does not start step s (dead or hung);
    `stuck_dp[s, r]`: r enters step s's dp all-reduce and never leaves. With `gpu` the ops are device time, the
    checkpoint runs on the host after the step's synchronization point and `end` is that host time (`dev_end` the
    device's)."""
    lay, n, S = topo.layout, topo.n, cfg.steps
    PP, DP, TP = lay.pp, lay.dp, lay.tp
    shp = (PP, DP, TP)
    applies = np.zeros((7, n), dtype=bool)
    pp = topo.pp
    applies[_RECV_F] = applies[_SEND_B] = pp > 0
    applies[_SEND_F] = applies[_RECV_B] = pp < PP - 1
    applies[_TP_F] = applies[_TP_B] = TP > 1
    applies[_DP] = DP > 1
    act_bytes = 4 * 1024 * 1024
    param_bytes = 4 * _param_count(topo)
    nbytes = np.zeros((7, n), dtype=np.int64)
    for s_ in (_RECV_F, _SEND_F, _RECV_B, _SEND_B):
        nbytes[s_] = act_bytes
    nbytes[_TP_F] = nbytes[_TP_B] = 2 * act_bytes
    nbytes[_DP] = param_bytes
    nbytes[~applies] = 0
    peer = np.full((7, n), -1, dtype=np.int64)
    r = np.arange(n)
    stage = TP * DP
    peer[_RECV_F] = peer[_SEND_B] = np.where(pp > 0, r - stage, -1)
    peer[_SEND_F] = peer[_RECV_B] = np.where(pp < PP - 1, r + stage, -1)
    # nominal transfer ns per slot per rank: inter-host groups at inter-host bandwidth; ring all-reduce moves 2x
    base_xfer = np.zeros((7, n))
    for s_ in range(7):
        kind = _SLOT_KIND[s_]
        inter = np.array([bool(links) for links in topo.links_of(kind)])
        if kind is GroupKind.PP:  # p2p: inter-host iff the peer is on another host
            inter = (peer[s_] >= 0) & (topo.host[np.clip(peer[s_], 0, n - 1)] != topo.host)
        bw = np.where(inter, _INTER_BPS, _INTRA_BPS)
        ring = 2.0 if _SLOT_OP[s_] == "all_reduce" else 1.0
        base_xfer[s_] = ring * nbytes[s_] / bw * _NS + 20_000

    start = np.zeros((S, n))
    end = np.zeros((S, n))
    enter = np.full((S, 7, n), np.inf)
    exit_ = np.full((S, 7, n), np.inf)
    dev_end = np.full((S, n), np.inf) if gpu else None
    t = np.zeros(n)
    inf = np.inf
    for s in range(S):
        t = np.where(stop[s], inf, t)
        start[s] = t
        link_f = np.ones((7, n))
        for from_step, mult in link_mult:
            if s >= from_step:
                link_f = link_f * mult
        xf = (base_xfer * link_f * rng.lognormal(0.0, 0.05, (7, n))).reshape(7, *shp)
        c = comp[s].reshape(shp)
        ready = (t + dl[s] + stall[s]).reshape(shp).copy()
        en, ex = enter[s].reshape(7, *shp), exit_[s].reshape(7, *shp)
        send_f = np.full(shp, inf)
        send_b = np.full(shp, inf)

        def p2p(slot_s: int, slot_r: int, ps: int, pr: int, a_send: np.ndarray) -> None:
            a_recv = ready[pr]
            done = np.maximum(a_send, a_recv) + np.maximum(xf[slot_s][ps], xf[slot_r][pr])
            en[slot_s][ps], ex[slot_s][ps] = a_send, done
            en[slot_r][pr], ex[slot_r][pr] = a_recv, done
            ready[ps], ready[pr] = done, done

        def tp_ar(slot: int, p: int) -> None:
            a = ready[p]
            done = a.max(axis=-1, keepdims=True) + xf[slot][p].max(axis=-1, keepdims=True)
            done = np.broadcast_to(done, a.shape)
            if TP > 1:
                en[slot][p], ex[slot][p] = a, done
                ready[p] = done

        for p in range(PP):
            if p > 0:
                p2p(_SEND_F, _RECV_F, p - 1, p, send_f[p - 1])
            ready[p] += _FWD1 * c[p]
            tp_ar(_TP_F, p)
            ready[p] += _FWD2 * c[p]
            if p < PP - 1:
                send_f[p] = ready[p]
        for p in reversed(range(PP)):
            if p < PP - 1:
                p2p(_SEND_B, _RECV_B, p + 1, p, send_b[p + 1])
            ready[p] += _BWD1 * c[p]
            tp_ar(_TP_B, p)
            ready[p] += _BWD2 * c[p]
            if p > 0:
                send_b[p] = ready[p]
        if DP > 1:
            a = ready
            done = a.max(axis=1, keepdims=True) + xf[_DP].max(axis=1, keepdims=True)
            stuck = stuck_dp[s].reshape(shp)
            done = np.where(stuck.any(axis=1, keepdims=True), inf, done)
            en[_DP], ex[_DP] = a, np.broadcast_to(done, a.shape)
            ready = np.broadcast_to(done, a.shape).copy()
        if dev_end is None:
            ready += (_OPT * c + ckpt[s].reshape(shp))
            end[s] = ready.reshape(n)
        else:
            ready += _OPT * c
            dev_end[s] = ready.reshape(n)
            end[s] = _sync(dev_end[s], rng) + ckpt[s]
        t = end[s] + rng.uniform(30_000, 90_000, n)
    enter[:, ~applies] = np.nan
    exit_[:, ~applies] = np.nan
    return _Trace(start=start, end=end, dl=dl, comp=comp, ckpt=ckpt, enter=enter, exit=exit_, applies=applies,
                  nbytes=nbytes, peer=peer, stall=stall, dev_end=dev_end)


def _sync(dev_end: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Host time each rank's training thread leaves the step's synchronization point (loss.item() after the
    optimizer): when the slowest device of the job finished the step, plus the host's wake-up latency. Every peer's
    work feeds every rank's collectives, so all threads wait for the last device; a rank whose device never finishes
    (its peer is gone) stays blocked (inf)."""
    done = np.isfinite(dev_end)
    last = dev_end[done].max() if done.any() else np.inf
    return np.where(done, last + rng.uniform(15_000, 45_000, dev_end.shape), np.inf)


def _nominal(cfg: SimConfig, topo: _Topo) -> np.ndarray:
    """(N,) nominal compute ns per step of each rank: its stage's share (the last stage also computes the loss)."""
    return cfg.compute_s * _NS * (1.0 + 0.02 * (topo.pp == topo.layout.pp - 1))


def _param_count(topo: _Topo) -> np.ndarray:
    lay = topo.layout
    per_stage = 48_000_000 // lay.tp
    return per_stage + np.where(topo.pp == 0, 2_000_000, 0) + np.where(topo.pp == lay.pp - 1, 1_000_000, 0)


# ------------------------------------------------------------------------------------------------ faults -> inputs


def _active(step: np.ndarray, from_step: int, until_step: int | None, period: int | None, burst: int | None) -> np.ndarray:
    on = step >= from_step
    if until_step is not None:
        on &= step < until_step
    if period is not None:
        on &= (step - from_step) % period < (burst or 1)
    return on


@dataclass(slots=True)
class _Inputs:
    comp: np.ndarray
    dl: np.ndarray
    ckpt: np.ndarray
    ckpt_steps: np.ndarray
    link_mult: list[tuple[int, np.ndarray]]
    stop: np.ndarray
    stuck_dp: np.ndarray
    skewed: set[int]
    stall: np.ndarray  # (S, N) host stall at the start of forward
    throttle: np.ndarray  # (S, N) throttle bits
    clock_scale: np.ndarray  # (S, N) SM clock multiplier
    tokens: np.ndarray  # (S, N) work in each rank's batch, as a job counts it (steps.tokens), relative to nominal


def _inputs(cfg: SimConfig, topo: _Topo, rng: np.random.Generator) -> _Inputs:
    S, n, lay = cfg.steps, topo.n, topo.layout
    steps = np.arange(S)
    hw = rng.normal(1.0, 0.005, n)
    stage_base = _nominal(cfg, topo)
    comp = stage_base * hw * rng.lognormal(0.0, 0.01, (S, n))
    dl = 0.015 * cfg.compute_s * _NS * rng.lognormal(0.0, 0.3, (S, n))
    stall = np.zeros((S, n))
    throttle = np.zeros((S, n), dtype=np.int64)
    clock_scale = np.ones((S, n))
    link_mult: list[tuple[int, np.ndarray]] = []
    stop = np.zeros((S, n), dtype=bool)
    stuck_dp = np.zeros((S, n), dtype=bool)
    skewed: set[int] = set()
    tokens = np.ones((S, n))
    for f in cfg.faults:
        if isinstance(f, SlowHardware):
            comp[:, f.rank] *= 1.0 + f.slow
        elif isinstance(f, ThrottleBitOnly):
            throttle[:, f.rank] |= int(ThrottleReason.SW_POWER_CAP)
            clock_scale[:, f.rank] = 1.0 - 30 / H100_SXM.sm_clock_max_mhz
        elif isinstance(f, Straggler):
            on = _active(steps, f.from_step, f.until_step, f.period, f.burst)
            if f.cause is StragglerCause.DATALOADER:
                dl[on, f.rank] += f.slow * stage_base[f.rank] * rng.lognormal(0.0, 0.05, int(on.sum()))
            elif f.cause is StragglerCause.HOST_STALL:
                stall[on, f.rank] += f.slow * stage_base[f.rank] * rng.lognormal(0.0, 0.05, int(on.sum()))
            else:
                comp[on, f.rank] *= 1.0 + f.slow
            if f.cause in (StragglerCause.THERMAL, StragglerCause.POWER):
                bit = ThrottleReason.HW_THERMAL_SLOWDOWN if f.cause is StragglerCause.THERMAL else ThrottleReason.SW_POWER_CAP
                throttle[on, f.rank] |= int(bit)
                clock_scale[on, f.rank] = 1.0 / (1.0 + f.slow)
        elif isinstance(f, HostDataloader):
            ranks = list(topo.host_ranks(f.host))
            k = S - f.from_step
            dl[f.from_step:, ranks] += f.slow * stage_base[ranks] * rng.lognormal(0.0, 0.1, (k, len(ranks)))
        elif isinstance(f, StageImbalance):
            comp[f.from_step:, topo.pp == f.stage] *= f.factor
        elif isinstance(f, DataSkew):  # a replica's batch is long for every rank of it (all stages and shards)
            replicas = topo.layout.dp
            for s in range(f.from_step, S):
                chosen = rng.choice(replicas, size=min(f.count, replicas), replace=False)
                members = np.flatnonzero(np.isin(topo.dp, chosen))
                comp[s, members] *= 1.0 + f.extra
                tokens[s, members] *= 1.0 + f.extra  # the longer batch is that much more work as its job counts it
                skewed.update(int(c) for c in members)
        elif isinstance(f, SlowLink):
            link = link_name(f"host{f.host_a}", f"host{f.host_b}")
            mult = np.ones((7, n))
            for slot in range(7):
                kind = _SLOT_KIND[slot]
                if kind is GroupKind.PP:
                    continue  # p2p rows get their factor below, by the two hosts they connect
                crosses = np.array([link in links for links in topo.links_of(kind)])
                mult[slot, crosses] = f.factor
            hosts = {f.host_a, f.host_b}
            for slot, sign in ((_RECV_F, -1), (_SEND_B, -1), (_SEND_F, 1), (_RECV_B, 1)):
                other = np.arange(n) + sign * lay.tp * lay.dp
                ok = (other >= 0) & (other < n)
                other_host = topo.host[np.clip(other, 0, n - 1)]
                cross = ok & np.array([{int(a), int(b)} == hosts for a, b in zip(topo.host, other_host)])
                mult[slot, cross] = f.factor
            link_mult.append((f.from_step, mult))
        elif isinstance(f, FailStop):
            if f.in_collective and lay.dp > 1:
                stuck_dp[f.step, f.rank] = True
                stop[f.step + 1:, f.rank] = True
            else:
                stop[f.step:, f.rank] = True
        elif isinstance(f, Hang):
            stop[f.step:, f.rank] = True
    ckpt = np.zeros((S, n))
    ckpt_steps = np.arange(cfg.checkpoint_every - 1, S, cfg.checkpoint_every) if cfg.checkpoint_every else np.zeros(0, np.int64)
    for cs in ckpt_steps:
        ckpt[cs] = cfg.compute_s * _NS * rng.uniform(2.5, 3.5) * rng.lognormal(0.0, 0.05, n)
    return _Inputs(comp=comp, dl=dl, ckpt=ckpt, ckpt_steps=ckpt_steps, link_mult=link_mult, stop=stop,
                   stuck_dp=stuck_dp, skewed=skewed, stall=stall, throttle=throttle, clock_scale=clock_scale,
                   tokens=tokens)


# ------------------------------------------------------------------------------------------------ lifecycle


@dataclass(slots=True)
class _Life:
    death: np.ndarray  # (N,) relative ns the rank's records end (inf = clean run to the end)
    clean_end: np.ndarray  # (N,) exit time of ranks that finish (inf otherwise)
    error_at: np.ndarray  # (N,) time a blocked peer's collective errors (nan = never)
    block: np.ndarray  # (N,) flat (step*7+slot) of the op the rank is stuck in, -1 = none
    block_enter: np.ndarray
    started: np.ndarray  # (N,) relative ns of the start event
    events: list[tuple[int, float, EventKind, int | None, str | None, str | None, int | None, int | None]]
    """(rank, t, kind, step, exc_type, message, signal, exit_code) of non-heartbeat events."""


def _lifecycle(cfg: SimConfig, topo: _Topo, tr: _Trace, rng: np.random.Generator) -> _Life:
    S, n = cfg.steps, topo.n
    gap = 60_000.0
    death = np.full(n, np.inf)
    kill = np.inf
    fail_culprits: set[int] = set()
    events: list[tuple[int, float, EventKind, int | None, str | None, str | None, int | None, int | None]] = []
    for f in cfg.faults:
        if isinstance(f, FailStop):
            s, r = f.step, f.rank
            if f.in_collective and cfg.layout.dp > 1:
                t = float(tr.enter[s, _DP, r]) + 1e6
            else:
                t = float(tr.end[s - 1, r]) + gap + float(tr.dl[s, r]) + 0.3 * float(tr.comp[s, r])
            death[r] = min(death[r], t)
            fail_culprits.add(r)
            if f.how is FailHow.EXIT:
                events.append((r, t, EventKind.EXIT, s, None, None, None, 1))
            elif f.how is FailHow.SIGNAL:
                name = {9: "SIGKILL", 15: "SIGTERM", 6: "SIGABRT", 11: "SIGSEGV"}.get(f.signal, f"signal {f.signal}")
                events.append((r, t, EventKind.SIGNAL, s, None, name, f.signal, None))
                if f.signal != 9:
                    events.append((r, t + 1e6, EventKind.EXIT, s, None, None, None, 128 + f.signal))
            elif f.how is FailHow.KILLED_ALL:
                kill = min(kill, t + 3 * _NS)
        elif isinstance(f, Hang):
            t = float(tr.end[f.step - 1, f.rank]) + gap
            death[f.rank] = min(death[f.rank], t + f.alive_s * _NS)
            if f.killed:
                kill = min(kill, t + f.kill_after_s * _NS)
    flat_enter = tr.enter.transpose(2, 0, 1).reshape(n, S * 7)
    flat_exit = tr.exit.transpose(2, 0, 1).reshape(n, S * 7)
    with np.errstate(invalid="ignore"):
        open_ = np.isfinite(flat_enter) & ~np.isfinite(flat_exit)
    has = open_.any(axis=1)
    block = np.where(has, open_.argmax(axis=1), -1)
    block_enter = np.where(has, flat_enter[np.arange(n), np.maximum(block, 0)], np.nan)
    error_at = np.full(n, np.nan)
    for r in map(int, np.flatnonzero(has)):
        if r in fail_culprits:
            continue
        err = block_enter[r] + cfg.pg_timeout_s * _NS
        if err < kill and err < death[r]:
            error_at[r] = err
            death[r] = err + 2e6
    death = np.minimum(death, kill)
    last_end = tr.end[S - 1]
    finished = np.isfinite(last_end) & (last_end <= death)
    clean_end = np.where(finished, last_end + 1e6, np.inf)
    for r in map(int, np.flatnonzero(finished)):
        events.append((r, float(clean_end[r]), EventKind.EXIT, S - 1, None, None, None, 0))
    death = np.where(finished, clean_end + 1e5, death)
    for r in map(int, np.flatnonzero(~np.isnan(error_at))):
        s = int(block[r]) // 7
        events.append((int(r), float(error_at[r]), EventKind.EXCEPTION, s, "DistBackendError", None, None, None))
        events.append((int(r), float(error_at[r]) + 1e6, EventKind.EXIT, s, None, None, None, 1))
    started = -1.0 * _NS + rng.uniform(0, 0.3 * _NS, n)
    return _Life(death=death, clean_end=clean_end, error_at=error_at, block=block, block_enter=block_enter,
                 started=started, events=events)
