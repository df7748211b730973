"""Collector cost where it means something: the training thread's cost per step and per collective, the background
threads' CPU, and ON vs OFF step time with a core per rank; projected to real step times.

    .venv/bin/python benchmarks/collector_cost.py            # full run, ~6–7 minutes on 2 cores
    .venv/bin/python benchmarks/collector_cost.py --quick    # a short run of every part (the unit test's), ~1 minute
    .venv/bin/python benchmarks/collector_cost.py --ab-blocks 2 --cp-quads 400   # fewer ON-vs-OFF blocks (a loaded machine)

benchmarks/collector_overhead.py runs 8 rank processes on 2 cores, so every bit of background CPU the collector uses
lands on the step time. On a GPU host each rank has cores of its own; this benchmark measures the pieces that
decide the overhead there, and prints them as one table.

Critical path (in process, world size 1, gloo)
    One training-like loop — a DDP-wrapped MLP with the collector's comm hook, phases data / forward / backward /
    optimizer, a loader wrapped by the collector, the loss handed to the step record, a fingerprint every 50 steps
    — plus N explicit ``all_reduce`` calls on the gloo group, each inside ``collector.collective``. Run on the real
    Collector (ParquetSink in a temp dir, replay GPU sampler, default `CollectorConfig`: writer, heartbeat and
    sampler threads live) and on the NullCollector, two DDP copies of the same model, alternating in ABBA order
    within each block, for N = 0, 10 and 100. Each step's cost is the training thread's CPU clock
    (`time.thread_time_ns`) across the step, fingerprint included; so preemption on the shared machine does not
    count, and the collector's share of garbage collection does. ON − OFF per block and N, fitted as
    cost = a + b·N; the intervals are a bootstrap over blocks (95 %, percentile).

Background CPU
    The same loop on the real Collector, paced to a step period (the step sleeps out its remainder), at 0.1 and 0.5 s
    with 100 and 1,000 collectives a step: the CPU of the collector's own threads (part-file writer, heartbeat, GPU
    sampler) from /proc/self/task/<tid>/schedstat over the run, as a share of one core; and a fit
    share = c0 + c_step·steps/s + c_coll·collectives/s over those points, used by the projection.

ON vs OFF, a core per rank
    2 ranks on this machine's 2 cores (gloo), torch threads = 1, each step ~100 ms of real CPU work (512×512
    matmuls, the count calibrated here before the launches) plus the loop above with 100 collectives. ON and OFF
    jobs are launched one at a time, in ABBA order within a block and BAAB in the next. Step time = mean interval
    between the slowest rank's step ends after the warm-up (a throughput figure: flushes and fingerprints count).
    Overhead per block = (ON₁ + ON₂) / (OFF₁ + OFF₂) − 1; the verdict is on the mean over blocks with its 95 % t
    interval. The training thread's CPU per step, ON − OFF, is shown beside it.

Projection
    overhead = (a + b·N) / step time: the critical path alone. It assumes the collector's background threads run
    off the critical path, on a core the rank's training thread is not using (a GPU host gives each rank several);
    their CPU is shown as a share of one core beside it. The per-collective cost is the CPU path's: with CUDA
    tensors and device timing on, each collective also records CUDA events.

Targets: ON vs OFF ≤ 0.5 % (PASS when the interval's upper end is within it, FAIL when its lower end is over it,
INCONCLUSIVE otherwise); projected 0.5 s step with 1,000 collectives ≤ 0.3 % (the same rule on the bootstrap
interval of a + 1000·b).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Nothing heavy at module level: the ON-vs-OFF ranks are spawned, and spawn re-imports this script in each.

TARGET_AB_PCT = 0.5
"""Target: ON vs OFF step-time overhead with a core per rank, at most this many percent."""
TARGET_PROJECTED_PCT = 0.3
"""Target: projected overhead of a 0.5 s step with 1,000 collectives, at most this many percent."""
TARGET_PROJECTED_AT = (0.5, 1000)
PROJECTED_STEP_S = (0.1, 0.5, 2.0)
PROJECTED_COLLECTIVES = (100, 1000)
ON, OFF = "ON", "OFF"
_BG_THREADS = {"writer": "rankwatch-sink-", "heartbeat": "rankwatch-hb-", "GPU sampler": "rankwatch-gpu"}
"""Collector threads by name prefix (collector/sink.py, collector/collector.py, collector/gpu.py)."""
_WIDTH = 256
"""The MLP's width: two 256×256 layers, 0.5 MB of gradients, one DDP bucket."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    cp_collectives: tuple[int, ...]
    """Explicit collectives a step in the critical-path runs."""
    breakdown_rounds: int
    """Rounds of the per-collective breakdown (one step of each variant a round)."""
    cp_quads: int
    """Step quads per N (ON, OFF, OFF, ON steps, or OFF, ON, ON, OFF)."""
    bootstrap: int
    """Bootstrap resamples of the quads."""
    bg_points: tuple[tuple[float, int], ...]
    """(step period s, collectives a step) of the background runs."""
    bg_seconds: float
    ab_blocks: int
    ab_steps: int
    ab_warmup: int
    ab_step_s: float
    """CPU work a step in the ON-vs-OFF launches, seconds (matmuls)."""
    ab_collectives: int


