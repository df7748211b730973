"""Telemetry tables of a simulated run: `_Builder` turns the trace into one rank-ordered arrow table per collector
table, in the collector's storage schema with per-host wall and monotonic clocks, and `_write_parts` writes each
table as ``telemetry/<table>/rank=<r>/part-000000.parquet`` exactly as real ranks would. Under `Timing.GPU` the
device columns come from the trace's device timeline; otherwise they are null, as on a CPU job.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rankwatch.base.rundir import TELEMETRY_DIR, atomic_write
from rankwatch.base.schema import (
    PARTITION_KEY, CheckpointPhase, CollectiveStatus, EventKind, GroupKind, Table, ThrottleReason, storage_schema,
)
from rankwatch.collector.gpu import H100_SXM, replay_uuid
from rankwatch.simulator.config import SimConfig
from rankwatch.simulator.faults import Corruption, CorruptionKind, DivergeField, Divergence, SteadyCounters, _div_ranks
from rankwatch.simulator.model import (
    _BWD1, _BWD2, _DP, _FWD1, _FWD2, _Inputs, _Life, _NS, _OPT, _RECV_B, _RECV_F, _SEND_B, _SEND_F, _SLOT_KIND,
    _SLOT_OP, _TP_B, _TP_F, _Topo, _Trace, _param_count,
)

_PART = "part-000000.parquet"
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def _h(*parts: object) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).hexdigest()


class _Clock:
    """Relative simulated ns -> per-host wall and monotonic clocks."""

    def __init__(self, cfg: SimConfig, topo: _Topo, rng: np.random.Generator) -> None:
        self.t0 = 1_760_000_000 * _NS + (cfg.seed % 10_000) * 3_600 * _NS
        self.offset = rng.uniform(-0.05 * _NS, 0.05 * _NS, cfg.hosts)
        self.mono = np.rint(rng.uniform(1e12, 9e13, cfg.hosts))
        self.host = topo.host

    def wall(self, t: np.ndarray, rank: np.ndarray) -> np.ndarray:
        return self.t0 + np.rint(t + self.offset[self.host[rank]]).astype(np.int64)

    def mono_ns(self, t: np.ndarray, rank: np.ndarray) -> np.ndarray:
        return np.rint(self.mono[self.host[rank]] + t).astype(np.int64)


def _rank_major(mask: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
    """Values of (S, N) arrays where `mask`, ordered by rank then step."""
    m = mask.T
    return [a.T[m] for a in arrays]


_TOKENS_PER_SAMPLE = 1024
"""Tokens of a nominal sample (steps.tokens: a rank's batch is its share of the global batch, in tokens)."""


def _arr(values: Any, t: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    if valid is None:
        return pa.array(values, type=t)
    return pa.array(values, type=t, mask=~valid)


def _table(table: Table, cols: dict[str, Any], n_rows: int) -> pa.Table:
    schema = storage_schema(table)
    arrays = []
    for f in schema:
        v = cols.get(f.name)
        if v is None:
            arrays.append(pa.nulls(n_rows, f.type))
        elif isinstance(v, (pa.Array, pa.ChunkedArray)):
            arrays.append(v.cast(f.type) if v.type != f.type else v)
        else:
            arrays.append(pa.array(v, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _strings(catalog: Sequence[str], idx: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    out = pa.array(list(catalog), type=pa.string()).take(pa.array(idx, type=pa.int64()))
    if valid is not None:
        out = pa.compute.if_else(pa.array(valid), out, pa.scalar(None, pa.string()))
    return out


class _Builder:
    """Builds every table as one rank-ordered arrow table, from the trace."""

    def __init__(self, cfg: SimConfig, topo: _Topo, tr: _Trace, life: _Life, inp: _Inputs,
                 rng: np.random.Generator) -> None:
        self.cfg, self.topo, self.tr, self.life, self.inp, self.rng = cfg, topo, tr, life, inp, rng
        self.clock = _Clock(cfg, topo, rng)
        S = cfg.steps
        with np.errstate(invalid="ignore"):
            self.step_ok = np.isfinite(tr.end) & (tr.end <= life.death[None, :])
        self.steps_idx = np.broadcast_to(np.arange(S)[:, None], (S, topo.n))
        self.ranks_idx = np.broadcast_to(np.arange(topo.n)[None, :], (S, topo.n))
        self.block_group_seq = np.full(topo.n, -1, dtype=np.int64)

    # -- steps / phases / gpu -----------------------------------------------------------------------
    def steps(self) -> pa.Table:
        cfg, tr, S, n = self.cfg, self.tr, self.cfg.steps, self.topo.n
        rng = self.rng
        with np.errstate(invalid="ignore"):
            dur_ops = np.where(self.tr.applies[None], np.rint(tr.exit) - np.rint(tr.enter), 0.0)
        cw = np.nan_to_num(dur_ops, nan=0.0).sum(axis=1)
        self.cw = cw
        start, end = np.rint(tr.start), np.rint(tr.end)
        dl, ck = np.rint(tr.dl), np.rint(tr.ckpt)
        s_ax = np.arange(S)[:, None] / max(S, 1)
        loss = (1.8 * np.exp(-s_ax / 0.3) + 0.25) * (1 + 0.04 * rng.standard_normal((S, cfg.layout.dp)))[:, self.topo.dp]
        ar = np.zeros((S, n))
        e = np.zeros(n)
        noise = rng.normal(0.0, 0.02, (S, n))
        for s in range(S):
            e = 0.85 * e + noise[s]
            ar[s] = e
        gn = (4.0 * np.exp(-s_ax / 0.4) + 1.0) * (1.0 + ar)
        has_loss = np.broadcast_to(self.topo.pp == cfg.layout.pp - 1, (S, n)).copy()
        pos = (np.arange(S)[:, None] + 1) * cfg.batch + np.zeros((1, n), dtype=np.int64)
        for f in cfg.faults:
            if isinstance(f, Corruption) and f.kind is CorruptionKind.NAN:
                gn[f.step, f.rank] = np.nan
                loss[f.step, f.rank] = np.nan
                gn[f.step + 1:] = np.nan
                loss[f.step + 1:] = np.nan
            elif isinstance(f, Corruption) and f.kind is CorruptionKind.GRAD_SPIKE:
                gn[f.step:f.step + f.duration, f.rank] *= f.factor
            elif isinstance(f, Divergence) and f.field is DivergeField.DATA:
                pos[f.step:, list(_div_ranks(f, cfg.layout))] += f.offset
        self.pos = pos
        m = self.step_ok
        work = np.rint(self.inp.tokens * _TOKENS_PER_SAMPLE * max(1, cfg.batch // cfg.layout.dp)).astype(np.int64)
        rank, step, st, en, dlv, ckv, cwv, lo, hl, g, p, tok = _rank_major(
            m, self.ranks_idx, self.steps_idx, start, end, dl, ck, cw, loss, has_loss, gn, pos, work)
        dur = (en - st).astype(np.int64)
        comp = dur - cwv.astype(np.int64) - dlv.astype(np.int64) - ckv.astype(np.int64)
        ncoll = self.tr.applies.sum(axis=0)[rank]
        finite = np.isfinite(g) & (~hl | np.isfinite(lo))
        c = self.clock
        device: dict[str, Any] = {}
        if tr.dev_end is not None and tr.dev_enter is not None and tr.dev_exit is not None:
            with np.errstate(invalid="ignore"):
                d_ops = np.where(tr.applies[None], np.rint(tr.dev_exit) - np.rint(tr.dev_enter), 0.0)
                d_span = np.rint(tr.dev_end) - start
            d_coll = np.nan_to_num(d_ops, nan=0.0).sum(axis=1)
            d_ns, d_cw = (v.astype(np.int64) for v in _rank_major(m, d_span, d_coll))
            device = {"device_ns": d_ns, "device_compute_ns": d_ns - d_cw, "device_collective_ns": d_cw}
        cols = {
            "rank": rank, "step": step, "attempt": np.zeros(len(rank), np.int32),
            "start_wall_ns": c.wall(st, rank), "end_wall_ns": c.wall(en, rank),
            "start_mono_ns": c.mono_ns(st, rank), "end_mono_ns": c.mono_ns(en, rank),
            "duration_ns": dur, "compute_ns": comp, "collective_wait_ns": cwv.astype(np.int64),
            "dataloader_wait_ns": dlv.astype(np.int64), "checkpoint_ns": ckv.astype(np.int64),
            "num_collectives": ncoll, "loss": _arr(lo, pa.float64(), hl), "local_grad_norm": g,
            "all_finite": finite, "data_position": p, **device, "tokens": tok,
        }
        return _table(Table.STEPS, cols, len(rank))

    def phases(self) -> pa.Table:
        tr = self.tr
        durs = _phase_durations(tr, tr.enter, tr.exit) if tr.cpu_phases is None else list(tr.cpu_phases)
        t0 = tr.start
        fwd, bwd = durs[1], durs[2]
        starts = [t0, t0 + tr.dl, t0 + tr.dl + fwd, t0 + tr.dl + fwd + bwd]
        rank, step = _rank_major(self.step_ok, self.ranks_idx, self.steps_idx)
        st = np.stack(_rank_major(self.step_ok, *starts), axis=1).reshape(-1)
        du = np.stack(_rank_major(self.step_ok, *durs), axis=1).reshape(-1)
        rank4, step4 = np.repeat(rank, 4), np.repeat(step, 4)
        names = np.tile(np.arange(4), len(rank))
        c = self.clock
        cols = {"rank": rank4, "step": step4, "phase": _strings(("data", "forward", "backward", "optimizer"), names),
                "start_wall_ns": c.wall(st, rank4), "start_mono_ns": c.mono_ns(st, rank4),
                "duration_ns": np.rint(du).astype(np.int64)}
        if tr.dev_enter is not None and tr.dev_exit is not None:
            dev = _phase_durations(tr, tr.dev_enter, tr.dev_exit)
            cols["device_duration_ns"] = np.rint(np.stack(_rank_major(self.step_ok, *dev), axis=1).reshape(-1)).astype(np.int64)
        return _table(Table.PHASES, cols, len(rank4))

    def gpu(self) -> pa.Table:
        cfg, topo, tr, rng, inp = self.cfg, self.topo, self.tr, self.rng, self.inp
        S, n, p = cfg.steps, topo.n, H100_SXM
        util = np.round(rng.uniform(85.0, 100.0, (S, n)))
        clock = p.sm_clock_max_mhz * inp.clock_scale - 15 * rng.poisson(0.3, (S, n))
        clock = (np.round(clock / 15) * 15).clip(210, p.sm_clock_max_mhz)
        power = p.idle_power_w + (p.busy_power_w - p.idle_power_w) * util / 100 + rng.normal(0, 8, (S, n))
        power = np.round(power.clip(p.idle_power_w, p.busy_power_w), 2)
        capped = (inp.throttle & int(ThrottleReason.SW_POWER_CAP)) != 0
        power = np.where(capped, np.round(p.power_limit_w - rng.uniform(0, 2, (S, n)), 2), power)
        temp = p.base_temperature_c + np.round(rng.normal(0.0, 1.5, n))[None, :] + np.round(rng.normal(0, 0.5, (S, n)))
        hot = (inp.throttle & int(ThrottleReason.HW_THERMAL_SLOWDOWN)) != 0
        temp = np.where(hot, np.round(rng.uniform(88, 92, (S, n))), temp)
        mem_frac = rng.uniform(0.6, 0.9, n)[None, :] + rng.normal(0, 0.003, (S, n))
        sbe = np.zeros((S, n), np.int64)
        sbe_agg = np.zeros((S, n), np.int64)
        dbe = np.zeros((S, n), np.int64)
        pcie = np.zeros((S, n), np.int64)
        xid = np.zeros((S, n), dtype=bool)
        for f in cfg.faults:
            if isinstance(f, SteadyCounters):
                sbe[:, f.rank] = f.sbe
                sbe_agg[:, f.rank] = f.sbe + 300
                pcie[:, f.rank] = f.pcie_replay
            elif isinstance(f, Corruption) and f.hardware:
                dbe[f.step:, f.rank] += 1
                xid[f.step, f.rank] = True
        m = self.step_ok
        with np.errstate(invalid="ignore"):
            t_mid = tr.start + (tr.end - tr.start) / 2
        rank, step, tm, cl, pw, tp_, ut, mf, th, sb, sa, db, pc, xi = _rank_major(
            m, self.ranks_idx, self.steps_idx, t_mid, clock, power, temp, util, mem_frac, inp.throttle, sbe, sbe_agg,
            dbe, pcie, xid)
        k = len(rank)
        local = topo.local[rank]
        uuids = [replay_uuid(f"host{h}", int(i)) for h, i in zip(topo.host, topo.local)]
        buses = [f"00000000:{(_HGX_BUSES[i] if i < 8 else (0x18 + 0x10 * i) % 0x100):02X}:00.0" for i in topo.local]
        xid_vals = np.full(int(xi.sum()), 48, dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(xi.astype(np.int32))]).astype(np.int32)
        c = self.clock
        zeros = np.zeros(k, np.int64)
        cols = {
            "rank": rank, "device_index": local, "device_uuid": _strings(uuids, rank),
            "pci_bus_id": _strings(buses, rank), "source": _strings(("replay",), np.zeros(k, np.int64)),
            "wall_ns": c.wall(tm, rank), "mono_ns": c.mono_ns(tm, rank), "step": step,
            "sm_clock_mhz": cl.astype(np.int32), "mem_clock_mhz": np.full(k, p.mem_clock_mhz, np.int32),
            "sm_clock_max_mhz": np.full(k, p.sm_clock_max_mhz, np.int32), "power_w": pw,
            "power_limit_w": np.full(k, p.power_limit_w), "temperature_c": tp_, "gpu_util_pct": ut,
            "mem_util_pct": np.round(rng.uniform(35, 65, k)),
            "mem_used_bytes": (p.memory_total_bytes * mf).astype(np.int64), "throttle_reasons": th,
            "ecc_sbe_volatile": sb, "ecc_dbe_volatile": db, "ecc_sbe_aggregate": sa, "ecc_dbe_aggregate": db,
            "pcie_replay": pc, "nvlink_crc_errors": zeros, "nvlink_replay_errors": zeros,
            "nvlink_recovery_errors": zeros,
            "xid_events": pa.ListArray.from_arrays(pa.array(offsets), pa.array(xid_vals, pa.int32())),
            "remapped_rows_correctable": np.zeros(k, np.int32), "remapped_rows_uncorrectable": db.astype(np.int32),
            "remapped_rows_pending": db > 0,
        }
        return _table(Table.GPU, cols, k)

    # -- collectives ----------------------------------------------------------------------------------
    def collectives(self) -> pa.Table:
        cfg, topo, tr, life = self.cfg, self.topo, self.tr, self.life
        S, n = cfg.steps, topo.n
        enter = tr.enter.transpose(2, 0, 1).reshape(n, S * 7)
        exit_ = tr.exit.transpose(2, 0, 1).reshape(n, S * 7)
        death = life.death[:, None]
        with np.errstate(invalid="ignore"):
            entered = np.isfinite(enter) & (enter <= death)
            done = entered & np.isfinite(exit_) & (exit_ <= death)
        slot = np.broadcast_to(np.tile(np.arange(7), S)[None, :], (n, S * 7))
        step = np.broadcast_to(np.repeat(np.arange(S), 7)[None, :], (n, S * 7))
        seq = np.cumsum(entered.reshape(n, S, 7), axis=2).reshape(n, S * 7) - 1
        kind_of_slot = np.array([list(GroupKind).index(k) for k in _SLOT_KIND])
        gseq = np.zeros((n, S * 7), np.int64)
        for kind in (GroupKind.DP, GroupKind.TP, GroupKind.PP):
            mk = entered & (kind_of_slot[slot] == list(GroupKind).index(kind))
            gseq = np.where(mk, np.cumsum(mk, axis=1) - 1, gseq)
        rows = np.flatnonzero(entered.reshape(-1))
        rank = rows // (S * 7)
        col = rows % (S * 7)
        sl, st = slot[rank, col], step[rank, col]
        en, ex, ok = enter[rank, col], exit_[rank, col], done[rank, col]
        dev_rows: tuple[np.ndarray, np.ndarray] | None = None
        if tr.dev_enter is not None and tr.dev_exit is not None:
            d_en = tr.dev_enter.transpose(2, 0, 1).reshape(n, S * 7)[rank, col]
            d_ex = tr.dev_exit.transpose(2, 0, 1).reshape(n, S * 7)[rank, col]
            dev_rows = (d_en - tr.start[step[rank, col], rank], d_ex - d_en)
        gs = gseq[rank, col]
        blocked = life.block >= 0
        self.block_group_seq[blocked] = gseq[np.flatnonzero(blocked), life.block[blocked]]
        # error rows: a blocked peer's operation fails at the process-group timeout
        err = np.flatnonzero(~np.isnan(life.error_at))
        e_col = life.block[err]
        rank = np.concatenate([rank, err])
        sl = np.concatenate([sl, slot[err, e_col]])
        st = np.concatenate([st, step[err, e_col]])
        en = np.concatenate([en, enter[err, e_col]])
        ex = np.concatenate([ex, life.error_at[err]])
        gs = np.concatenate([gs, gseq[err, e_col]])
        seqv = np.concatenate([seq[rows // (S * 7), rows % (S * 7)], seq[err, e_col]])
        status = np.concatenate([np.where(ok, 0, 2), np.ones(len(err), np.int64)])
        order = np.argsort(rank, kind="stable")
        rank, sl, st, en, ex, gs, seqv, status = (a[order] for a in (rank, sl, st, en, ex, gs, seqv, status))
        device: dict[str, Any] = {}
        if dev_rows is not None:
            pad = np.full(len(err), np.nan)
            d_start, d_dur = (np.concatenate([v, pad])[order] for v in dev_rows)
            with np.errstate(invalid="ignore"):
                d_ok = (status == 0) & np.isfinite(d_dur)
            device = {"device_duration_ns": _arr(np.rint(np.where(d_ok, d_dur, 0.0)).astype(np.int64), pa.int64(), d_ok),
                      "device_start_ns": _arr(np.rint(np.where(d_ok, d_start, 0.0)).astype(np.int64), pa.int64(), d_ok)}
        has_exit = status != 2
        exv = np.where(has_exit, ex, 0.0)
        gid = np.choose(np.isin(sl, (_TP_F, _TP_B)).astype(int) + 2 * (sl == _DP),
                        [topo.gid[GroupKind.PP][rank], topo.gid[GroupKind.TP][rank], topo.gid[GroupKind.DP][rank]])
        catalog = pa.array([list(g.ranks) for g in topo.infos], type=pa.list_(pa.int32()))
        peer = tr.peer[sl, rank]
        ops = np.array([0 if o == "recv" else 1 if o == "all_reduce" else 2 for o in _SLOT_OP])[sl]
        c = self.clock
        names = [g.name for g in topo.infos]
        errors = np.where(status == 1, 0, 0)
        msg = (f"DistBackendError: [PG timeout] operation timed out after {cfg.pg_timeout_s:g}s "
               "waiting for peers")
        cols = {
            "rank": rank, "step": st, "seq": seqv, "group_seq": gs, "op": _strings(("recv", "all_reduce", "send"), ops),
            "group": _strings(names, gid), "group_ranks": catalog.take(pa.array(gid)),
            "peer": _arr(peer, pa.int32(), peer >= 0), "bytes": tr.nbytes[sl, rank],
            "dtype": _strings(("bfloat16", "float32"), (sl == _DP).astype(np.int64)),
            "async_op": np.zeros(len(rank), bool),
            "enter_wall_ns": c.wall(en, rank), "enter_mono_ns": c.mono_ns(en, rank),
            "exit_wall_ns": _arr(c.wall(exv, rank), pa.int64(), has_exit),
            "exit_mono_ns": _arr(c.mono_ns(exv, rank), pa.int64(), has_exit),
            "duration_ns": _arr(np.rint(exv - en).astype(np.int64), pa.int64(), has_exit),
            "status": _strings((str(CollectiveStatus.OK), str(CollectiveStatus.ERROR), str(CollectiveStatus.IN_FLIGHT)),
                               status),
            "error": _strings((msg,), errors, status == 1), **device,
        }
        self.block_slot_gid = {int(r): int(g) for r, g, s_ in zip(rank, gid, status) if s_ == 2}
        return _table(Table.COLLECTIVES, cols, len(rank))

    # -- events ---------------------------------------------------------------------------------------
    def events(self) -> pa.Table:
        cfg, topo, tr, life = self.cfg, self.topo, self.tr, self.life
        n, S, hb = topo.n, cfg.steps, cfg.heartbeat_s * _NS
        limit = np.minimum(life.death, life.clean_end)
        count = np.maximum(0, np.ceil((limit - life.started) / hb) - 1).astype(np.int64)
        count = np.where(np.isfinite(limit), count, 0)
        h_rank = np.repeat(np.arange(n), count)
        k = np.arange(len(h_rank)) - np.repeat(np.cumsum(count) - count, count) + 1
        h_t = life.started[h_rank] + k * hb
        h_step = np.full(len(h_rank), -1, np.int64)
        offs = np.concatenate([[0], np.cumsum(count)])
        starts = np.where(np.isfinite(tr.start), tr.start, np.inf)
        for r in range(n):
            a, b = offs[r], offs[r + 1]
            if a < b:
                h_step[a:b] = np.searchsorted(starts[:, r], h_t[a:b], side="right") - 1
        in_coll = (life.block[h_rank] >= 0) & (h_t >= np.nan_to_num(life.block_enter[h_rank], nan=np.inf))
        # special events
        ev = sorted(life.events, key=lambda e: (e[0], e[1]))
        e_rank = np.array([e[0] for e in ev], np.int64)
        e_t = np.array([e[1] for e in ev])
        e_kind = [str(e[2]) for e in ev]
        e_step = np.array([-1 if e[3] is None else e[3] for e in ev], np.int64)
        kinds = [str(k_) for k_ in EventKind]
        rank = np.concatenate([np.arange(n), h_rank, e_rank])
        t = np.concatenate([life.started, h_t, e_t])
        kind = np.concatenate([np.full(n, kinds.index("start")), np.full(len(h_rank), kinds.index("heartbeat")),
                               np.array([kinds.index(x) for x in e_kind], np.int64)]).astype(np.int64)
        step = np.concatenate([np.full(n, -1), h_step, e_step])
        is_exc = np.concatenate([np.zeros(n + len(h_rank), bool), np.array([e[2] is EventKind.EXCEPTION for e in ev], bool)])
        coll = is_exc.copy()
        coll[n:n + len(h_rank)] = in_coll
        pids = 1000 + (np.arange(n) * 7919 + cfg.seed * 31) % 60000
        messages = [f"pid={p}" for p in pids] + [e[5] or "" for e in ev]
        msg_idx = np.concatenate([np.arange(n), np.zeros(len(h_rank), np.int64), n + np.arange(len(ev))])
        msg_ok = np.concatenate([np.ones(n, bool), np.zeros(len(h_rank), bool), np.array([e[5] is not None for e in ev], bool)])
        exc_msg = (f"Watchdog caught collective operation timeout: ran for {int(cfg.pg_timeout_s * 1000)} "
                   "milliseconds before timing out")
        for i, e in enumerate(ev):
            if e[2] is EventKind.EXCEPTION:
                messages[n + i] = exc_msg
                msg_ok[n + len(h_rank) + i] = True
        sig = np.concatenate([np.zeros(n + len(h_rank), np.int64), np.array([e[6] or 0 for e in ev], np.int64)])
        code = np.concatenate([np.zeros(n + len(h_rank), np.int64), np.array([e[7] if e[7] is not None else 0 for e in ev], np.int64)])
        order = np.lexsort((t, rank))
        rank, t, kind, step, coll, msg_idx, msg_ok, sig, code = (
            a[order] for a in (rank, t, kind, step, coll, msg_idx, msg_ok, sig, code))
        is_exc = is_exc[order]
        kinds_sorted = np.array(kinds)[kind]
        blk = np.maximum(life.block[rank], 0)
        gid = np.array([self.block_slot_gid.get(int(r), 0) for r in rank], np.int64)
        op_idx = np.array([0 if _SLOT_OP[b % 7] == "recv" else 1 if _SLOT_OP[b % 7] == "all_reduce" else 2 for b in blk])
        c = self.clock
        cols = {
            "rank": rank, "attempt": np.zeros(len(rank), np.int32), "wall_ns": c.wall(t, rank),
            "mono_ns": c.mono_ns(t, rank), "kind": _strings(kinds, kind),
            "step": _arr(step, pa.int64(), step >= 0),
            "exc_type": _strings(("DistBackendError",), np.zeros(len(rank), np.int64), is_exc),
            "message": _strings(messages, msg_idx, msg_ok),
            "collective_op": _strings(("recv", "all_reduce", "send"), op_idx, coll),
            "collective_group": _strings([g.name for g in topo.infos], gid, coll),
            "collective_seq": _arr(self.block_group_seq[rank], pa.int64(), coll),
            "signal": _arr(sig, pa.int32(), kinds_sorted == "signal"),
            "exit_code": _arr(code, pa.int32(), kinds_sorted == "exit"),
        }
        return _table(Table.EVENTS, cols, len(rank))

    # -- checkpoints, fingerprints, topology ------------------------------------------------------------
    def checkpoint_phases(self) -> pa.Table:
        tr, n = self.tr, self.topo.n
        cs = self.inp.ckpt_steps
        if len(cs) == 0:
            return _table(Table.CHECKPOINT_PHASES, {}, 0)
        share = np.array([0.05, 0.75, 0.15, 0.05])
        total = tr.ckpt[cs]  # (C, N)
        begin = tr.end[cs] - total
        ok = self.step_ok[cs]
        rank, step, tot, beg = _rank_major(ok, self.ranks_idx[cs], self.steps_idx[cs], total, begin)
        k = len(rank)
        durs = tot[:, None] * share[None, :]
        starts = beg[:, None] + np.concatenate([np.zeros((k, 1)), np.cumsum(durs, axis=1)[:, :-1]], axis=1)
        r4, s4 = np.repeat(rank, 4), np.repeat(step, 4)
        st, du = starts.reshape(-1), durs.reshape(-1)
        en = st + du
        ph = np.tile(np.arange(4), k)
        nb = 4 * _param_count(self.topo)[r4] * 3
        c = self.clock
        phases = [str(p) for p in (CheckpointPhase.SNAPSHOT, CheckpointPhase.WRITE, CheckpointPhase.FSYNC,
                                   CheckpointPhase.PUBLISH)]
        ids = [f"step-{s:08d}" for s in range(self.cfg.steps)]
        cols = {
            "rank": r4, "step": s4, "checkpoint_id": _strings(ids, s4), "phase": _strings(phases, ph),
            "start_wall_ns": c.wall(st, r4), "start_mono_ns": c.mono_ns(st, r4),
            "end_wall_ns": c.wall(en, r4), "end_mono_ns": c.mono_ns(en, r4),
            "duration_ns": np.rint(en).astype(np.int64) - np.rint(st).astype(np.int64),
            "bytes": _arr(nb, pa.int64(), (ph == 0) | (ph == 2)), "ok": np.ones(len(r4), bool),
        }
        return _table(Table.CHECKPOINT_PHASES, cols, len(r4))

    def fingerprints(self) -> pa.Table:
        cfg, topo = self.cfg, self.topo
        S, every = cfg.steps, cfg.fingerprint_every
        fps = sorted(set(range(0, S, every)) | {S - 1})
        fp_idx = {s: i for i, s in enumerate(fps)}
        # per rank: (field -> (first fingerprint index the field differs, tag))
        perturb: dict[int, dict[str, tuple[int, str]]] = {}

        def first_fp(step: int) -> int:
            return next((i for i, s in enumerate(fps) if s >= step), len(fps))

        def mark(r: int, name: str, k: int, tag: str) -> None:
            cur = perturb.setdefault(r, {})
            if name not in cur or cur[name][0] > k:
                cur[name] = (k, tag)

        for f in cfg.faults:
            if isinstance(f, Divergence):
                k0 = first_fp(f.step)
                for r in _div_ranks(f, cfg.layout):
                    label = f"{f.field}:{r}:{f.step}"
                    if f.field is DivergeField.RNG:
                        mark(r, "rng_torch", k0, label)
                    elif f.field is DivergeField.STEP:
                        mark(r, "step", k0, label)
                    mark(r, "param", k0 + 1, label)
                    mark(r, "optim", k0 + 1, label)
            elif isinstance(f, Corruption) and f.kind is CorruptionKind.BITFLIP_PARAM:
                k0 = first_fp(f.step)
                mark(f.rank, "param", k0, f"flip:{f.rank}:{f.step}")
                mark(f.rank, "optim", k0 + 1, f"flip:{f.rank}:{f.step}")
        ok = self.step_ok[fps]
        rank, step = _rank_major(ok, self.ranks_idx[fps], self.steps_idx[fps])
        k = len(rank)
        domain = topo.gid[GroupKind.DP][rank]
        cache: dict[tuple[object, ...], str] = {}

        def hashed(*key: object) -> str:
            v = cache.get(key)
            if v is None:
                v = cache[key] = _h(cfg.seed, *key)
            return v

        def tag(r: int, name: str, i: int) -> str:
            p = perturb.get(r, {}).get(name)
            return p[1] if p is not None and i >= p[0] else ""

        param, optim, rng_t = [], [], []
        step_out = step.copy()
        for j in range(k):
            r, s, d = int(rank[j]), int(step[j]), int(domain[j])
            i = fp_idx[s]
            param.append(hashed(d, s, "param", tag(r, "param", i)))
            optim.append(hashed(d, s, "optim", tag(r, "optim", i)))
            rng_t.append(hashed("rng_torch", tag(r, "rng_torch", i)))
            if tag(r, "step", i):
                step_out[j] = s + 1
        end = self.tr.end[step, rank]
        c = self.clock
        names = [g.name for g in topo.infos]
        catalog = pa.array([list(g.ranks) for g in topo.infos], type=pa.list_(pa.int32()))
        cols = {
            "rank": rank, "step": step_out, "attempt": [0] * k, "wall_ns": c.wall(end + 2e5, rank),
            "domain": _strings(names, domain),
            "domain_ranks": catalog.take(pa.array(domain)), "param_hash": param, "optim_hash": optim,
            "rng_python_hash": [hashed("rng_python")] * k, "rng_numpy_hash": [hashed("rng_numpy")] * k,
            "rng_torch_hash": rng_t, "rng_cuda_hash": [hashed("rng_cuda")] * k,
            "data_position": self.pos[step, rank], "param_count": _param_count(topo)[rank],
        }
        return _table(Table.FINGERPRINTS, cols, k)

    def topology(self) -> pa.Table:
        cfg, topo = self.cfg, self.topo
        n, lay = topo.n, cfg.layout
        structs = [{"name": g.name, "kind": str(g.kind), "ranks": list(g.ranks), "hosts": list(g.hosts),
                    "links": list(g.links)} for g in topo.infos]
        groups = [[structs[0], structs[topo.gid[GroupKind.DP][r]], structs[topo.gid[GroupKind.TP][r]],
                   structs[topo.gid[GroupKind.PP][r]]] for r in range(n)]
        r = np.arange(n)
        uuids = [replay_uuid(f"host{h}", int(i)) for h, i in zip(topo.host, topo.local)]
        buses = [f"00000000:{(_HGX_BUSES[i] if i < 8 else (0x18 + 0x10 * i) % 0x100):02X}:00.0" for i in topo.local]
        c = self.clock
        cols = {
            "rank": r, "attempt": np.zeros(n, np.int32), "world_size": np.full(n, n, np.int32),
            "local_rank": topo.local, "host": [f"host{h}" for h in topo.host],
            "pid": 1000 + (r * 7919 + cfg.seed * 31) % 60000,
            "start_wall_ns": c.wall(self.life.started - 5e7, r), "backend": ["nccl"] * n, "device_index": topo.local,
            "device_uuid": uuids, "pci_bus_id": buses, "numa_node": topo.local // 4, "dp": topo.dp, "tp": topo.tp,
            "pp": topo.pp, "dp_size": np.full(n, lay.dp), "tp_size": np.full(n, lay.tp),
            "pp_size": np.full(n, lay.pp), "groups": groups,
        }
        return _table(Table.TOPOLOGY, cols, n)


def _phase_durations(tr: _Trace, enter: np.ndarray, exit_: np.ndarray) -> list[np.ndarray]:
    """Durations of data, forward, backward and optimizer on the clock `enter`/`exit_` run on: the rank's compute
    share of each phase plus the time inside its collectives (a host stall at the start of forward included)."""
    with np.errstate(invalid="ignore"):
        d = np.nan_to_num(np.where(tr.applies[None], exit_ - enter, 0.0), nan=0.0)
    fwd = (_FWD1 + _FWD2) * tr.comp + d[:, [_RECV_F, _TP_F, _SEND_F]].sum(axis=1) + tr.stall
    bwd = (_BWD1 + _BWD2) * tr.comp + d[:, [_RECV_B, _TP_B, _SEND_B, _DP]].sum(axis=1)
    return [tr.dl, fwd, bwd, _OPT * tr.comp]


def _write_parts(out: Path, table: Table, data: pa.Table, n: int) -> None:
    ranks = data.column("rank").to_numpy()
    bounds = np.searchsorted(ranks, np.arange(n + 1))

    def write(r: int) -> None:
        part = data.slice(int(bounds[r]), int(bounds[r + 1] - bounds[r]))
        if part.num_rows == 0 and table is not Table.TOPOLOGY:
            return
        d = out / TELEMETRY_DIR / str(table) / f"{PARTITION_KEY}={r}"
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / _PART, lambda tmp: pq.write_table(part, tmp, compression="zstd"),
                     durable=False)  # simulated: made again from its seed

    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        list(pool.map(write, range(n)))
