"""From a simulated run to telemetry part files: every table, as a real collector would have filled it.

Clocks: true time is seconds from the first step's origin; a host's wall clock is true time plus its offset (and an
NTP step, if any), its monotonic clock true time minus its own origin. A rank's part-file writer flushes every
`FLUSH_S` seconds (its own phase); a rank that vanishes or is SIGKILLed loses what it had not flushed, and every
flush snapshots the collectives open longer than `INFLIGHT_S` as ``in_flight`` rows. Rows are vectorized per table
and split by rank at the end: one part file per table and rank.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from rankwatch.base.schema import GROUP_STRUCT, Table, storage_schema
from rankwatch.collector.sink import dictionary_columns, partition_dir

from .noise import Draw
from .timeline import CKPT_PHASES, PHASES, Sim

FLUSH_S = 5.0
INFLIGHT_S = 0.5
HEARTBEAT_S = 1.0
GPU_S = 1.0
DEVICE_RESOLVE_S = 30.0
_NS = 1e9


@dataclass(slots=True)
class _Life:
    """Per rank: when it started, when its rows stop (last flush kept), and its heartbeat end."""

    start: np.ndarray
    end: np.ndarray
    """(N,) last moment the rank's threads ran (heartbeats and samples stop there)."""
    cut: np.ndarray
    """(N,) rows emitted after this moment were never written (inf: all written)."""
    flushes: list[np.ndarray]
    first: np.ndarray
    """(N,) the rank's first periodic flush (then every FLUSH_S)."""


def _hex(values: np.ndarray) -> np.ndarray:
    return np.array([f"{v:016x}" for v in values.tolist()], dtype=object)