_STEP_END = "LivenessWriter.stepped"

FULL = Plan(breakdown_rounds=200, cp_collectives=(0, 10, 100), cp_quads=400, bootstrap=1000,
            bg_points=((0.1, 100), (0.1, 1000), (0.5, 100), (0.5, 1000)), bg_seconds=20.0,
            ab_blocks=4, ab_steps=60, ab_warmup=8, ab_step_s=0.1, ab_collectives=10)
QUICK = Plan(breakdown_rounds=10, cp_collectives=(0, 10, 100), cp_quads=20, bootstrap=200,
             bg_points=((0.1, 100),), bg_seconds=3.0,
             ab_blocks=1, ab_steps=12, ab_warmup=4, ab_step_s=0.1, ab_collectives=10)


# ------------------------------------------------------------------------------------------ statistics


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def fmt(self, digits: int = 2, sign: bool = True) -> str:
        s = "+" if sign else ""
        if not math.isfinite(self.low):
            return f"{self.mean:{s}.{digits}f} (n {self.n}: no interval)"
        return f"{self.mean:{s}.{digits}f} [{self.low:{s}.{digits}f}, {self.high:{s}.{digits}f}]"


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086)
"""97.5 % quantile of Student's t for 1..20 degrees of freedom (beyond: 1.96 + 2.4/df, within 0.2 %)."""


def t_interval(values: Sequence[float]) -> Interval:
    n = len(values)
    mean = statistics.mean(values)
    if n < 2:
        return Interval(mean=mean, low=-math.inf, high=math.inf, n=n)
    q = _T975[n - 2] if n - 1 <= len(_T975) else 1.96 + 2.4 / (n - 1)
    half = q * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean=mean, low=mean - half, high=mean + half, n=n)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b·x."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def _verdict(i: Interval, target: float) -> str:
    if not math.isfinite(i.low):
        return "INCONCLUSIVE (no interval)"
    if i.high <= target:
        return "PASS"
    if i.low > target:
        return "FAIL"
    return "INCONCLUSIVE"


# ---------------------------------------------------------------------------------------- the loop


def _thread_cpu_ns(tid: int) -> int:
    """CPU time of thread `tid` of this process, ns (schedstat: ns resolution; stat: clock ticks)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _background_threads() -> dict[str, list[int]]:
    """Native ids of the collector's threads alive now, by role."""
    out: dict[str, list[int]] = {role: [] for role in _BG_THREADS}
    for t in threading.enumerate():
        for role, prefix in _BG_THREADS.items():
            if t.name.startswith(prefix) and t.native_id is not None:
                out[role].append(t.native_id)
    return out


def _background_cpu_ns(threads: dict[str, list[int]]) -> dict[str, int]:
    return {role: sum(_thread_cpu_ns(tid) for tid in tids) for role, tids in threads.items()}


