"""When everything in a generated run happens: a dependency simulation of one training step, vectorized over steps.

A step on every rank: wait for the batch, forward (receive activations from the previous stage, compute, a tensor-
parallel all_reduce, compute, send to the next stage), backward (the same in reverse, then the data-parallel gradient
all_reduce), optimizer (first the gradient-norm all_reduce over the model-parallel group, for clipping: the point where
the whole job meets, since every replica's ranks wait there for their data-parallel groups), then the step's end (on
CUDA the host waits there for its device, reading the loss). Checkpoint steps then snapshot, serialize, write, fsync, meet at a world barrier and rank 0 publishes.

A blocking collective (or a send/recv pair) ends for every member when the last member arrived plus the transfer
time; a member that dies or stops inside it, or before it, leaves its peers inside forever (`inf`). Times are seconds
relative to the step's origin, on the *lane* that does the work: the training thread (timing ``cpu``) or the device
(timing ``gpu``), where the host thread only enqueues (`Sim.cpu_*` hold its own times) and waits at the step's end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from .world import World

INF = np.inf
PHASES = ("forward", "backward", "optimizer", "metrics")
CKPT_PHASES = ("snapshot", "serialize", "write", "fsync")


@dataclass(slots=True)
class Death:
    """A rank that stops at step `step` (dies, or hangs while its heartbeats continue)."""

    rank: int
    step: int
    where: str
    """'forward' | 'backward' | 'optimizer' (inside its own work, at `frac` of it) or an op key (inside that op)."""
    frac: float = 0.5
    stuck_only: bool = False
    """Inside an op: the rank alone never leaves it (its peers do); otherwise nobody leaves it."""


@dataclass(slots=True)
class Plan:
    """What the noise model and the phenomena decided; `simulate` turns it into times."""

    world: World
    steps: int
    timing: str
    base_work_s: float
    work: np.ndarray
    """(S, N) the rank's own work in the step, seconds (device work on CUDA, the thread's on gloo)."""
    fwd_stall: np.ndarray
    """(S, N) host-side stall inside forward, seconds (on CUDA the device waits for it too)."""
    dl_wait: np.ndarray
    """(S, N) time blocked waiting for the batch, seconds."""
    stage_mult: np.ndarray
    """(pp,) work of each pipeline stage relative to the others."""
    net_mult: np.ndarray
    """(S,) global network slowdown factor (1 = nominal)."""
    link_bw: dict[str, np.ndarray] = field(default_factory=dict)
    """link -> (S,) bandwidth factor (1 nominal, 0.5 half speed)."""
    ckpt_every: int = 0
    ckpt_write_s: float = 3.0
    tp_bytes: int = 64 << 20
    dp_bytes: int = 512 << 20
    pp_bytes: int = 32 << 20
    intra_bw: float = 180e9
    inter_bw: float = 24e9
    death: Death | None = None
    freeze: tuple[int, int, float] | None = None
    """(rank, step, seconds): the rank's process is stopped at the start of its forward, then continues."""
    fwd_frac: float = 0.33
    opt_frac: float = 0.06

    @property
    def ckpt_steps(self) -> list[int]:
        if self.ckpt_every <= 0:
            return []
        return [s for s in range(self.ckpt_every - 1, self.steps, self.ckpt_every)]


@dataclass(slots=True)
class Op:
    key: str
    op: str
    group: np.ndarray
    """(N,) index into `World.groups` (-1: the rank does not issue this op)."""
    peer: np.ndarray
    """(N,) peer rank of a send/recv, -1 otherwise."""
    nbytes: np.ndarray
    enter: np.ndarray
    exit: np.ndarray
    """(S, N) lane times (nan where not issued; exit inf: never left)."""
    cpu_enter: np.ndarray
    cpu_exit: np.ndarray
    per_step: np.ndarray
    """(N,) ops of this op's group the rank issues per step (group_seq = step * per_step + order)."""
    order: np.ndarray
    """(N,) position of this op in the rank's per-step sequence on its group."""

    @property
    def member(self) -> np.ndarray:
        return self.group >= 0