def _mix(*parts: np.ndarray | int) -> np.ndarray:
    """splitmix64 over the parts: a stand-in for XXH3 of a state."""
    x = np.zeros(np.broadcast(*[np.asarray(p) for p in parts]).shape, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            x = x ^ np.asarray(p, dtype=np.uint64)
            x = x + np.uint64(0x9E3779B97F4A7C15)
            z = x
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = z ^ (z >> np.uint64(31))
    return x


class Builder:
    def __init__(self, draw: Draw, sim: Sim, seed: int, rng: np.random.Generator) -> None:
        self.d, self.sim, self.seed, self.rng = draw, sim, seed, rng
        self.w = draw.world
        self.gpu = draw.plan.timing == "gpu"
        self.host = self.w.host_index
        self.woff_ns = np.round(draw.wall_offset * _NS).astype(np.int64)
        self.mono_ns = np.round(draw.mono_origin * _NS).astype(np.int64)
        self.t0_ns = np.int64(int(draw.t0_wall_s * _NS))
        self.rows: dict[Table, dict[str, object]] = {}
        self.in_flight: list[tuple[int, int, int, float]] = []
        self._life()

    # -- clocks ------------------------------------------------------------------------------------------------
    def abs_s(self, step: np.ndarray | int, rel: np.ndarray) -> np.ndarray:
        return self.sim.origin[step] + rel

    def wall(self, t: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        ns = np.round(np.asarray(t) * _NS).astype(np.int64)
        out = self.t0_ns + ns + self.woff_ns[self.host[ranks]]
        st = self.d.ntp_step
        if st is not None:
            h, s, jump = st
            at = self.sim.origin[min(s, self.sim.steps - 1)]
            out = out + np.where((self.host[ranks] == h) & (np.asarray(t) >= at), np.int64(jump * _NS), 0)
        return out

    def mono(self, t: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        return np.round(np.asarray(t) * _NS).astype(np.int64) + self.mono_ns[self.host[ranks]]

    # -- lifetimes -----------------------------------------------------------------------------------------------
    def _life(self) -> None:
        d, sim, rng, n = self.d, self.sim, self.rng, self.w.n
        e = d.ending
        start = -rng.uniform(20.0, 45.0) - rng.uniform(0, 3.0, size=n)
        last = sim.steps - 1
        end = np.full(n, np.nan)
        cut = np.full(n, np.inf)
        ends = sim.origin[:, None] + sim.cpu_end
        finite_last = np.where(np.isfinite(ends[last]), ends[last], np.nan)
        self.error_at = np.full(n, np.nan)
        self.blocked: dict[int, tuple[int, int]] = {}
        """rank -> (op index, step) of the collective it was left inside."""
        if e.kind == "ok":
            end[:] = finite_last + rng.uniform(0.3, 2.0, size=n)
        elif e.kind == "kill":
            t_kill = sim.origin[last] + float(rng.uniform(0.2, 0.8)) * float(np.nanmax(sim.cpu_end[last]))
            self.kill_at = t_kill
            end[:] = t_kill + rng.uniform(0, 0.02, size=n)
        else:
            td = float(sim.death_time)  # type: ignore[arg-type]
            self._blocked_ops()
            if e.kind == "hang":
                end[:] = td + e.tail_s
            else:
                end[e.rank] = td + (0.3 if e.cause in ("exception", "signal") else 0.0)
                quick = e.cause != "vanished" and not self.gpu
                for r, (oi, s) in self.blocked.items():
                    if r == e.rank:
                        continue
                    op = sim.ops[oi]
                    entered = sim.origin[s] + (op.enter if not self.gpu else op.enter)[s, r]
                    self.error_at[r] = (max(entered, td) + rng.uniform(0.01, 1.5)) if quick else entered + e.timeout_s
                others = np.isnan(end)
                # ranks not left inside any collective (gpu: every peer waits at its sync) fail with their peers
                fallback = td + (e.timeout_s if not quick else 2.0)
                err = np.where(np.isnan(self.error_at), fallback + rng.uniform(0, 1.0, size=n), self.error_at)
                err[e.rank] = np.nan
                self.error_at = err
                end[others] = err[others] + rng.uniform(0.1, 0.8, size=int(others.sum()))
        flushes = []
        phase = rng.uniform(0, FLUSH_S, size=n)
        freeze = sim.freeze_span
        for r in range(n):
            f = np.arange(start[r] + phase[r], end[r] + 1e-9, FLUSH_S)
            if freeze is not None and r == d.plan.freeze[0]:  # type: ignore[index]
                f = f[(f < freeze[0]) | (f > freeze[1])]
            flushes.append(f)
        vanish = (e.kind == "fail" and e.cause == "vanished")
        if vanish or (e.kind == "kill" and e.cause == "sigkill") or e.kind == "hang":
            who = [e.rank] if vanish else range(n)
            for r in who:
                f = flushes[r]
                cut[r] = f[-1] if len(f) else start[r]
        else:
            for r in range(n):  # the collector's close flushes once more
                flushes[r] = np.append(flushes[r], end[r])
        self.life = _Life(start=start, end=end, cut=cut, flushes=flushes, first=start + phase)

    def _blocked_ops(self) -> None:
        """Where each rank was left: the first op it entered and never left (in the failing step or the next)."""
        sim = self.sim
        best: dict[int, tuple[float, int, int]] = {}
        for s in range(max(0, sim.steps - 2), sim.steps):
            for oi, op in enumerate(sim.ops):
                en, ex = op.enter[s], op.exit[s]
                for r in np.where(np.isfinite(en) & np.isinf(ex))[0].tolist():
                    t = float(sim.origin[s] + en[r])
                    if r not in best or t < best[r][0]:
                        best[r] = (t, oi, s)
        self.blocked = {r: (oi, s) for r, (_, oi, s) in best.items()}

    # -- tables --------------------------------------------------------------------------------------------------
    def build(self) -> dict[Table, pa.Table]:
        out = {}
        out[Table.TOPOLOGY] = self.topology()
        out[Table.STEPS], out[Table.PHASES] = self.steps_and_phases()
        out[Table.COLLECTIVES] = self.collectives()
        out[Table.CHECKPOINT_PHASES] = self.checkpoints()
        out[Table.FINGERPRINTS] = self.fingerprints()
        out[Table.EVENTS] = self.events()
        out[Table.GPU] = self.gpu_samples()
        return out

    def _table(self, table: Table, cols: dict[str, object]) -> pa.Table:
        schema = storage_schema(table)
        arrays: list[pa.Array | pa.ChunkedArray | None] = []
        for f in schema:
            v = cols.get(f.name)
            if v is None:  # a column this source does not model (steps.tokens): null, as from a job that never sets it
                arrays.append(None)
            elif isinstance(v, pa.Array | pa.ChunkedArray):
                arrays.append(v.cast(f.type) if v.type != f.type else v)
            elif isinstance(v, tuple):
                vals, mask = v
                arrays.append(pa.array(vals, type=f.type, mask=mask, from_pandas=False))
            else:
                arrays.append(pa.array(v, type=f.type))
        n = next((len(a) for a in arrays if a is not None), 0)
        return pa.Table.from_arrays([a if a is not None else pa.nulls(n, f.type) for a, f in zip(arrays, schema)],
                                    schema=schema)

    def topology(self) -> pa.Table:
        w, rng, n = self.w, self.rng, self.w.n
        structs = pa.array(
            [{"name": g.name, "kind": str(g.kind), "ranks": list(g.ranks), "hosts": list(g.hosts),
              "links": list(g.links)} for g in w.groups], type=GROUP_STRUCT)
        idx = np.stack([np.zeros(n, dtype=np.int64), w.dp_group, w.tp_group, w.pp_group], axis=1).reshape(-1)
        groups = pa.ListArray.from_arrays(pa.array(np.arange(0, 4 * n + 1, 4, dtype=np.int32)), structs.take(pa.array(idx)))
        r = np.arange(n)
        local = r % 8
        return self._table(Table.TOPOLOGY, {
            "rank": r, "attempt": np.zeros(n), "world_size": np.full(n, n), "local_rank": local,
            "host": [w.hosts[h] for h in self.host], "pid": rng.integers(1000, 4_000_000, size=n),
            "start_wall_ns": self.wall(self.life.start, r), "backend": ["nccl" if self.gpu else "gloo"] * n,
            "device_index": local, "device_uuid": list(w.uuids), "pci_bus_id": list(w.pci_ids),
            "numa_node": local // 4, "dp": w.dp_of, "tp": w.tp_of, "pp": w.pp_of,
            "dp_size": np.full(n, w.dp), "tp_size": np.full(n, w.tp), "pp_size": np.full(n, w.pp), "groups": groups,
        })

    def _step_ok(self) -> np.ndarray:
        """(S, N) steps that ended and whose rows were written."""
        sim = self.sim
        end = sim.origin[:, None] + sim.cpu_end
        ok = np.isfinite(end) & (end <= self.life.cut[None, :])
        if self.d.ending.kind == "kill":
            ok &= end <= self.kill_at
        return ok

    def steps_and_phases(self) -> tuple[pa.Table, pa.Table]:
        d, sim, w = self.d, self.sim, self.w
        S, n = sim.steps, w.n
        ok = self._step_ok()
        self.ok = ok
        wait = np.zeros((S, n))
        count = np.zeros((S, n), dtype=np.int64)
        dev_coll = np.zeros((S, n))
        for op in sim.ops:
            dur = op.cpu_exit - op.cpu_enter
            m = np.isfinite(dur)
            wait += np.where(m, dur, 0.0)
            count += np.isfinite(op.cpu_enter)
            dd = op.exit - op.enter
            dev_coll += np.where(np.isfinite(dd), dd, 0.0)
        ckpt = np.zeros((S, n))
        for s, phases in sim.ckpt.items():
            for p in CKPT_PHASES:
                a, b = phases[p]
                ckpt[s] += b - a
            a, b = phases["barrier"]
            wait[s] += b - a
            count[s] += 1
            ckpt[s, 0] += np.nan_to_num(phases["publish"][1][0] - phases["publish"][0][0])
        with np.errstate(invalid="ignore"):
            dur = sim.cpu_end - sim.start
        dl = d.plan.dl_wait[:S]
        compute = np.maximum(0.0, dur - wait - dl - ckpt)
        si, ri = np.nonzero(ok)
        start_abs = self.abs_s(si, sim.start[si, ri])
        end_abs = self.abs_s(si, sim.cpu_end[si, ri])
        num = d.num
        last = (w.pp_of == w.pp - 1)
        loss = num.loss[:S][:, w.dp_of].copy()
        for r, s0, k in num.non_finite_loss:
            loss[s0:s0 + k, r] = np.nan
        loss_mask = ~last[ri]
        gn = num.gnorm[:S]
        finite = (np.isfinite(loss[si, ri]) | loss_mask) & np.isfinite(gn[si, ri])
        dpos = (si + 1).astype(np.int64) * num.global_batch
        if num.dpos_offset is not None:
            off, s0 = num.dpos_offset
            dpos = dpos + np.where(si >= s0, off[ri], 0)
        ns = lambda a: np.round(a * _NS).astype(np.int64)  # noqa: E731
        # wall times of a step's rows derive from its monotonic times and the offset at its start
        mono_start = self.mono(start_abs, ri)
        offset = self.wall(start_abs, ri) - mono_start
        mono_end = self.mono(end_abs, ri)
        cols: dict[str, object] = {
            "rank": ri, "step": si, "attempt": np.zeros(len(si)), "start_wall_ns": mono_start + offset,
            "end_wall_ns": mono_end + offset, "start_mono_ns": mono_start, "end_mono_ns": mono_end,
            "duration_ns": mono_end - mono_start, "compute_ns": ns(compute[si, ri]),
            "collective_wait_ns": ns(wait[si, ri]), "dataloader_wait_ns": ns(dl[si, ri]),
            "checkpoint_ns": ns(ckpt[si, ri]), "num_collectives": count[si, ri],
            "loss": (loss[si, ri], loss_mask), "local_grad_norm": (gn[si, ri], None), "all_finite": finite,
            "data_position": (dpos, None),
        }
        if self.gpu:
            dev_ns = np.maximum(0.0, mono_end - mono_start - 5_000) / _NS
            dc = np.minimum(dev_coll[si, ri], dev_ns)
            cols |= {"device_ns": (ns(dev_ns), None), "device_compute_ns": (ns(dev_ns - dc), None),
                     "device_collective_ns": (ns(dc), None)}
        else:
            z = np.zeros(len(si), dtype=np.int64)
            cols |= {k: (z, np.ones(len(si), bool)) for k in ("device_ns", "device_compute_ns", "device_collective_ns")}
        steps = self._table(Table.STEPS, cols)
        self.step_offset = (si, ri, offset)
        # phases: those that ended (the failing step's finished phases too), while the rank's rows were written
        rows_r, rows_s, rows_p, rows_a, rows_dur, rows_dev = [], [], [], [], [], []
        for p in PHASES:
            a, b = sim.phase_cpu[p]
            la, lb = sim.phase_lane[p]
            endp = sim.origin[:, None] + b
            m = np.isfinite(endp) & (endp <= self.life.cut[None, :]) & np.isfinite(a)
            if d.ending.kind == "kill":
                m &= endp <= self.kill_at
            ps, pr = np.nonzero(m)
            rows_r.append(pr)
            rows_s.append(ps)
            rows_p.append(np.full(len(pr), PHASES.index(p)))
            rows_a.append(self.abs_s(ps, a[ps, pr]))
            rows_dur.append(b[ps, pr] - a[ps, pr])
            with np.errstate(invalid="ignore"):
                rows_dev.append(lb[ps, pr] - la[ps, pr])
        pr, ps = np.concatenate(rows_r), np.concatenate(rows_s)
        pa_ = np.concatenate(rows_a)
        pdur = np.concatenate(rows_dur)
        pdev = np.concatenate(rows_dev)
        pm = self.mono(pa_, pr)
        names = pa.DictionaryArray.from_arrays(pa.array(np.concatenate(rows_p).astype(np.int32)), pa.array(PHASES))
        dev_ok = np.isfinite(pdev) if self.gpu else np.zeros(len(pr), bool)
        phases_t = self._table(Table.PHASES, {
            "rank": pr, "step": ps, "phase": names.cast(pa.string()),
            "start_wall_ns": self.wall(pa_, pr), "start_mono_ns": pm, "duration_ns": ns(pdur),
            "device_duration_ns": (ns(np.nan_to_num(pdev, posinf=0.0)), ~dev_ok),
        })
        return steps, phases_t

    def collectives(self) -> pa.Table:
        d, sim, w = self.d, self.sim, self.w
        S, n = sim.steps, w.n
        ck_steps = np.array(sorted(sim.ckpt), dtype=np.int64)
        parts: list[dict[str, np.ndarray]] = []
        dev_start = sim.start + 5e-6
        kill = getattr(self, "kill_at", np.inf)
        for oi, op in enumerate(sim.ops):
            seq_before = np.zeros(n, dtype=np.int64)
            for prev in sim.ops[:oi]:
                seq_before += prev.member
            m = np.isfinite(op.cpu_enter) & (self.abs_s(np.arange(S)[:, None], op.cpu_enter) <= kill)
            si, ri = np.nonzero(m)
            enter = self.abs_s(si, op.cpu_enter[si, ri])
            exit_ = self.abs_s(si, op.cpu_exit[si, ri])
            gseq = si * op.per_step[ri] + op.order[ri]
            dev = op.exit[si, ri] - op.enter[si, ri]
            dstart = op.enter[si, ri] - dev_start[si, ri]
            parts.append({"oi": np.full(len(si), oi), "s": si, "r": ri, "seq": seq_before[ri], "gseq": gseq,
                          "group": op.group[ri], "peer": op.peer[ri], "bytes": op.nbytes[ri], "enter": enter,
                          "exit": exit_, "dev": dev, "dstart": dstart})
        for s, phases in sim.ckpt.items():
            a, b = phases["barrier"]
            ri = np.arange(n)
            si = np.full(n, s)
            seq: npt.NDArray[np.int64] = np.asarray(sum(op.member.astype(np.int64) for op in sim.ops))
            parts.append({"oi": np.full(n, len(sim.ops)), "s": si, "r": ri, "seq": seq,
                          "gseq": np.searchsorted(ck_steps, s, side="left") + np.zeros(n, dtype=np.int64),
                          "group": np.zeros(n, dtype=np.int64), "peer": np.full(n, -1), "bytes": np.zeros(n, dtype=np.int64),
                          "enter": sim.origin[s] + a, "exit": sim.origin[s] + b, "dev": b - a, "dstart": a - dev_start[s]})
        c = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        r, enter, exit_ = c["r"], c["enter"], c["exit"]
        e = d.ending
        cut = self.life.cut[r]
        status = np.zeros(len(r), dtype=np.int32)  # 0 ok, 1 error, 2 in_flight
        error = np.full(len(r), None, dtype=object)
        exit_t = exit_.copy()
        if e.kind == "fail" and not self.gpu:
            for rank, (oi, s) in self.blocked.items():
                if rank == e.rank or np.isnan(self.error_at[rank]):
                    continue
                idx = np.where((c["r"] == rank) & (c["oi"] == oi) & (c["s"] == s))[0]
                if len(idx):
                    i = idx[0]
                    exit_t[i] = self.error_at[rank]
                    status[i] = 1
                    error[i] = self._error_text(rank)
        self.open_ops = (r, enter, np.where(np.isnan(exit_t), np.inf, exit_t), c["oi"], c["group"], c["gseq"],
                         np.zeros(len(r), dtype=np.int32))
        written = np.isfinite(exit_t) & (exit_t <= cut)
        if np.isfinite(kill):
            written &= exit_t <= kill
        # in-flight snapshots at each flush of ops open longer than INFLIGHT_S there
        snap_i, snap_t = self._snapshots(r, enter, exit_t, kill)
        keep = np.where(written)[0]
        rows = np.concatenate([keep, snap_i])
        st = np.concatenate([status[keep], np.full(len(snap_i), 2, dtype=np.int32)])
        fin = st != 2
        rr, ss = r[rows], c["s"][rows]
        en = enter[rows]
        ex = np.where(fin, exit_t[rows], np.nan)
        # wall derives from the step's offset at its start (the rank's own wall − mono)
        mono_en = self.mono(en, rr)
        step_start_abs = self.abs_s(ss, sim.start[ss, rr])
        offset = self.wall(step_start_abs, rr) - self.mono(step_start_abs, rr)
        mono_ex = self.mono(np.nan_to_num(ex), rr)
        dev = c["dev"][rows]
        dev_ok = self.gpu & fin & np.isfinite(dev) & (st == 0)
        if self.gpu and e.kind != "ok":  # the failing step's device marks never resolved: written with nulls
            stop = d.plan.death.step if d.plan.death is not None else sim.steps - 1
            dev_ok &= ss < stop
        ns = lambda a: np.round(np.nan_to_num(a, posinf=0.0, neginf=0.0) * _NS).astype(np.int64)  # noqa: E731
        kinds = [op.op for op in sim.ops] + ["barrier"]
        gnames = pa.array([g.name for g in w.groups])
        granks = pa.array([list(g.ranks) for g in w.groups], type=pa.list_(pa.int32()))
        group_idx = pa.array(c["group"][rows])
        peer = c["peer"][rows]
        dtype = np.where(c["oi"][rows] == len(sim.ops), 0, np.where(np.array(kinds)[c["oi"][rows]] == "all_reduce", 1, 2))
        err_col = np.concatenate([error[keep], np.full(len(snap_i), None, dtype=object)])
        order = np.lexsort((np.where(st == 2, 1, 0), en, rr))
        tbl = self._table(Table.COLLECTIVES, {
            "rank": rr, "step": ss, "seq": c["seq"][rows], "group_seq": c["gseq"][rows],
            "op": pa.DictionaryArray.from_arrays(pa.array(c["oi"][rows].astype(np.int32)), pa.array(kinds)).cast(pa.string()),
            "group": gnames.take(group_idx), "group_ranks": granks.take(group_idx),
            "peer": (peer, peer < 0), "bytes": c["bytes"][rows],
            "dtype": pa.DictionaryArray.from_arrays(pa.array(dtype.astype(np.int32)),
                                                    pa.array(["uint8", "float32", "bfloat16"])).cast(pa.string()),
            "async_op": np.zeros(len(rows), bool),
            "enter_wall_ns": mono_en + offset, "enter_mono_ns": mono_en,
            "exit_wall_ns": (mono_ex + offset, ~fin), "exit_mono_ns": (mono_ex, ~fin),
            "duration_ns": (mono_ex - mono_en, ~fin),
            "device_duration_ns": (ns(dev), ~dev_ok), "device_start_ns": (ns(c["dstart"][rows]), ~dev_ok),
            "status": pa.DictionaryArray.from_arrays(pa.array(st), pa.array(["ok", "error", "in_flight"])).cast(pa.string()),
            "error": list(err_col),
        })
        return tbl.take(pa.array(order))

    def _snapshots(self, r: np.ndarray, enter: np.ndarray, exit_t: np.ndarray, kill: float) -> tuple[np.ndarray, np.ndarray]:
        """(row index, flush time) of every in-flight snapshot: each flush of the rank while the op was open for
        longer than INFLIGHT_S (periodic flushes, and the close flush of a rank that closed while inside it)."""
        life = self.life
        cand = np.where(~np.isfinite(exit_t) | (exit_t - enter > INFLIGHT_S))[0]
        rc = r[cand]
        lo = enter[cand] + INFLIGHT_S
        hi = np.minimum.reduce([exit_t[cand], life.cut[rc], np.full(len(cand), kill), life.end[rc]])
        first = life.first[rc]
        k_lo = np.ceil((lo - first) / FLUSH_S)
        k_hi = np.floor((hi - first) / FLUSH_S)
        k_hi = np.where(np.isfinite(exit_t[cand]) & np.isclose(first + k_hi * FLUSH_S, exit_t[cand]), k_hi - 1, k_hi)
        count = np.clip(k_hi - k_lo + 1, 0, None).astype(np.int64)
        idx = np.repeat(np.arange(len(cand)), count)
        offs = np.arange(len(idx)) - np.repeat(np.cumsum(count) - count, count)
        times = first[idx] + (k_lo[idx] + offs) * FLUSH_S
        rows = cand[idx]
        fr = self.d.plan.freeze
        if fr is not None and self.sim.freeze_span is not None:
            a, b = self.sim.freeze_span
            keep = ~((r[rows] == fr[0]) & (times > a) & (times < b))
            rows, times = rows[keep], times[keep]
        closes = np.isinf(life.cut[rc]) & (life.end[rc] >= lo) & (exit_t[cand] > life.end[rc]) & (life.end[rc] <= kill)
        rows = np.concatenate([rows, cand[closes]])
        times = np.concatenate([times, life.end[rc][closes]])
        return rows.astype(np.int64), times

    def _error_text(self, rank: int) -> str:
        e, w = self.d.ending, self.w
        x = e.rank
        if e.cause == "vanished":
            return (f"RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                    f"{int(e.timeout_s * 1000)}ms for recv operation to complete")
        return (f"RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                f"[{w.host_of(x)}]:{29500 + x % 8} (rank {x})")

    def checkpoints(self) -> pa.Table:
        sim, n = self.sim, self.w.n
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("r", "s", "p", "a", "b", "bytes")}
        shard = int(self.d.plan.dp_bytes * 6)
        for s, phases in sim.ckpt.items():
            for pi, p in enumerate((*CKPT_PHASES, "publish")):
                a, b = phases[p]
                ranks = np.arange(n) if p != "publish" else np.array([0])
                cols["r"].append(ranks)
                cols["s"].append(np.full(len(ranks), s))
                cols["p"].append(np.full(len(ranks), pi))
                cols["a"].append(sim.origin[s] + a[ranks])
                cols["b"].append(sim.origin[s] + b[ranks])
                cols["bytes"].append(np.full(len(ranks), shard if p in ("serialize", "write") else 0))
        if not cols["r"]:
            return self._table(Table.CHECKPOINT_PHASES, {f.name: [] for f in storage_schema(Table.CHECKPOINT_PHASES)})
        c = {k: np.concatenate(v) for k, v in cols.items()}
        m = c["b"] <= self.life.cut[c["r"]]
        c = {k: v[m] for k, v in c.items()}
        r = c["r"]
        names = pa.array([*CKPT_PHASES, "publish"])
        wa, wb, ma, mb = self.wall(c["a"], r), self.wall(c["b"], r), self.mono(c["a"], r), self.mono(c["b"], r)
        return self._table(Table.CHECKPOINT_PHASES, {
            "rank": r, "step": c["s"], "checkpoint_id": [f"step-{s:07d}" for s in c["s"].tolist()],
            "phase": names.take(pa.array(c["p"])), "start_wall_ns": wa, "start_mono_ns": ma, "end_wall_ns": wb,
            "end_mono_ns": mb, "duration_ns": mb - ma, "bytes": (c["bytes"], c["bytes"] == 0),
            "ok": np.ones(len(r), bool), "error": [None] * len(r),
        })

    def fingerprints(self) -> pa.Table:
        d, sim, w, num = self.d, self.sim, self.w, self.d.num
        steps = np.arange(0, sim.steps, num.fp_every)
        ok = self.ok[steps]
        si, ri = np.nonzero(ok)
        s = steps[si]
        t = self.abs_s(s, sim.cpu_end[s, ri]) + self.rng.uniform(0.002, 0.02, size=len(s))
        fp_step = s.copy()
        if num.fp_step_offset is not None:
            off, s0 = num.fp_step_offset
            fp_step = fp_step + np.where(s >= s0, off[ri], 0)
        domain = w.dp_group[ri]
        fields = ("param_hash", "optim_hash", "rng_python_hash", "rng_numpy_hash", "rng_torch_hash", "rng_cuda_hash")
        cols: dict[str, npt.NDArray[np.object_]] = {}
        for fi, f in enumerate(fields):
            salt = np.zeros(len(s), dtype=np.int64)
            if f in num.salt:
                first = num.salt[f][ri]
                salt = np.where((first >= 0) & (s >= first), ri + 1, 0)
            state_step = fp_step if f != "rng_python_hash" else fp_step
            h = _mix(self.seed, fi + 1, domain if not f.startswith("rng_python") else 0, state_step, salt)
            cols[f] = _hex(h)
        dpos = (fp_step + 1).astype(np.int64) * num.global_batch
        if num.dpos_offset is not None:
            off, s0 = num.dpos_offset
            dpos = dpos + np.where(s >= s0, off[ri], 0)
        gnames = pa.array([g.name for g in w.groups])
        granks = pa.array([list(g.ranks) for g in w.groups], type=pa.list_(pa.int32()))
        count = (50_000_000 * (1 + (w.pp_of * w.tp + w.tp_of) % 3))[ri]
        return self._table(Table.FINGERPRINTS, {
            "rank": ri, "step": fp_step, "attempt": np.zeros(len(s)), "wall_ns": self.wall(t, ri),
            "domain": gnames.take(pa.array(domain)), "domain_ranks": granks.take(pa.array(domain)),
            **{f: list(cols[f]) for f in fields}, "data_position": (dpos, None), "param_count": count,
        })

    def _step_at(self, r: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step in progress or last completed (-1 before the first), phase index in progress or -1) per (r, t)."""
        sim, n = self.sim, self.w.n
        S = sim.steps
        big = 1e7
        st = (sim.origin[:, None] + sim.start).T  # (N, S)
        st = np.where(np.isfinite(st), st, big * 0.9)
        key = (np.arange(n)[:, None] * big + st).reshape(-1)
        q = r * big + t
        pos = np.searchsorted(key, q, side="right") - 1
        step = pos - r * S
        step = np.where(step < 0, -1, step)
        ph = np.full(len(r), -1)
        valid = step >= 0
        for pi, p in enumerate(PHASES):
            a, b = sim.phase_cpu[p]
            sa = sim.origin[step[valid]] + a[step[valid], r[valid]]
            sb = sim.origin[step[valid]] + b[step[valid], r[valid]]
            inside = (t[valid] >= sa) & ((t[valid] < sb) | ~np.isfinite(b[step[valid], r[valid]]))
            cur = ph[valid]
            cur[inside] = pi
            ph[valid] = cur
        return step, ph

    def events(self) -> pa.Table:
        d, w, rng, n = self.d, self.w, self.rng, self.w.n
        e, life = d.ending, self.life
        rows: list[dict[str, np.ndarray]] = []
        kinds = ["start", "heartbeat", "exception", "signal", "exit", "warning"]

        def add(r: np.ndarray, t: np.ndarray, kind: int, **extra: npt.ArrayLike) -> None:
            m = t <= np.minimum(life.cut[r], life.end[r] + 1e-6)
            rows.append({"r": r[m], "t": t[m], "k": np.full(int(m.sum()), kind),
                         **{k: (np.asarray(v)[m] if np.ndim(v) else np.full(int(m.sum()), v, dtype=object))
                            for k, v in extra.items()}})

        ranks = np.arange(n)
        add(ranks, life.start, 0, msg=np.array([f"pid={p}" for p in rng.integers(1000, 4_000_000, n)], dtype=object))
        # heartbeats: the rank's own phase and drift, a little lateness from the GIL
        hb_r, hb_t = [], []
        freeze = d.plan.freeze
        for hb_rank in range(n):
            k = int(max(0.0, (life.end[hb_rank] - life.start[hb_rank]) / HEARTBEAT_S)) + 1
            t = life.start[hb_rank] + HEARTBEAT_S * (np.arange(1, k + 1)) * (1 + rng.normal(0, 2e-4)) + rng.exponential(0.004, k)
            t = t[t < life.end[hb_rank]]
            if freeze is not None and hb_rank == freeze[0] and self.sim.freeze_span is not None:
                a, b = self.sim.freeze_span
                t = t[(t < a) | (t > b)]
            hb_r.append(np.full(len(t), hb_rank))
            hb_t.append(t)
        hr, ht = np.concatenate(hb_r), np.concatenate(hb_t)
        add(hr, ht, 1)
        if e.kind == "fail":
            x, td = e.rank, float(self.sim.death_time)  # type: ignore[arg-type]
            one = np.array([x])
            if e.cause == "exception":
                add(one, np.array([td]), 2, exc=e.exc_type, msg=e.message)
                add(one, np.array([td + 0.3]), 4, code=1)
            elif e.cause == "signal":
                add(one, np.array([td]), 3, sig=15, msg="SIGTERM")
                add(one, np.array([td + 0.05]), 4, code=-15)
            elif e.cause == "exit":
                add(one, np.array([td]), 4, code=int(rng.choice([1, 2, 3])))
            peers = np.array([r for r in range(n) if r != x])
            err = self.error_at[peers]
            msgs = np.array([self._peer_message(r) for r in peers.tolist()], dtype=object)
            exc = "DistBackendError" if self.gpu else "RuntimeError"
            add(peers, err + 1e-3, 2, exc=exc, msg=msgs)
            add(peers, life.end[peers], 4, code=1)
        elif e.kind == "kill" and e.cause == "sigterm":
            add(ranks, life.end, 3, sig=15, msg="SIGTERM")
            add(ranks, life.end + 0.01, 4, code=-15)
        elif e.kind == "ok":
            add(ranks, life.end, 4, code=0)
        if self.gpu and e.kind in ("hang", "fail"):
            td = float(self.sim.death_time)  # type: ignore[arg-type]
            t = td + DEVICE_RESOLVE_S + rng.uniform(0, FLUSH_S, n)
            add(ranks, t, 5, msg="device timing: gave up on device marks not completed after 30 s")
        c = {k: np.concatenate([p[k] if k in p else np.full(len(p["r"]), None, dtype=object) for p in rows])
             for k in ("r", "t", "k", "exc", "msg", "sig", "code")}
        order = np.lexsort((c["t"], c["r"]))
        c = {k: v[order] for k, v in c.items()}
        r, t = c["r"].astype(np.int64), c["t"].astype(float)
        step, ph = self._step_at(r, t)
        # the collective in progress (heartbeats and exceptions name it): the rank's open op at that moment
        op_name = np.full(len(r), None, dtype=object)
        grp = np.full(len(r), None, dtype=object)
        gseq = np.full(len(r), -1, dtype=np.int64)
        if hasattr(self, "open_ops"):
            orr, oen, oex, ooi, ogrp, ogs, ost = self.open_ops
            sel = ost != 2
            orr, oen, oex, ooi, ogrp, ogs = orr[sel], oen[sel], oex[sel], ooi[sel], ogrp[sel], ogs[sel]
            if e.kind in ("fail", "hang"):  # ops never left: open until the rank's end
                pass
            big = 1e7
            key = orr * big + oen
            o = np.argsort(key, kind="stable")
            key, orr, oen, oex, ooi, ogrp, ogs = key[o], orr[o], oen[o], oex[o], ooi[o], ogrp[o], ogs[o]
            pos = np.searchsorted(key, r * big + t, side="right") - 1
            hit = (pos >= 0)
            pos = np.clip(pos, 0, max(0, len(key) - 1))
            if len(key):
                hit &= (orr[pos] == r) & (oex[pos] > t) & (c["k"] != 0) & (c["k"] != 4)
                kinds_op = [op.op for op in self.sim.ops] + ["barrier"]
                names = [g.name for g in w.groups]
                for i in np.where(hit)[0].tolist():
                    op_name[i] = kinds_op[ooi[pos[i]]]
                    grp[i] = names[ogrp[pos[i]]]
                    gseq[i] = ogs[pos[i]]
        if e.kind == "fail" and self.gpu:  # the watchdog names the device collective that timed out
            for i in np.where(c["k"] == 2)[0].tolist():
                rk = int(r[i])
                if rk in self.blocked:
                    oi, s = self.blocked[rk]
                    op = self.sim.ops[oi]
                    op_name[i], grp[i] = op.op, w.groups[int(op.group[rk])].name
                    gseq[i] = s * op.per_step[rk] + op.order[rk]
        step_col = np.where(step >= 0, step, 0)
        return self._table(Table.EVENTS, {
            "rank": r, "attempt": np.zeros(len(r)), "wall_ns": self.wall(t, r), "mono_ns": self.mono(t, r),
            "kind": pa.array(kinds).take(pa.array(c["k"].astype(np.int64))),
            "step": (step_col, step < 0),
            "phase": [PHASES[p] if p >= 0 else None for p in ph.tolist()],
            "exc_type": list(c["exc"]), "message": list(c["msg"]),
            "collective_op": list(op_name), "collective_group": list(grp), "collective_seq": (gseq, gseq < 0),
            "signal": (np.array([v if v is not None else 0 for v in c["sig"]]), np.array([v is None for v in c["sig"]])),
            "exit_code": (np.array([v if v is not None else 0 for v in c["code"]]), np.array([v is None for v in c["code"]])),
            "dropped_rows": (np.zeros(len(r), dtype=np.int64), c["k"] != 4),
        })

    def _peer_message(self, rank: int) -> str:
        e = self.d.ending
        if self.gpu:
            return (f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE) ran for "
                    f"{int(e.timeout_s * 1000)} milliseconds before timing out.")
        return self._error_text(rank)

    def gpu_samples(self) -> pa.Table:
        d, w, rng, n, hw = self.d, self.w, self.rng, self.w.n, self.d.hw
        life, sim = self.life, self.sim
        rr, tt = [], []
        freeze = d.plan.freeze
        for g_rank in range(n):
            k = int(max(0.0, (life.end[g_rank] - life.start[g_rank]) / GPU_S)) + 1
            t = life.start[g_rank] + rng.uniform(0, GPU_S) + GPU_S * np.arange(k) + rng.normal(0, 0.003, k)
            t = t[(t < life.end[g_rank]) & (t <= life.cut[g_rank])]
            if freeze is not None and g_rank == freeze[0] and sim.freeze_span is not None:
                a, b = sim.freeze_span
                t = t[(t < a) | (t > b)]
            rr.append(np.full(len(t), g_rank))
            tt.append(t)
        r, t = np.concatenate(rr), np.concatenate(tt)
        step, _ = self._step_at(r, t)
        s = np.clip(step, 0, sim.steps - 1)
        active = step >= 0
        clock = np.where(active, hw.clock[s, r], 0.5)
        bits = np.where(active, hw.bits[s, r], 0x1)
        util = np.where(active, np.clip(rng.normal(97, 2, len(r)), 80, 100), rng.uniform(0, 3, len(r)))
        power = hw.power_limit_w * np.where(active, hw.power_frac[s, r], 0.12) * rng.normal(1, 0.01, len(r))
        temp = np.where(active, hw.temp[s, r], hw.temp[0, r] - 15) + rng.normal(0, 0.3, len(r))
        # counters: cumulative through the step in progress; XIDs on the step's first sample
        def cum(a: np.ndarray) -> np.ndarray:
            c = np.cumsum(a, axis=0)
            return np.where(active, c[s, r], 0)
        sbe, dbe, remap = cum(hw.sbe_new), cum(hw.dbe_new), cum(hw.remap_new)
        xid: list[list[int]] = [[] for _ in range(len(r))]
        if hw.xid:
            for (xs, xr), codes in hw.xid.items():
                idx = np.where((r == xr) & (step >= xs))[0]
                if len(idx):
                    xid[int(idx[0])] = list(codes)
        local = r % 8
        mem_used = ((60 + (r * 7919) % 13) * (1 << 30)).astype(np.int64)
        return self._table(Table.GPU, {
            "rank": r, "device_index": local, "device_uuid": pa.array(list(w.uuids)).take(pa.array(r)),
            "pci_bus_id": pa.array(list(w.pci_ids)).take(pa.array(r)), "source": ["nvml"] * len(r),
            "wall_ns": self.wall(t, r), "mono_ns": self.mono(t, r), "step": step,
            "sm_clock_mhz": (np.round(hw.max_mhz * clock / 15) * 15).astype(np.int64),
            "mem_clock_mhz": np.full(len(r), hw.mem_mhz), "sm_clock_max_mhz": np.full(len(r), hw.max_mhz),
            "power_w": np.round(power, 2), "power_limit_w": np.full(len(r), hw.power_limit_w),
            "temperature_c": np.round(temp), "gpu_util_pct": np.round(util), "mem_util_pct": np.round(util * 0.55),
            "mem_used_bytes": mem_used, "throttle_reasons": bits,
            "ecc_sbe_volatile": sbe, "ecc_dbe_volatile": dbe, "ecc_sbe_aggregate": hw.sbe_agg0[r] + sbe,
            "ecc_dbe_aggregate": dbe, "pcie_replay": np.zeros(len(r), dtype=np.int64),
            "nvlink_crc_errors": np.zeros(len(r), dtype=np.int64), "nvlink_replay_errors": np.zeros(len(r), dtype=np.int64),
            "nvlink_recovery_errors": np.zeros(len(r), dtype=np.int64),
            "xid_events": pa.array(xid, type=pa.list_(pa.int32())),
            "retired_pages_sbe": np.zeros(len(r), dtype=np.int64), "retired_pages_dbe": np.zeros(len(r), dtype=np.int64),
            "remapped_rows_correctable": remap, "remapped_rows_uncorrectable": dbe,
            "remapped_rows_pending": dbe > 0,
        })


def write_tables(run_dir: str, tables: dict[Table, pa.Table], *, threads: int = 4) -> None:
    """One part file per table and rank (ranks without rows in a table get none, as with a real collector)."""
    jobs: list[tuple[str, pa.Table]] = []
    for table, t in tables.items():
        if t.num_rows == 0:
            continue
        ranks = t.column("rank").to_numpy()
        order = np.argsort(ranks, kind="stable")
        if (np.diff(order) != 1).any():
            t = t.take(pa.array(order))
            ranks = ranks[order]
        bounds = np.flatnonzero(np.diff(ranks)) + 1
        starts = np.concatenate([[0], bounds])
        ends = np.concatenate([bounds, [len(ranks)]])
        for a, b in zip(starts.tolist(), ends.tolist()):
            part = partition_dir(Path(run_dir), table, int(ranks[a]))
            part.mkdir(parents=True, exist_ok=True)
            jobs.append((str(part / "part-000000.parquet"), t.slice(a, b - a)))

    def write(job: tuple[str, pa.Table]) -> None:
        with pa.OSFile(job[0], "wb") as f:
            pq.write_table(job[1], f, compression="lz4", write_statistics=False,
                           use_dictionary=dictionary_columns(Table(Path(job[0]).parent.parent.name)))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, jobs))