class _Job:
    """One collector's side of the training-like loop: a DDP copy of the model with its comm hook, an optimizer, a
    loader wrapped by the collector. Two jobs (ON and OFF) share the process group and the explicit tensor."""

    def __init__(self, c: Any, group: Any, *, seed: int, compute: Callable[[], None] | None = None) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.ReLU(), torch.nn.Linear(_WIDTH, _WIDTH))
        self.ddp = DistributedDataParallel(model, process_group=group)
        self.ddp.register_comm_hook(None, c.ddp_comm_hook(group))
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.c = c
        self.group = group
        self.loader = c.wrap_loader(itertools.repeat(torch.randn(32, _WIDTH)), position=lambda: 0)
        self.tensor = torch.zeros(1024)
        self.step_index = 0
        self.compute = compute
        self.ranks = list(range(group.size()))

    def step(self, collectives: int, *, until_ns: int | None = None, fingerprint: bool = True) -> None:
        """One step, then `fingerprint` (unless told not to); with `until_ns`, the step sleeps out the rest of its
        period (perf_counter ns) in the forward phase."""
        import torch.distributed as dist

        c, i = self.c, self.step_index
        self.step_index = i + 1
        with c.step(i) as rec:
            with c.phase("data"):
                x = next(self.loader)
            with c.phase("forward"):
                if self.compute is not None:
                    self.compute()
                loss = self.ddp(x).square().mean()
                collective, tensor, group = c.collective, self.tensor, self.group
                for _ in range(collectives):
                    with collective("all_reduce", group, tensor):
                        dist.all_reduce(tensor, group=group)
                if until_ns is not None:
                    left = until_ns - time.perf_counter_ns()
                    if left > 0:
                        time.sleep(left / 1e9)
            with c.phase("backward"):
                loss.backward()
            with c.phase("optimizer"):
                self.opt.step()
                self.opt.zero_grad(set_to_none=False)
            rec.loss = loss.detach()
        if fingerprint:
            self.fingerprint()

    def fingerprint(self) -> None:
        """The collector's fingerprint call after the step (due every `fingerprint_every` steps)."""
        self.c.maybe_fingerprint(self.step_index - 1, self.model, self.opt, domain="dp", domain_ranks=self.ranks)


def _on_collector(run_dir: Path, rank: int, world_size: int) -> Any:
    from rankwatch.collector.collector import Collector, CollectorConfig
    from rankwatch.collector.gpu import ReplaySampler

    return Collector(CollectorConfig(run_dir=run_dir, handle_sigterm=False), rank=rank, world_size=world_size,
                     host="host0", gpu_sampler=ReplaySampler(host="host0", indices=[rank])).start()


def _register(c: Any, group: Any, world_size: int) -> None:
    from rankwatch.base.schema import GroupKind
    from rankwatch.base.topology import GroupInfo

    c.register_group(group, GroupInfo(name="dp0", kind=GroupKind.DP, ranks=tuple(range(world_size)),
                                      hosts=("host0",) * world_size))


# ---------------------------------------------------------------------------------- critical path


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticalPath:
    collectives: tuple[int, ...]
    quads: int
    """ON, OFF, OFF, ON step quads per N (or OFF, ON, ON, OFF: the order alternates)."""
    body_us: dict[int, Interval]
    """Per N: ON − OFF step body (step context to its end, garbage collection left out), µs: median of quads."""
    fingerprint_us: dict[int, float]
    """Per N: ON − OFF `maybe_fingerprint` per step (due every 50 steps), µs: mean."""
    gc_us: dict[int, float]
    """Per N: ON − OFF garbage collection on the training thread per step, µs: mean."""
    total_us: dict[int, Interval]
    """Per N: body + fingerprint + gc, µs, 95 % bootstrap over quads."""
    off_us: dict[int, float]
    """Per N: the OFF step's training-thread CPU, µs (median)."""
    a: Interval
    """µs per step."""
    b: Interval
    """µs per collective."""
    projected: dict[tuple[float, int], Interval]
    """(step s, collectives) -> projected overhead, percent."""


def _blocks_order(k: int) -> tuple[str, ...]:
    return (ON, OFF, OFF, ON) if k % 2 == 0 else (OFF, ON, ON, OFF)


class _GcClock:
    """Thread CPU the training thread spends in garbage collection (gc.callbacks run in the collecting thread)."""

    def __init__(self) -> None:
        self.ns = 0
        self._start = 0
        self._thread = threading.get_ident()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._start = time.thread_time_ns()
        else:
            self.ns += time.thread_time_ns() - self._start