@dataclass(slots=True)
class Sim:
    plan: Plan
    steps: int
    """Steps simulated (the failing step included)."""
    origin: np.ndarray
    """(S,) absolute seconds of each step's origin from the run's first step."""
    start: np.ndarray
    lane_end: np.ndarray
    cpu_end: np.ndarray
    """(S, N) relative times: step start (both lanes), the lane's and the host thread's end (inf: never ended)."""
    phase_lane: dict[str, tuple[np.ndarray, np.ndarray]]
    phase_cpu: dict[str, tuple[np.ndarray, np.ndarray]]
    ops: list[Op]
    ckpt: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]
    """checkpoint step -> phase -> (start, end) (N,) relative to the step's origin."""
    death_time: float | None = None
    """Absolute seconds of the death (or hang) of `plan.death.rank`."""
    freeze_span: tuple[float, float] | None = None


class _Clock:
    """Lane time of every rank in the step being built, with the death rule applied after each advance."""

    def __init__(self, sim_shape: tuple[int, int], death_step: int | None) -> None:
        self.death = np.full(sim_shape, INF)
        self.death_step = death_step

    def cut(self, t: np.ndarray) -> np.ndarray:
        return np.where(t > self.death, INF, t)


def _jitter(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return rng.exponential(scale, size=shape)


def simulate(plan: Plan, rng: np.random.Generator) -> Sim:
    """The run's times. With a death or hang at step F the steps simulated are F and F + 1: ranks that finished F
    start F + 1 and stay inside its first collective that waits on a rank that never got there."""
    d = plan.death
    if d is None or d.step + 1 >= plan.steps:
        return _simulate(plan, rng, None)
    first = _simulate(plan, copy.deepcopy(rng), None, steps=d.step + 1)
    never = ~np.isfinite(first.cpu_end[d.step])
    never[d.rank] = True
    return _simulate(plan, rng, never)


def _simulate(plan: Plan, rng: np.random.Generator, never_next: np.ndarray | None, steps: int | None = None) -> Sim:
    w = plan.world
    n, P, D, T = w.n, w.pp, w.dp, w.tp
    d = plan.death
    S = steps or (plan.steps if d is None else min(plan.steps, d.step + 2))
    shape = (S, n)
    gpu = plan.timing == "gpu"
    clk = _Clock(shape, None if d is None else d.step)
    if never_next is not None and S > d.step + 1:  # type: ignore[union-attr]
        clk.death[d.step + 1, never_next] = -INF  # type: ignore[union-attr]
    G = w.grid

    start = _jitter(rng, shape, 30e-6)
    lead = 0.3e-3 + _jitter(rng, shape, 0.2e-3) if gpu else np.zeros(shape)
    stage = plan.stage_mult[w.pp_of][None, :]
    work = plan.work[:S] * stage
    wf = work * plan.fwd_frac
    wo = work * plan.opt_frac
    wb = work - wf - wo
    stall = plan.fwd_stall[:S].copy()
    if plan.freeze is not None:
        fr, fs, fsec = plan.freeze
        stall[fs, fr] += fsec
    dl = plan.dl_wait[:S]
    net = plan.net_mult[:S, None]

    # transfer times
    def xnoise(size: tuple[int, ...]) -> np.ndarray:
        return rng.lognormal(0.0, 0.06, size=size)

    tp_x = (15e-6 + 2 * (T - 1) / T * plan.tp_bytes / plan.intra_bw) * net * xnoise(shape)
    dp_x = np.zeros(shape)
    for g in w.groups:
        if g.kind != "dp" or D == 1:
            continue
        bw = plan.inter_bw if g.links else plan.intra_bw
        factor = np.ones(S)
        for link in g.links:
            if link in plan.link_bw:
                factor = np.minimum(factor, plan.link_bw[link][:S])
        x = 40e-6 * np.log2(D + 1) + 2 * (D - 1) / D * plan.dp_bytes / (bw * factor)
        dp_x[:, list(g.ranks)] = (x[:, None] * net * xnoise((S, 1)))
    pp_x = np.zeros(shape)  # transfer time of the p2p between stage k-1 and k, indexed by the stage-k rank
    if P > 1:
        for r in range(D * T, n):
            a, b = w.host_of(r - D * T), w.host_of(r)
            if a == b:
                pp_x[:, r] = 10e-6 + plan.pp_bytes / plan.intra_bw
            else:
                link = "<->".join(sorted((a, b)))
                f = plan.link_bw.get(link, np.ones(plan.steps))[:S]
                pp_x[:, r] = 25e-6 + plan.pp_bytes / (plan.inter_bw * f)
        pp_x *= net * xnoise(shape)
    world_x = 30e-6 * np.log2(n) * net[:, 0][:, None] * xnoise((S, 1))
    mp_x = 20e-6 * np.log2(T * P + 1) * net[:, 0][:, None] * xnoise((S, 1))

    ops: dict[str, Op] = {}
    keys_in_order: list[str] = []

    def new_op(key: str, op: str, groups: np.ndarray, peer: np.ndarray, nbytes: int,
               per_step: np.ndarray | int, order: np.ndarray | int) -> None:
        ops[key] = Op(key, op, groups.copy(), peer, np.where(groups >= 0, nbytes, 0).astype(np.int64),
                      np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan),
                      np.broadcast_to(np.asarray(per_step), (n,)).copy(), np.broadcast_to(np.asarray(order), (n,)).copy())
        keys_in_order.append(key)

    none = np.full(n, -1, dtype=np.int64)
    me = np.arange(n)
    has_prev, has_next = w.pp_of > 0, w.pp_of < P - 1
    # a rank's pp ops in issue order: recv_fwd, send_fwd, recv_bwd, send_bwd (those it has); one counter per group
    pp_per = 2 * has_prev.astype(int) + 2 * has_next.astype(int)
    o_send_f = has_prev.astype(int)
    o_recv_b = o_send_f + has_next
    o_send_b = o_recv_b + has_next
    if P > 1:
        new_op("recv_fwd", "recv", np.where(has_prev, w.pp_group, -1), np.where(has_prev, me - D * T, -1),
               plan.pp_bytes, pp_per, 0)
    if T > 1:
        new_op("tp_fwd", "all_reduce", w.tp_group, none, plan.tp_bytes, 2, 0)
    if P > 1:
        new_op("send_fwd", "send", np.where(has_next, w.pp_group, -1), np.where(has_next, me + D * T, -1),
               plan.pp_bytes, pp_per, o_send_f)
        new_op("recv_bwd", "recv", np.where(has_next, w.pp_group, -1), np.where(has_next, me + D * T, -1),
               plan.pp_bytes, pp_per, o_recv_b)
    if T > 1:
        new_op("tp_bwd", "all_reduce", w.tp_group, none, plan.tp_bytes, 2, 1)
    if P > 1:
        new_op("send_bwd", "send", np.where(has_prev, w.pp_group, -1), np.where(has_prev, me - D * T, -1),
               plan.pp_bytes, pp_per, o_send_b)
    if D > 1:
        new_op("dp_grad", "all_reduce", w.dp_group, none, plan.dp_bytes, 1, 0)
    if T * P > 1:
        new_op("mp_norm", "all_reduce", w.mp_group, none, 8, 1, 0)

    def set_death(where: str, before: np.ndarray, dur: np.ndarray, mine: np.ndarray | None = None) -> None:
        if d is not None and d.where == where and (mine is None or mine[d.rank]):
            clk.death[d.step, d.rank] = before[d.step, d.rank] + d.frac * dur[d.step, d.rank]

    def advance(t: np.ndarray, dur: np.ndarray, where: str) -> np.ndarray:
        set_death(where, t, dur)
        return clk.cut(t + dur)

    def record(key: str, enter: np.ndarray, exit_: np.ndarray, mask: np.ndarray) -> None:
        o = ops[key]
        o.enter = np.where(mask[None, :] & np.isfinite(enter), enter, o.enter)
        o.exit = np.where(mask[None, :] & np.isfinite(enter), exit_, o.exit)

    def enter_death(key: str, t: np.ndarray, mine: np.ndarray | None = None) -> None:
        # `mine`: the ranks of the stage the op is entered for (a later stage's pass must not move the death)
        if d is not None and d.where == key and not d.stuck_only and (mine is None or mine[d.rank]):
            clk.death[d.step, d.rank] = t[d.step, d.rank] + 1e-4

    def stuck(key: str, exit_: np.ndarray) -> np.ndarray:
        if d is not None and d.where == key and d.stuck_only:
            exit_ = exit_.copy()
            exit_[d.step, d.rank] = INF
        return exit_

    def group_leave(enter: np.ndarray, axis: tuple[int, ...], x: np.ndarray) -> np.ndarray:
        e, dd = G(enter), G(clk.death)
        leave = e.max(axis=axis, keepdims=True) + G(x).mean(axis=axis, keepdims=True)
        gd = dd.min(axis=axis, keepdims=True)
        leave = np.where(leave > gd, INF, leave)
        out = np.broadcast_to(leave, e.shape).reshape(shape) + _jitter(rng, shape, 4e-6)
        return out

    t = start + dl + lead
    phase_lane: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    f_start = t.copy()
    # forward wave
    half_f = wf / 2
    for k in range(P):
        sl = w.pp_of == k
        if k > 0:
            prev = np.where(w.pp_of == k - 1)[0]
            cur = np.where(sl)[0]
            enter_death("recv_fwd", t)
            e_recv, e_send = t[:, cur], t[:, prev]
            leave = np.maximum(e_recv, e_send) + pp_x[:, cur]
            gd = np.minimum(clk.death[:, cur], clk.death[:, prev])
            leave = np.where(leave > gd, INF, leave)
            ex = np.full(shape, np.nan)
            ex[:, cur] = leave
            ex[:, prev] = leave + _jitter(rng, (S, len(prev)), 3e-6)
            en = np.full(shape, np.nan)
            en[:, cur] = e_recv
            en[:, prev] = e_send
            ex = stuck("recv_fwd", ex)
            rmask, smask = np.zeros(n, bool), np.zeros(n, bool)
            rmask[cur], smask[prev] = True, True
            record("recv_fwd", en, ex, rmask)
            record("send_fwd", en, ex, smask)
            t[:, cur], t[:, prev] = ex[:, cur], ex[:, prev]
            t = clk.cut(t)
        part = np.where(sl[None, :], half_f + stall, 0.0)
        set_death("forward", t, np.where(sl[None, :], wf + stall, 0.0), sl)
        t = clk.cut(t + part)
        if T > 1:
            enter_death("tp_fwd", t, sl)
            ex = group_leave(t, (-1,), tp_x)
            ex = stuck("tp_fwd", ex)
            record("tp_fwd", t, ex, sl)
            t = np.where(sl[None, :], ex, t)
            t = clk.cut(t)
        t = clk.cut(t + np.where(sl[None, :], half_f, 0.0))
    f_end_last = t.copy()
    # backward wave
    half_b = wb / 2
    for k in range(P - 1, -1, -1):
        sl = w.pp_of == k
        if k < P - 1:
            nxt = np.where(w.pp_of == k + 1)[0]
            cur = np.where(sl)[0]
            enter_death("recv_bwd", t)
            e_recv, e_send = t[:, cur], t[:, nxt]
            leave = np.maximum(e_recv, e_send) + pp_x[:, nxt]
            gd = np.minimum(clk.death[:, cur], clk.death[:, nxt])
            leave = np.where(leave > gd, INF, leave)
            ex = np.full(shape, np.nan)
            ex[:, cur] = leave
            ex[:, nxt] = leave + _jitter(rng, (S, len(nxt)), 3e-6)
            en = np.full(shape, np.nan)
            en[:, cur] = e_recv
            en[:, nxt] = e_send
            ex = stuck("recv_bwd", ex)
            rmask, smask = np.zeros(n, bool), np.zeros(n, bool)
            rmask[cur], smask[nxt] = True, True
            record("recv_bwd", en, ex, rmask)
            record("send_bwd", en, ex, smask)
            t[:, cur], t[:, nxt] = ex[:, cur], ex[:, nxt]
            t = clk.cut(t)
        set_death("backward", t, np.where(sl[None, :], wb, 0.0), sl)
        t = clk.cut(t + np.where(sl[None, :], half_b, 0.0))
        if T > 1:
            enter_death("tp_bwd", t, sl)
            ex = group_leave(t, (-1,), tp_x)
            ex = stuck("tp_bwd", ex)
            record("tp_bwd", t, ex, sl)
            t = np.where(sl[None, :], ex, t)
            t = clk.cut(t)
        t = clk.cut(t + np.where(sl[None, :], half_b, 0.0))
    # sends of backward (to k-1) were resolved in the loop; the stage-0 ranks end backward at their own compute
    if D > 1:
        enter_death("dp_grad", t)
        ex = group_leave(t, (-2,), dp_x)
        ex = stuck("dp_grad", ex)
        record("dp_grad", t, ex, np.ones(n, bool))
        t = clk.cut(ex)
    b_end = t.copy()
    if T * P > 1:
        enter_death("mp_norm", t)
        ex = group_leave(t, (-3, -1), np.broadcast_to(mp_x, shape))
        ex = stuck("mp_norm", ex)
        record("mp_norm", t, ex, np.ones(n, bool))
        t = clk.cut(ex)
    t = advance(t, wo, "optimizer")
    o_end = t.copy()
    lane_end = clk.cut(o_end + 0.1e-3 + _jitter(rng, shape, 20e-6))  # reading the loss (the host's sync point)

    # (the wave left every rank at its forward's end: the send's exit, or its own compute on the last stage;
    # waiting for the gradients of the next stage belongs to backward)
    phase_lane["forward"] = (f_start, f_end_last)
    phase_lane["backward"] = (f_end_last, b_end)
    phase_lane["optimizer"] = (b_end, o_end)
    phase_lane["metrics"] = (o_end, lane_end)

    # the host thread: on gloo it is the lane; on CUDA it enqueues and waits for its device at the step's end
    phase_cpu: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if not gpu:
        cpu_end = lane_end.copy()
        for o in ops.values():
            o.cpu_enter, o.cpu_exit = o.enter, o.exit
        phase_cpu = dict(phase_lane)
    else:
        enq = {"forward": 4e-3, "backward": 7e-3, "optimizer": 1.5e-3, "metrics": 0.2e-3}
        by_phase = {"forward": ["recv_fwd", "tp_fwd", "send_fwd"],
                    "backward": ["recv_bwd", "tp_bwd", "send_bwd", "dp_grad"],
                    "optimizer": ["mp_norm"], "metrics": []}
        # the host stops where its rank died or hung; peers keep enqueueing and wait at the step's end
        host_death = clk.death.copy()
        c = start + dl
        for p in PHASES:
            p0 = c.copy()
            dur = enq[p] * rng.lognormal(0.0, 0.15, size=shape) + (stall if p == "forward" else 0.0)
            if d is not None and d.where == p and not d.stuck_only:  # the thread stops inside this phase
                host_death[d.step, d.rank] = p0[d.step, d.rank] + d.frac * dur[d.step, d.rank]
            keys = [k for k in by_phase[p] if k in ops]
            for i, okey in enumerate(keys):
                o = ops[okey]
                at = p0 + dur * (i + 1) / (len(keys) + 1)
                issued = o.member[None, :] & (at < host_death)
                o.cpu_enter = np.where(issued, at, np.nan)
                o.cpu_exit = np.where(issued, at + 8e-6 + _jitter(rng, shape, 6e-6), np.nan)
                if d is not None and d.where == okey and d.stuck_only:
                    # the rank's thread is stuck inside the call (a hung device stops its launch queue)
                    o.cpu_exit[d.step, d.rank] = INF
                    host_death[d.step, d.rank] = at[d.step, d.rank] + 1e-9
            c = p0 + dur
            if p == "metrics":
                c = np.maximum(c, lane_end) + _jitter(rng, shape, 15e-6)
            c = np.where(c > host_death, INF, c)
            phase_cpu[p] = (np.where(p0 < host_death, p0, np.nan), c)
        cpu_end = c

    # checkpoint steps (every rank at once): the host thread writes, both lanes wait, a barrier, rank 0 publishes
    ckpt: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    tails = np.zeros(shape)
    if plan.ckpt_steps:
        host_contention = rng.lognormal(0.0, 0.12, size=(S, w.n_hosts))[:, w.host_index]
        for s in plan.ckpt_steps:
            if s >= S or not np.isfinite(cpu_end[s]).all():
                continue
            t0 = cpu_end[s].copy()
            phases: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            durs = {
                "snapshot": 0.08 * plan.ckpt_write_s * rng.lognormal(0, 0.1, n),
                "serialize": 0.15 * plan.ckpt_write_s * rng.lognormal(0, 0.1, n),
                "write": plan.ckpt_write_s * host_contention[s] * rng.lognormal(0, 0.08, n),
                "fsync": 0.1 * plan.ckpt_write_s * rng.lognormal(0, 0.3, n),
            }
            tc = t0
            for p in CKPT_PHASES:
                phases[p] = (tc, tc + durs[p])
                tc = tc + durs[p]
            leave = tc.max() + world_x[s, 0] + _jitter(rng, (n,), 4e-6)
            phases["barrier"] = (tc, leave)
            pub = np.full(n, np.nan)
            pub[0] = 0.05 + rng.exponential(0.05)
            phases["publish"] = (leave, leave + np.nan_to_num(pub))
            ckpt[s] = phases
            end = leave + np.nan_to_num(pub)
            tails[s] = end - cpu_end[s]
            cpu_end[s] = end
            if not gpu:
                lane_end[s] = end

    # origins: step s+1 starts where step s's last rank ended; each rank starts its next step from its own end
    finite_end = np.where(np.isfinite(cpu_end), cpu_end, np.nan)
    step_len = np.where(np.isfinite(cpu_end), cpu_end, -np.inf).max(axis=1)
    step_len = np.where(np.isfinite(step_len), step_len, 0.0)
    origin = np.concatenate([[0.0], np.cumsum(step_len)[:-1]])
    offs = np.zeros(shape)
    offs[1:] = np.nan_to_num(finite_end[:-1] - step_len[:-1, None], nan=0.0)
    # shift every relative time of step s by the rank's offset from the previous step's last end
    def sh(a: np.ndarray) -> np.ndarray:
        return a + offs

    start, lane_end, cpu_end = sh(start), sh(lane_end), sh(cpu_end)
    if never_next is not None and S > d.step + 1:  # type: ignore[union-attr]
        start[d.step + 1, never_next] = INF  # type: ignore[union-attr]
    phase_lane = {p: (sh(a), sh(b)) for p, (a, b) in phase_lane.items()}
    phase_cpu = {p: (sh(a), sh(b)) for p, (a, b) in phase_cpu.items()}
    for o in ops.values():
        o.enter, o.exit, o.cpu_enter, o.cpu_exit = sh(o.enter), sh(o.exit), sh(o.cpu_enter), sh(o.cpu_exit)
    for s_, phases in ckpt.items():
        ckpt[s_] = {p: (a + offs[s_], b + offs[s_]) for p, (a, b) in phases.items()}
    sim = Sim(plan=plan, steps=S, origin=origin, start=start, lane_end=lane_end, cpu_end=cpu_end,
              phase_lane=phase_lane, phase_cpu=phase_cpu, ops=[ops[k] for k in keys_in_order], ckpt=ckpt)
    if d is not None:
        dt = clk.death[d.step, d.rank]
        if d.stuck_only:
            dt = ops[d.where].enter[d.step, d.rank] - offs[d.step, d.rank]
        sim.death_time = float(origin[d.step] + offs[d.step, d.rank] + dt)
        clk.death[d.step, d.rank] = dt
    if plan.freeze is not None:
        fr, fs, fsec = plan.freeze
        a = origin[fs] + phase_lane["forward"][0][fs, fr]
        sim.freeze_span = (float(a), float(a + fsec))
    return sim