def _percentile_interval(mean: float, values: list[float], n: int) -> Interval:
    if n < 2:
        return Interval(mean=mean, low=-math.inf, high=math.inf, n=n)
    values = sorted(values)
    return Interval(mean=mean, low=values[int(0.025 * len(values))], high=values[int(0.975 * len(values)) - 1], n=n)


def _critical_path(plan: Plan, jobs: dict[str, _Job]) -> CriticalPath:
    """ON and OFF steps interleaved one by one in ABBA quads, so that load on the shared machine lands on both alike.
    Each step's training-thread CPU is split into its body, its fingerprint call and garbage collection: the body
    (deterministic work, heavy-tailed noise) is taken as the median over quads, the rare costs as means."""
    import gc

    ns = plan.cp_collectives
    for n in ns:  # warm-up: caches, allocator, first-use paths of both arms
        for job in jobs.values():
            for _ in range(max(5, plan.cp_quads // 4)):
                job.step(n)
    clock = time.thread_time_ns
    gcc = _GcClock()
    gc.callbacks.append(gcc)
    # per N and quad: (ON − OFF body, ON − OFF fingerprint, ON − OFF gc), ns per step
    quads: dict[int, list[tuple[float, float, float]]] = {n: [] for n in ns}
    off_steps: dict[int, list[int]] = {n: [] for n in ns}
    try:
        for k in range(plan.cp_quads):
            for n in ns:
                sums = {ON: [0, 0, 0], OFF: [0, 0, 0]}
                for arm in _blocks_order(k):
                    job = jobs[arm]
                    g0, t0 = gcc.ns, clock()
                    job.step(n, fingerprint=False)
                    t1, g1 = clock(), gcc.ns
                    job.fingerprint()
                    t2, g2 = clock(), gcc.ns
                    acc = sums[arm]
                    acc[0] += (t1 - t0) - (g1 - g0)
                    acc[1] += (t2 - t1) - (g2 - g1)
                    acc[2] += g2 - g0
                    if arm == OFF:
                        off_steps[n].append(t2 - t0)
                on, off = sums[ON], sums[OFF]
                quads[n].append(((on[0] - off[0]) / 2, (on[1] - off[1]) / 2, (on[2] - off[2]) / 2))
    finally:
        gc.callbacks.remove(gcc)

    def total(qs: list[tuple[float, float, float]]) -> float:
        return (statistics.median(q[0] for q in qs) + statistics.mean(q[1] for q in qs)
                + statistics.mean(q[2] for q in qs)) / 1e3

    totals = {n: total(quads[n]) for n in ns}
    a, b = fit_line(ns, [totals[n] for n in ns])
    rng = random.Random(0)
    boot_totals: dict[int, list[float]] = {n: [] for n in ns}
    boot: list[tuple[float, float]] = []
    for _ in range(plan.bootstrap):
        draw = {n: total(rng.choices(quads[n], k=len(quads[n]))) for n in ns}
        for n in ns:
            boot_totals[n].append(draw[n])
        boot.append(fit_line(ns, [draw[n] for n in ns]))
    q = plan.cp_quads
    projected = {
        (s, n): _percentile_interval((a + b * n) / (s * 1e6) * 100, [(x + y * n) / (s * 1e6) * 100 for x, y in boot], q)
        for s in PROJECTED_STEP_S for n in PROJECTED_COLLECTIVES
    }
    return CriticalPath(
        collectives=ns, quads=q,
        body_us={n: _percentile_interval(statistics.median(x[0] for x in quads[n]) / 1e3, [], 1) for n in ns},
        fingerprint_us={n: statistics.mean(x[1] for x in quads[n]) / 1e3 for n in ns},
        gc_us={n: statistics.mean(x[2] for x in quads[n]) / 1e3 for n in ns},
        total_us={n: _percentile_interval(totals[n], boot_totals[n], q) for n in ns},
        off_us={n: statistics.median(off_steps[n]) / 1e3 for n in ns},
        a=_percentile_interval(a, [x for x, _ in boot], q), b=_percentile_interval(b, [y for _, y in boot], q),
        projected=projected,
    )


def _breakdown(plan: Plan, job: _Job, *, collectives: int = 100) -> dict[str, float]:
    """Where the per-collective cost goes, in situ: steps of `collectives` gloo all_reduce calls inside the started
    Collector's step, each wrapped in one of the variants below, the variants' steps interleaved with a rotating
    order; per variant, the median step's training-thread CPU minus the bare calls', per collective, µs."""
    import gc
    from contextlib import nullcontext

    import torch.distributed as dist

    c, tensor, group = job.c, job.tensor, job.group
    collective = c.collective

    def bare() -> None:
        for _ in range(collectives):
            dist.all_reduce(tensor, group=group)

    def null() -> None:
        for _ in range(collectives):
            with nullcontext():
                dist.all_reduce(tensor, group=group)

    def built() -> None:
        for _ in range(collectives):
            collective("all_reduce", group, tensor)
            dist.all_reduce(tensor, group=group)

    def full() -> None:
        for _ in range(collectives):
            with collective("all_reduce", group, tensor):
                dist.all_reduce(tensor, group=group)

    variants: dict[str, Callable[[], None]] = {
        "bare": bare, "NullCollector (nullcontext)": null, "Collector.collective built, not entered": built,
        "built + entered + exited (the ON arm)": full,
    }
    names = list(variants)
    times: dict[str, list[int]] = {name: [] for name in names}
    clock = time.thread_time_ns
    gc.collect()
    for r in range(plan.breakdown_rounds + 2):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            with c.step(job.step_index):
                job.step_index += 1
                t0 = clock()
                variants[name]()
                spent = clock() - t0
            if r >= 2:
                times[name].append(spent)
    base = statistics.median(times["bare"])
    return {name: (statistics.median(times[name]) - base) / collectives / 1e3 for name in names if name != "bare"}


def _step_end_record(plan: Plan, job: _Job) -> float:
    """The liveness record the training thread writes at each step's end (`LivenessWriter.stepped`: a snapshot, its
    JSON and one `pwrite`), in situ on the started Collector: the median training-thread CPU of one call, µs. It is
    part of a (the ON steps write it); shown apart because it is the one piece of a that does I/O."""
    live = job.c._live
    if live is None:
        return float("nan")
    clock = time.thread_time_ns
    times = []
    for _ in range(plan.breakdown_rounds * 5):
        t0 = clock()
        live.stepped()
        times.append(clock() - t0)
    return statistics.median(times) / 1e3


# --------------------------------------------------------------------------------------- background


@dataclass(frozen=True, kw_only=True, slots=True)
class BackgroundPoint:
    step_s: float
    collectives: int
    steps: int
    seconds: float
    share_pct: dict[str, float]
    """Per collector thread role: CPU as a percentage of one core over the run."""
    writer_counter_pct: float
    """The sink's own count of its writer CPU (`writer_cpu_ns`), same unit: a cross-check of /proc."""

    @property
    def total_pct(self) -> float:
        return sum(self.share_pct.values())


def _background(plan: Plan, job: _Job) -> list[BackgroundPoint]:
    c = job.c
    threads = _background_threads()
    points: list[BackgroundPoint] = []
    for step_s, n in plan.bg_points:
        c.flush(timeout_s=30.0)  # earlier rows are not this point's
        before, counter0 = _background_cpu_ns(threads), c.sink.writer_cpu_ns
        start = time.perf_counter_ns()
        period = int(step_s * 1e9)
        steps = 0
        while time.perf_counter_ns() - start < plan.bg_seconds * 1e9:
            job.step(n, until_ns=start + (steps + 1) * period)
            steps += 1
        elapsed = time.perf_counter_ns() - start
        after = _background_cpu_ns(threads)
        points.append(BackgroundPoint(
            step_s=step_s, collectives=n, steps=steps, seconds=elapsed / 1e9,
            share_pct={role: (after[role] - before[role]) / elapsed * 100 for role in threads},
            writer_counter_pct=(c.sink.writer_cpu_ns - counter0) / elapsed * 100,
        ))
        print(f"  background at {step_s:g} s steps × {n} collectives: {points[-1].total_pct:.2f} % of a core",
              flush=True)
    return points


def _fit_background(points: list[BackgroundPoint]) -> tuple[float, float, float] | None:
    """(c0 %, c_step % per step/s, c_coll % per collective/s) of share = c0 + c_step·steps/s + c_coll·coll/s, by least
    squares; None with fewer than 3 points."""
    if len(points) < 3:
        return None
    import numpy as np

    x = np.array([[1.0, p.steps / p.seconds, p.steps * p.collectives / p.seconds] for p in points])
    y = np.array([p.total_pct for p in points])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return float(coef[0]), float(coef[1]), float(coef[2])


# ----------------------------------------------------------------------------------------- in process


def _in_process(plan: Plan) -> tuple[CriticalPath, dict[str, float], list[BackgroundPoint], int]:
    import torch
    import torch.distributed as dist

    from rankwatch.collector.null import NullCollector

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rankwatch-cost-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        on = _on_collector(Path(tmp) / "run", 0, 1)
        try:
            group = dist.group.WORLD
            _register(on, group, 1)
            jobs = {ON: _Job(on, group, seed=0), OFF: _Job(NullCollector(rank=0, world_size=1), group, seed=0)}
            print("  critical path: ON and OFF in ABBA blocks, collectives a step "
                  f"{', '.join(map(str, plan.cp_collectives))} ...", flush=True)
            cp = _critical_path(plan, jobs)
            print("  per-collective breakdown ...", flush=True)
            breakdown = _breakdown(plan, jobs[ON])
            breakdown[_STEP_END] = _step_end_record(plan, jobs[ON])
            print("  background threads ...", flush=True)
            bg = _background(plan, jobs[ON])
        finally:
            on.close(exit_code=0)
            dist.destroy_process_group()
        errors = on.errors + sum(on.dropped.values())
    return cp, breakdown, bg, errors


# ----------------------------------------------------------------------------------------- ON vs OFF


def _matmul_reps(step_s: float) -> tuple[int, float]:
    """512×512 matmuls (torch threads = 1) that take `step_s` here: (count, seconds each)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    times = []
    for _ in range(25):
        t0 = time.thread_time_ns()
        a @ b
        times.append(time.thread_time_ns() - t0)
    each = statistics.median(times[5:]) / 1e9
    return max(1, math.ceil(step_s / each)), each


def _ab_rank(rank: int, world: int, store: str, arm: str, run_dir: str, steps: int, collectives: int, reps: int,
             out: str) -> None:
    """One rank of an ON-vs-OFF launch: the loop with `reps` matmuls a step; writes its clocks to `out`."""
    import torch
    import torch.distributed as dist

    from rankwatch.collector.null import NullCollector

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    group = dist.group.WORLD
    c = _on_collector(Path(run_dir), rank, world) if arm == ON else NullCollector(rank=rank, world_size=world)
    _register(c, group, world)
    a, b = torch.randn(512, 512), torch.randn(512, 512)

    def compute() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    job = _Job(c, group, seed=0, compute=compute)
    ends, cpu = [], []
    for _ in range(steps):
        job.step(collectives)
        ends.append(time.perf_counter_ns())
        cpu.append(time.thread_time_ns())
    c.close(exit_code=0)
    dist.barrier()
    # The figures are written (whole, by rename) before the teardown: gloo's C++ teardown now and then aborts a rank
    # after the work is done ("terminate called without an active exception", SIGABRT), which says nothing about
    # the measurement; os._exit skips the interpreter's teardown of torch on top of it.
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps({"step_end_ns": ends, "thread_cpu_ns": cpu, "errors": c.errors}))
    tmp.replace(out)
    dist.destroy_process_group()
    os._exit(0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    block: int
    arm: str
    step_ms: float
    """Mean interval between the slowest rank's step ends after the warm-up."""
    median_ms: float
    thread_cpu_ms: float
    """Training-thread CPU per step after the warm-up, mean over ranks."""
    note: str = ""
    """What went wrong after the figures were written (a rank's teardown), or empty."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OnOff:
    reps: int
    matmul_ms: float
    launches: list[Launch]
    overhead: Interval
    """Per block (ON₁ + ON₂) / (OFF₁ + OFF₂) − 1, percent."""
    thread_cpu_us: Interval
    """Per block, ON − OFF training-thread CPU per step, µs."""


def _launch(root: Path, plan: Plan, block: int, index: int, arm: str, reps: int) -> Launch:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    world = 2
    base = root / f"b{block}-{index}-{arm.lower()}"
    base.mkdir(parents=True)
    outs = [str(base / f"rank{r}.json") for r in range(world)]
    procs = [ctx.Process(target=_ab_rank, args=(r, world, str(base / "store"), arm, str(base / "run"), plan.ab_steps,
                                                plan.ab_collectives, reps, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120 + plan.ab_steps * plan.ab_step_s * 4
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
    codes = ", ".join(str(p.exitcode) for p in procs)
    if any(not Path(o).exists() for o in outs):
        raise SystemExit(f"collector_cost: {arm} launch in {base} failed (exit codes {codes}; "
                         f"no figures from rank(s) {', '.join(str(r) for r, o in enumerate(outs) if not Path(o).exists())})")
    # A rank that wrote its figures (whole: by rename, after the final barrier) and then died in torch's teardown
    # measured its steps; the launch counts, and the line says so.
    note = "" if all(p.exitcode == 0 for p in procs) else \
        f"exit codes {codes} after every rank's figures were written: torch teardown"
    docs = [json.loads(Path(o).read_text()) for o in outs]
    w = plan.ab_warmup
    ends = [max(d["step_end_ns"][i] for d in docs) for i in range(plan.ab_steps)]
    intervals = [(ends[i] - ends[i - 1]) / 1e6 for i in range(w, plan.ab_steps)]
    span = plan.ab_steps - w
    cpu = statistics.mean((d["thread_cpu_ns"][-1] - d["thread_cpu_ns"][w - 1]) / span / 1e6 for d in docs)
    return Launch(block=block, arm=arm, step_ms=(ends[-1] - ends[w - 1]) / span / 1e6,
                  median_ms=statistics.median(intervals), thread_cpu_ms=cpu, note=note)


def _on_off(plan: Plan) -> OnOff:
    reps, each = _matmul_reps(plan.ab_step_s)
    print(f"  ON vs OFF: 2 ranks, {plan.ab_blocks} ABBA block(s) of 4 launches × {plan.ab_steps} steps "
          f"({reps} × 512² matmul = {reps * each * 1e3:.0f} ms of CPU a step, {plan.ab_collectives} collectives) ...",
          flush=True)
    launches: list[Launch] = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-cost-ab-") as tmp:
        for k in range(plan.ab_blocks):
            for i, arm in enumerate(_blocks_order(k)):
                launch = _launch(Path(tmp), plan, k, i, arm, reps)
                launches.append(launch)
                print(f"    block {k} {arm:<3} {launch.step_ms:8.2f} ms/step (median {launch.median_ms:.2f}), "
                      f"training thread {launch.thread_cpu_ms:.2f} ms  (load {os.getloadavg()[0]:.1f})"
                      + (f"  [{launch.note}]" if launch.note else ""), flush=True)
    overhead, cpu = [], []
    for k in range(plan.ab_blocks):
        mine = [x for x in launches if x.block == k]
        on = [x for x in mine if x.arm == ON]
        off = [x for x in mine if x.arm == OFF]
        overhead.append((sum(x.step_ms for x in on) / sum(x.step_ms for x in off) - 1) * 100)
        cpu.append((statistics.mean(x.thread_cpu_ms for x in on) - statistics.mean(x.thread_cpu_ms for x in off)) * 1e3)
    return OnOff(reps=reps, matmul_ms=each * 1e3, launches=launches, overhead=t_interval(overhead),
                 thread_cpu_us=t_interval(cpu))


# ----------------------------------------------------------------------------------------- report


def _table(plan: Plan, cp: CriticalPath, breakdown: dict[str, float], bg: list[BackgroundPoint], ab: OnOff,
           errors: int) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    ns = cp.collectives
    rows.append((f"critical path per step, a: ON − OFF training-thread CPU, µs (95 % bootstrap over {cp.quads} "
                 "step quads)", cp.a.fmt(1)))
    rows.append(("critical path per collective, b: µs", cp.b.fmt(2)))
    for n in ns:
        rows.append((f"critical path at {n} collectives a step, µs: step body (median) + fingerprint + GC (means); "
                     f"OFF step {cp.off_us[n]:.0f} µs of CPU",
                     f"{cp.total_us[n].fmt(1)} = {cp.body_us[n].mean:+.1f} {cp.fingerprint_us[n]:+.1f} "
                     f"{cp.gc_us[n]:+.1f}"))
    rows.append((f"  of a, the liveness record written at each step's end ({_STEP_END}), µs a step: median of "
                 f"{plan.breakdown_rounds * 5} calls in situ", f"{breakdown[_STEP_END]:+.1f}"))
    for name, us in ((n, v) for n, v in breakdown.items() if n != _STEP_END):
        rows.append((f"per-collective breakdown, 100 gloo calls a step in a Collector step: {name}, µs over bare calls",
                     f"{us:+.2f}"))
    for p in bg:
        parts = ", ".join(f"{role} {v:.2f}" for role, v in p.share_pct.items())
        rows.append((f"background CPU at {p.step_s:g} s steps × {p.collectives} collectives, % of one core "
                     f"({p.steps} steps, {p.seconds:.0f} s)",
                     f"{p.total_pct:.2f} ({parts}; writer by its own counter {p.writer_counter_pct:.2f})"))
    fit = _fit_background(bg)
    if fit is not None:
        rows.append(("background CPU model, % of one core = c0 + c_step·steps/s + c_coll·collectives/s",
                     f"c0 {fit[0]:.3f}, c_step {fit[1]:.4f}, c_coll {fit[2] * 1e3:.4f} per 1,000/s"))
    rows.append((f"ON vs OFF step time, 2 ranks on 2 cores, {ab.overhead.n} ABBA block(s), "
                 f"{statistics.mean(x.step_ms for x in ab.launches if x.arm == OFF):.1f} ms OFF steps, "
                 f"{plan.ab_collectives} collectives a step: overhead %, 95 % t interval", ab.overhead.fmt(2)))
    rows.append(("ON vs OFF training-thread CPU per step, ON − OFF, µs", ab.thread_cpu_us.fmt(1)))
    rows.append(("  the critical-path fit's prediction for that step, µs",
                 f"{cp.a.mean + cp.b.mean * plan.ab_collectives:.1f}"))
    for s in PROJECTED_STEP_S:
        for n in PROJECTED_COLLECTIVES:
            bg_s = ""
            if fit is not None:
                share = max(0.0, fit[0] + fit[1] / s + fit[2] * n / s)  # the fit's intercept can dip below 0
                bg_s = f"; background {share:.2f} % of a core (model), off the critical path"
            rows.append((f"projected overhead, {s:g} s step × {n:,} collectives, %",
                         f"{cp.projected[(s, n)].fmt(3)}{bg_s}"))
    rows.append(("collector internal errors + dropped rows (in process)", str(errors)))
    rows.append((f"target: ON vs OFF ≤ {TARGET_AB_PCT} %", _verdict(ab.overhead, TARGET_AB_PCT)))
    s, n = TARGET_PROJECTED_AT
    rows.append((f"target: projected {s:g} s step × {n:,} collectives ≤ {TARGET_PROJECTED_PCT} %",
                 _verdict(cp.projected[(s, n)], TARGET_PROJECTED_PCT)))
    return rows


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a short run of every part (for the unit test)")
    p.add_argument("--ab-blocks", type=int, default=None, help=f"ABBA blocks of ON-vs-OFF launches ({FULL.ab_blocks})")
    p.add_argument("--cp-quads", type=int, default=None, help=f"critical-path step quads per N ({FULL.cp_quads})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    plan = QUICK if args.quick else FULL
    if args.ab_blocks is not None or args.cp_quads is not None:
        import dataclasses

        plan = dataclasses.replace(plan, ab_blocks=args.ab_blocks or plan.ab_blocks,
                                   cp_quads=args.cp_quads or plan.cp_quads)
    started = time.monotonic()
    load = os.getloadavg()
    print(f"collector_cost{' --quick' if args.quick else ''}: load average {load[0]:.2f}, {os.cpu_count()} CPUs",
          flush=True)
    cp, breakdown, bg, errors = _in_process(plan)
    ab = _on_off(plan)
    print()
    print(f"rankwatch collector cost — {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, load average "
          f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, {time.monotonic() - started:.0f} s")
    print()
    print("| figure | value |")
    print("|---|---|")
    for name, value in _table(plan, cp, breakdown, bg, ab, errors):
        print(f"| {name} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
