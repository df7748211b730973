"""Collector overhead: step time with the collector on vs off, recording cost per collective, telemetry volume.

    .venv/bin/python benchmarks/collector_overhead.py [--steps 300] [--warmup 30] [--repeats 10]
        [--nproc 4] [--layout dp=2,tp=2,pp=1] [--json PATH]

The job is the canary on CanaryConfig defaults, 1 host, gloo on CPU. ON = collector with the replay GPU sampler
(so GPU sampling costs what it would with NVML present) on the default `CollectorConfig`; OFF = ``collector=False``
(the no-op NullCollector).

Step time, ON vs OFF
    The two arms run AT THE SAME TIME, one ON job and one OFF job sharing the machine, so whatever else the
    shared machine does lands on both alike (run one after the other, the arms differed by ±5–10 % from run to
    run here, far more than the target). Sharing is symmetric: the scheduler gives each rank process a fair
    share of the cores, so a job that needs more CPU per step runs slower by about that fraction — the
    collector's cost is what separates the arms. The arm started first alternates from repeat to repeat. Both
    are timed by the same clock outside the collector: with ``record_step_times`` every rank writes the
    perf_counter time (CLOCK_MONOTONIC: one clock for all processes), and its training thread's and process's
    CPU time, at the end of each step (`canary/loop.py`), collector on or off.

    Per repeat, only the COMMON WINDOW counts: from the moment both jobs are past their first W steps to the
    moment the first of them ends its last step, so neither arm ever runs alone (the one that starts or ends
    later would otherwise get the machine to itself for a while). Step time = mean interval between the slowest
    rank's step ends in the window — a throughput figure, so the collector's occasional costs (a fingerprint
    every 50 steps, a part-file write every 5 s) count as they do in a real job; the window's median step is
    shown beside it. Overhead per repeat = ON / OFF - 1.

Verdict
    Over the repeats, the mean overhead and its 95 % t interval (the repeats are independent paired
    measurements). PASS when the interval's upper end is within the target, FAIL when its lower end is over it,
    INCONCLUSIVE otherwise. Every repeat is printed. As cross-checks: the ON runs' own steps table (the
    collector's view of the same steps), the training thread's and the process's extra CPU per step, the
    recording cost per collective and the collector's work per step measured bottom-up.

Recording cost per collective
    In process, no torch.distributed: a process-group sentinel (a plain ``object()``) is registered with a
    GroupInfo, and ``with collector.collective("all_reduce", group, tensor): pass`` is timed against the bare
    loop, in batches of --micro-n, median over --micro-batches, on the thread's CPU clock (the machine is
    shared: preemption would otherwise land in the figure). Both go through a started Collector inside a step:
    once on a MemorySink (the recording alone) and once on a ParquetSink in a temp dir (writer and heartbeat
    threads live, as in the canary). The NullCollector's ``nullcontext()`` is shown for scale.

Telemetry volume
    Bytes of all part files under <run>/telemetry of each ON long run, divided by ranks x steps (fixed costs
    such as topology and start/exit events included), median over repeats.

Floors
    What two pieces of required work cost by themselves, next to the target's budget (1 % of an OFF rank's CPU
    per step): the pre-all-reduce gradient norm, timed in process as the DDP hook does it (one ``torch.dot`` per
    bucket right after the averaging division, over a default canary stage's gradients, warm and after 64 MB of
    other memory traffic), and the part-file writer thread (its CPU per step, as a share of an OFF rank's process
    CPU, and per part file). Last, from this run's own spread: the largest mean overhead that would still PASS
    (the interval's upper end at the target), in percent and in µs of CPU per rank-step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Nothing heavy at module level: ranks are spawned, and spawn re-imports this script in every rank.

TARGET_PCT = 1.0
"""Target: collector step-time overhead at most this many percent."""
ON, OFF = "ON", "OFF"


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchTiming:
    repeat: int
    arm: str
    steps: int
    duration_s: float
    run_dir: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RepeatResult:
    repeat: int
    order: str
    """Arm started first, then the other, e.g. "ON,OFF" (both run together)."""
    window_s: float
    """Length of the common window (both arms past warm-up, neither finished), seconds."""
    on_steps: int
    """ON steps (slowest-rank step ends) in the window."""
    off_steps: int
    on_ms: float
    """ON mean step time in the window, ms, from the trainer's step clock."""
    off_ms: float
    overhead_pct: float
    """ON / OFF - 1 of the window means, percent."""
    on_median_ms: float
    """ON median step interval in the window, ms."""
    off_median_ms: float
    on_self_ms: float | None
    """ON median step time, ms, from the collector's own steps table over steps W..S-1 (the method check)."""
    on_trainer_median_ms: float
    """ON median step interval over steps W..S-1 on the trainer's clock (compared with `on_self_ms`)."""
    telemetry_bytes: int
    bytes_by_table: dict[str, int]
    collectives_per_rank_step: float
    phases_per_rank_step: float
    writer_cpu_us_per_rank_step: float
    """The part-file writer thread's CPU per rank-step over the whole ON run (each rank's exit event says it)."""
    parts_per_rank: float
    """Rank part files the ON run wrote, per rank (every table; one per table with rows at each flush)."""
    steps_rows: int
    dropped_rows: int
    on_thread_cpu_ms: float
    off_thread_cpu_ms: float
    on_process_cpu_ms: float
    off_process_cpu_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    """Mean of per-repeat values with a two-sided 95 % t interval."""

    n: int
    mean: float
    sd: float
    low: float
    high: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroResult:
    n: int
    batches: int
    memory_sink_us: float
    parquet_sink_us: float
    null_us: float
    memory_sink_all_us: tuple[float, ...]
    parquet_sink_all_us: tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class GradNormFloor:
    """What the pre-all-reduce gradient norm costs by itself: one dot product per DDP bucket, taken right after
    DDP's averaging division as the hook does, over a default canary stage's gradients (thread CPU, µs a step)."""

    grad_bytes: int
    buckets: int
    warm_us: float
    """Median with the gradients in cache (a quiet process)."""
    evicted_us: float
    """Median after 64 MB of other memory traffic before each step's buckets (what a busy rank sees)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    nproc: int
    layout: str
    hosts: int
    settings: str
    """What differs from the defaults (canary global batch, ON arm's fingerprint interval and gradient norm), or
    'default settings': only that verdict is the benchmark's."""
    steps: int
    warmup: int
    repeats: int
    gpu_on: str
    load_before: tuple[float, float, float]
    """Machine load averages (1, 5, 15 min) when the benchmark started."""
    load_after: tuple[float, float, float]
    launches: tuple[LaunchTiming, ...]
    per_repeat: tuple[RepeatResult, ...]
    on_ms_median: float
    off_ms_median: float
    overhead: Interval
    """Per-repeat step-time overhead, percent: mean and 95 % t interval (what the verdict is judged on)."""
    overhead_pct_median: float
    overhead_pct_min: float
    overhead_pct_max: float
    on_self_ms_median: float | None
    method_error_pct: float | None
    """Median |trainer-clock ON - collector-clock ON| / collector-clock ON, percent (a cross-check)."""
    bytes_per_rank_step: float
    bytes_per_rank_step_min: float
    bytes_per_rank_step_max: float
    micro: MicroResult
    collective_cost_pct_of_step: float
    """Per-collective cost (ParquetSink) x collectives per rank-step, as a percentage of the step time (the
    self-timed ON step where there is one: it is far less noisy than the launch differences)."""
    thread_cpu_overhead: Interval
    """The training thread's extra CPU per step, percent of OFF's: mean and 95 % t interval over repeats."""
    process_cpu_overhead: Interval
    """The rank process's extra CPU per step (background threads included), percent of OFF's."""
    thread_cpu_extra_ms: float
    """Mean over repeats of the training thread's extra CPU per step, ms."""
    bottom_up_us_per_step: float
    """Collector work per rank-step measured bottom-up (`_synthetic_step_us`), µs."""
    bottom_up_pct: float
    """That work as a percentage of the OFF step time."""
    bottom_up_pct_of_thread_cpu: float
    """That work as a percentage of the OFF training thread's CPU per step (median over repeats): what the
    collector's calls would add to a rank that had a core to itself, measured warm."""
    grad_norm: GradNormFloor
    target_pct: float
    verdict: str


# ------------------------------------------------------------------------------------------- launches


@dataclass(frozen=True, kw_only=True, slots=True)
class ArmTimes:
    """One job's per-step clocks: the slowest rank's step ends and every rank's CPU clocks, ns."""

    step_end_ns: tuple[int, ...]
    """Per step: the latest step end over the ranks (perf_counter, comparable across processes)."""
    thread_cpu_ns: tuple[tuple[int, ...], ...]
    """Per rank, per step: the training thread's CPU time at the step end."""
    process_cpu_ns: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ArmTiming:
    """One arm's figures over the common window."""

    steps: int
    """Step ends in the window."""
    mean_ms: float
    """Mean step time (first to last step end in the window, divided by the steps between them), ms."""
    median_ms: float
    """Median step interval in the window, ms."""
    thread_cpu_ms: float
    """CPU time of the training thread per step in the window, mean over ranks, ms: the hot path's cost."""
    process_cpu_ms: float
    """CPU time of the whole rank process per step (background writer, heartbeat, GPU threads included), ms."""


MIN_WINDOW_STEPS = 20
"""Fewest step ends of either arm in the common window for a repeat to count."""


def common_window(a: tuple[int, ...], b: tuple[int, ...], warmup: int) -> tuple[int, int]:
    """[start, end] in ns where both jobs (step-end times `a`, `b`) are past their first `warmup` steps and
    neither has ended its last step."""
    return max(a[warmup - 1], b[warmup - 1]), min(a[-1], b[-1])


def arm_timing(times: ArmTimes, start_ns: int, end_ns: int) -> ArmTiming:
    """An arm's step time and CPU per step over the step ends inside [start_ns, end_ns]."""
    ends = times.step_end_ns
    inside = [i for i, t in enumerate(ends) if start_ns <= t <= end_ns]
    if len(inside) < 2:
        raise ValueError(f"common window holds {len(inside)} step ends of an arm; need at least 2")
    first, last = inside[0], inside[-1]
    span = last - first
    intervals = [(ends[i] - ends[i - 1]) / 1e6 for i in range(first + 1, last + 1)]

    def per_step(clocks: tuple[tuple[int, ...], ...]) -> float:
        return statistics.mean((c[last] - c[first]) / span / 1e6 for c in clocks)

    return ArmTiming(
        steps=len(inside),
        mean_ms=(ends[last] - ends[first]) / span / 1e6,
        median_ms=statistics.median(intervals),
        thread_cpu_ms=per_step(times.thread_cpu_ns),
        process_cpu_ms=per_step(times.process_cpu_ns),
    )


def _t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t distribution (df >= 1): bisection on the CDF, integrated with Simpson's rule."""
    if df < 1 or not 0.5 <= p < 1:
        raise ValueError(f"t quantile: need df >= 1 and 0.5 <= p < 1, got df={df}, p={p}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def pdf(x: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))

    def cdf(x: float) -> float:  # x >= 0
        n = 2000
        h = x / n
        area = pdf(0.0) + pdf(x) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
        return 0.5 + area * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(values: list[float], confidence: float = 0.95) -> Interval:
    """Mean of `values` with its two-sided t interval (n = 1: the interval is unbounded)."""
    n = len(values)
    mean = statistics.mean(values)
    if n < 2:
        return Interval(n=n, mean=mean, sd=math.nan, low=-math.inf, high=math.inf)
    sd = statistics.stdev(values)
    half = _t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return Interval(n=n, mean=mean, sd=sd, low=mean - half, high=mean + half)


def _config(args: argparse.Namespace, root: Path, repeat: int, arm: str) -> Any:
    from rankwatch.base.topology import Layout
    from rankwatch.canary.config import CanaryConfig

    return CanaryConfig(
        run_dir=root / f"r{repeat}-{arm.lower()}",
        steps=args.steps,
        layout=Layout.parse(args.layout, nproc=args.nproc),
        hosts=1,
        gpu="replay",  # only read when the collector is on
        collector=arm == ON,
        record_step_times=True,
        global_batch=args.global_batch,
        fingerprint_every=args.fingerprint_every,
        grad_norm=not args.no_grad_norm,
    )


def _launch_pair(args: argparse.Namespace, root: Path, repeat: int) -> dict[str, tuple[LaunchTiming, ArmTimes]]:
    """Run the ON and the OFF job at the same time (the first of `_order(repeat)` is started first); returns
    each arm's launch timing and clocks."""
    from rankwatch.base.rundir import STEP_TIMES_DIR
    from rankwatch.canary.launcher import launch
    from rankwatch.recovery.job import LaunchResult

    cfgs = {arm: _config(args, root, repeat, arm) for arm in (ON, OFF)}
    results: dict[str, LaunchResult] = {}
    errors: list[BaseException] = []

    def go(arm: str) -> None:
        try:
            results[arm] = launch(cfgs[arm], timeout_s=120.0 + 4.0 * args.steps)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(arm,)) for arm in _order(repeat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out: dict[str, tuple[LaunchTiming, ArmTimes]] = {}
    for arm, result in results.items():
        run_dir = cfgs[arm].run_dir
        if not result.ok:
            codes = ", ".join(f"{r}:{c}" for r, c in enumerate(result.exit_codes))
            raise SystemExit(f"collector_overhead: {arm} launch in {run_dir} failed (exit codes {codes})")
        docs = [json.loads(p.read_text()) for p in sorted((run_dir / STEP_TIMES_DIR).glob("rank-*.json"))]
        if len(docs) != args.nproc or any(len(d["step_end_ns"]) != args.steps for d in docs):
            raise SystemExit(f"collector_overhead: {run_dir / STEP_TIMES_DIR}: expected {args.nproc} ranks x "
                             f"{args.steps} steps of step times")
        timing = LaunchTiming(repeat=repeat, arm=arm, steps=args.steps, duration_s=result.duration_s, run_dir=str(run_dir))
        out[arm] = timing, ArmTimes(
            step_end_ns=tuple(max(d["step_end_ns"][i] for d in docs) for i in range(args.steps)),
            thread_cpu_ns=tuple(tuple(d["thread_cpu_ns"]) for d in docs),
            process_cpu_ns=tuple(tuple(d["process_cpu_ns"]) for d in docs),
        )
    return out


def _order(repeat: int) -> tuple[str, str]:
    """Which arm is started first: alternates, so neither always gets the head start."""
    return (ON, OFF) if repeat % 2 == 0 else (OFF, ON)


def _trainer_median_ms(times: ArmTimes, warmup: int) -> float:
    ends = times.step_end_ns
    return statistics.median((ends[i] - ends[i - 1]) / 1e6 for i in range(warmup, len(ends)))


def _self_timed_ms(run_dir: Path, *, warmup: int, steps: int) -> float | None:
    """Steady-state ms/step as the collector saw it: median over steps W..S-1 of the slowest rank's duration."""
    from rankwatch.analytics.store import connect
    from rankwatch.base.schema import Steps, Table

    rows = connect(run_dir).execute(
        f"SELECT median(d) FROM (SELECT max({Steps.DURATION_NS}) d FROM {Table.STEPS} "
        f"WHERE {Steps.STEP} >= ? AND {Steps.STEP} < ? GROUP BY {Steps.STEP})",
        [warmup, steps],
    ).fetchall()
    return None if rows[0][0] is None else float(rows[0][0]) / 1e6


def _telemetry(run_dir: Path, *, ranks: int, steps: int) -> tuple[int, dict[str, int], float, int, int, float, float, float]:
    """(total bytes, bytes per table, collectives per rank-step, steps rows, dropped rows, phases per rank-step,
    part-file writer CPU µs per rank-step (from each rank's exit event), rank part files per rank) of one ON run."""
    from rankwatch.analytics.store import connect, table_summaries
    from rankwatch.base.rundir import TELEMETRY_DIR
    from rankwatch.base.schema import PARTITION_KEY, EventKind, Events, Table
    from rankwatch.collector.collector import WRITER_CPU_PREFIX

    summaries = table_summaries(run_dir)
    by_table = {str(s.table): s.bytes for s in summaries}
    rows = {s.table: s.rows for s in summaries}
    con = connect(run_dir)
    dropped = con.execute(
        f"SELECT coalesce(max({Events.DROPPED_ROWS}), 0) FROM {Table.EVENTS} WHERE {Events.KIND} = ?",
        [str(EventKind.DROPS)],
    ).fetchone()
    exits = con.execute(
        f"SELECT {Events.MESSAGE} FROM {Table.EVENTS} WHERE {Events.KIND} = ? AND {Events.MESSAGE} LIKE ?",
        [str(EventKind.EXIT), WRITER_CPU_PREFIX + "%"],
    ).fetchall()
    writer_ms = [float(m.removeprefix(WRITER_CPU_PREFIX).removesuffix(" ms")) for (m,) in exits]
    writer_us = statistics.mean(writer_ms) * 1e3 / steps if writer_ms else math.nan
    parts = sum(1 for _ in (run_dir / TELEMETRY_DIR).glob(f"*/{PARTITION_KEY}=*/part-*.parquet"))
    return (
        sum(by_table.values()),
        by_table,
        rows[Table.COLLECTIVES] / (ranks * steps),
        rows[Table.STEPS],
        int(dropped[0]) if dropped else 0,
        rows[Table.PHASES] / (ranks * steps),
        writer_us,
        parts / ranks,
    )


def _run_repeats(args: argparse.Namespace, root: Path) -> tuple[list[LaunchTiming], list[RepeatResult]]:
    ranks = args.nproc
    timings: list[LaunchTiming] = []
    results: list[RepeatResult] = []
    for r in range(args.repeats):
        pair = _launch_pair(args, root, r)
        times = {arm: a for arm, (_, a) in pair.items()}
        timings.extend(t for t, _ in pair.values())
        start, end = common_window(times[ON].step_end_ns, times[OFF].step_end_ns, args.warmup)
        try:
            arms = {arm: arm_timing(a, start, end) for arm, a in times.items()}
        except ValueError as exc:
            raise SystemExit(f"collector_overhead: repeat {r}: {exc} (the arms barely overlapped; more --steps?)")
        for arm, a in arms.items():
            if a.steps < MIN_WINDOW_STEPS:
                raise SystemExit(f"collector_overhead: repeat {r}: only {a.steps} {arm} steps in the common window "
                                 f"(need {MIN_WINDOW_STEPS}; more --steps?)")
        on, off = arms[ON], arms[OFF]
        on_run = root / f"r{r}-on"
        total, by_table, coll, steps_rows, dropped, phases, writer_us, parts = _telemetry(
            on_run, ranks=ranks, steps=args.steps)
        if steps_rows != ranks * args.steps:
            print(f"  warning: {on_run}: {steps_rows} step rows, expected {ranks * args.steps}", file=sys.stderr)
        result = RepeatResult(
            repeat=r,
            order=",".join(_order(r)),
            window_s=(end - start) / 1e9,
            on_steps=on.steps,
            off_steps=off.steps,
            on_ms=on.mean_ms,
            off_ms=off.mean_ms,
            overhead_pct=(on.mean_ms - off.mean_ms) / off.mean_ms * 100,
            on_median_ms=on.median_ms,
            off_median_ms=off.median_ms,
            on_self_ms=_self_timed_ms(on_run, warmup=args.warmup, steps=args.steps),
            on_trainer_median_ms=_trainer_median_ms(times[ON], args.warmup),
            telemetry_bytes=total,
            bytes_by_table=by_table,
            collectives_per_rank_step=coll,
            phases_per_rank_step=phases,
            writer_cpu_us_per_rank_step=writer_us,
            parts_per_rank=parts,
            steps_rows=steps_rows,
            dropped_rows=dropped,
            on_thread_cpu_ms=on.thread_cpu_ms,
            off_thread_cpu_ms=off.thread_cpu_ms,
            on_process_cpu_ms=on.process_cpu_ms,
            off_process_cpu_ms=off.process_cpu_ms,
        )
        results.append(result)
        print(f"  repeat {r} ({result.order} started in that order; window {result.window_s:5.1f} s, "
              f"{on.steps}/{off.steps} steps): ON {on.mean_ms:6.2f} ms/step, OFF {off.mean_ms:6.2f} ms/step, "
              f"overhead {result.overhead_pct:+6.2f} %; training-thread CPU {on.thread_cpu_ms:5.2f} / "
              f"{off.thread_cpu_ms:5.2f} ms  (load {_load()[0]:.1f})", flush=True)
    return timings, results


def _load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (math.nan, math.nan, math.nan)


# ------------------------------------------------------------------------------------ micro-benchmark


def _loop_s(body: Callable[[int], None], n: int) -> float:
    """CPU seconds of this thread running `body(n)`: the machine is shared, preemption must not count."""
    start = time.thread_time()
    body(n)
    return time.thread_time() - start


def _micro(n: int, batches: int) -> MicroResult:
    import torch

    from rankwatch.base.schema import GroupKind
    from rankwatch.base.topology import GroupInfo
    from rankwatch.collector.collector import Collector, CollectorConfig
    from rankwatch.collector.sink import MemorySink

    group = object()  # stands in for a process group: the tracker only keys it by id()
    info = GroupInfo(name="dp0", kind=GroupKind.DP, ranks=(0, 1), hosts=("host0", "host0"))
    tensor = torch.zeros(1024)

    def bare(k: int) -> None:
        for _ in range(k):
            pass

    def null(k: int) -> None:
        for _ in range(k):
            with nullcontext():
                pass

    with tempfile.TemporaryDirectory(prefix="rankwatch-micro-") as tmp:
        on_disk = Collector(CollectorConfig(run_dir=Path(tmp), handle_sigterm=False), rank=0, world_size=2,
                            host="host0")
        in_memory = Collector(CollectorConfig(run_dir=Path(tmp) / "unused", handle_sigterm=False), rank=0,
                              world_size=2, host="host0", sink=MemorySink())
        collectors = (in_memory.start(), on_disk.start())
        for c in collectors:
            c.register_group(group, info)

        def recorded(c: Collector, step: int) -> Callable[[int], None]:
            def loop(k: int) -> None:
                collective = c.collective
                with c.step(step):
                    for _ in range(k):
                        with collective("all_reduce", group, tensor):
                            pass

            return loop

        memory_us: list[float] = []
        parquet_us: list[float] = []
        null_us: list[float] = []
        try:
            for b in range(batches + 1):  # batch 0 warms up and is dropped
                base = _loop_s(bare, n)
                t_memory = _loop_s(recorded(in_memory, b), n)
                t_parquet = _loop_s(recorded(on_disk, b), n)
                t_null = _loop_s(null, n)
                on_disk.flush(timeout_s=30.0)  # the writer drains between batches, so no drops skew the timing
                if b:
                    memory_us.append((t_memory - base) / n * 1e6)
                    parquet_us.append((t_parquet - base) / n * 1e6)
                    null_us.append((t_null - base) / n * 1e6)
        finally:
            for c in collectors:
                c.close(exit_code=0)
    for name, c in (("MemorySink", in_memory), ("ParquetSink", on_disk)):
        if c.errors or c.sink.dropped_total:
            print(f"  warning: micro collector ({name}): {c.errors} internal errors, "
                  f"{c.sink.dropped_total} dropped rows", file=sys.stderr)
    return MicroResult(
        n=n,
        batches=batches,
        memory_sink_us=statistics.median(memory_us),
        parquet_sink_us=statistics.median(parquet_us),
        null_us=statistics.median(null_us),
        memory_sink_all_us=tuple(memory_us),
        parquet_sink_all_us=tuple(parquet_us),
    )


@contextmanager
def _canary_threads() -> Iterator[None]:
    """Run the body on the canary's torch thread count, as its ranks do: multi-threaded kernels on a shared machine
    spin far more CPU than they use (the gradient-norm dot product: ~50 µs on 1 thread, ms on 2 here)."""
    import dataclasses

    import torch

    from rankwatch.canary.config import CanaryConfig

    canary = int(next(f.default for f in dataclasses.fields(CanaryConfig) if f.name == "threads"))  # type: ignore[arg-type]
    threads = torch.get_num_threads()
    torch.set_num_threads(canary)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _default_stage(layout: str, nproc: int) -> Any:
    """Rank 0's stage of a default-size canary model under `layout`."""
    from rankwatch.base.topology import Layout
    from rankwatch.canary.model import ModelConfig, Stage

    lay = Layout.parse(layout, nproc=nproc)
    return Stage(ModelConfig(), seed=0, pp=0, pp_size=lay.pp, tp=0, tp_size=lay.tp)


def _synthetic_step_us(*, collectives: int, phases: int, steps: int, layout: str, nproc: int) -> tuple[float, float]:
    """Collector work of one canary rank-step, bottom-up, in µs: (ON, OFF).

    One step's worth of exactly the calls the canary makes — the step context, a loader fetch, `phases` phase
    contexts, `collectives` timed collectives, the loss — plus the fingerprint of a default-size canary stage
    and its optimizer every `fingerprint_every` steps and the pre-all-reduce gradient-norm dot product over
    its gradients, with a started Collector on a ParquetSink (writer, heartbeat and replay-GPU threads live),
    against the same loop on the NullCollector, on the thread's CPU clock. No training work runs, so machine noise
    has little to hide in."""
    with _canary_threads():
        return _synthetic_step_us_run(collectives=collectives, phases=phases, steps=steps, layout=layout, nproc=nproc)


def _synthetic_step_us_run(*, collectives: int, phases: int, steps: int, layout: str, nproc: int) -> tuple[float, float]:
    import torch

    from rankwatch.base.schema import GroupKind
    from rankwatch.base.topology import GroupInfo
    from rankwatch.collector.collector import Collector, CollectorConfig
    from rankwatch.collector.gpu import ReplaySampler
    from rankwatch.collector.null import NullCollector

    stage = _default_stage(layout, nproc)
    opt = torch.optim.AdamW(stage.parameters())
    for p in stage.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    grads = torch.cat([p.grad.view(-1) for p in stage.parameters() if p.grad is not None])
    group = object()
    info = GroupInfo(name="tp.pp0.dp0", kind=GroupKind.TP, ranks=(0, 1), hosts=("host0", "host0"))
    tensor = torch.zeros(1024)
    names = ["data", "forward", "backward", "optimizer"]

    def run(c: object, n: int) -> float:
        loader = c.wrap_loader(iter(range(n)), position=lambda: 0)  # type: ignore[attr-defined]
        start = time.thread_time()  # CPU time: the machine is shared, preemption must not count
        for i in range(n):
            with c.step(i) as rec:  # type: ignore[attr-defined]
                next(loader)
                for k in range(phases):
                    with c.phase(names[k % len(names)]):  # type: ignore[attr-defined]
                        pass
                for _ in range(collectives):
                    with c.collective("all_reduce", group, tensor):  # type: ignore[attr-defined]
                        pass
                if isinstance(c, Collector):
                    torch.dot(grads, grads)  # what the DDP hook adds per step
                rec.loss = 1.0
            c.maybe_fingerprint(i, stage, opt, domain="d", domain_ranks=[0])  # type: ignore[attr-defined]
        return (time.thread_time() - start) / n * 1e6

    with tempfile.TemporaryDirectory(prefix="rankwatch-step-") as tmp:
        on = Collector(CollectorConfig(run_dir=Path(tmp), handle_sigterm=False), rank=0, world_size=2, host="host0",
                       gpu_sampler=ReplaySampler(host="host0", indices=[0])).start()
        on.register_group(group, info)
        off = NullCollector(rank=0, world_size=2)
        on_us, off_us = [], []
        try:
            for b in range(6):
                on_us.append(run(on, steps))
                off_us.append(run(off, steps))
                on.flush(timeout_s=30.0)
        finally:
            on.close(exit_code=0)
    return statistics.median(on_us[1:]), statistics.median(off_us[1:])


def _grad_norm_floor(*, layout: str, nproc: int, steps: int = 60) -> GradNormFloor:
    """The gradient norm's own cost, as the collector's DDP hook pays it: per bucket (DDP's first bucket is 1 MB,
    later ones up to 25 MB), the averaging division (not timed: DDP does it with the collector off too), then
    ``torch.dot`` of the bucket with itself (timed, thread CPU), over a default canary stage's gradients, on the
    canary's thread count. Once warm, once with 64 MB of other memory traffic before each step's buckets."""
    import torch
    import torch.distributed as dist

    numel = sum(p.numel() for p in _default_stage(layout, nproc).parameters())
    flat = torch.randn(numel)
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024) // flat.element_size()
    rest = 25 * 1024 * 1024 // flat.element_size()
    buckets = [flat[:first], *flat[first:].split(rest)] if numel > first else [flat]
    other = torch.zeros(16 * 1024 * 1024)  # 64 MB: more than the last-level cache of most hosts

    def step(evict: bool) -> float:
        if evict:
            other.add_(1.0)
        spent = 0
        for b in buckets:
            b.div_(1.0)  # the averaging pass's memory traffic; by 1.0 so that repeats never reach subnormals
            start = time.thread_time_ns()
            torch.dot(b, b)
            spent += time.thread_time_ns() - start
        return spent / 1e3

    with _canary_threads():
        warm = [step(False) for _ in range(steps)]
        evicted = [step(True) for _ in range(steps)]
    return GradNormFloor(grad_bytes=numel * flat.element_size(), buckets=len(buckets),
                         warm_us=statistics.median(warm[5:]), evicted_us=statistics.median(evicted[5:]))


# ----------------------------------------------------------------------------------------- reporting


def _settings(args: argparse.Namespace) -> str:
    """What this run changed from the default settings, for the report."""
    changed = [
        f"{name} {value}" for name, value, default in (
            ("global batch", args.global_batch, args.defaults.global_batch),
            ("fingerprint every", args.fingerprint_every, args.defaults.fingerprint_every),
        ) if value != default
    ]
    if args.no_grad_norm:
        changed.append("no gradient norm")
    return "changed: " + ", ".join(changed) if changed else "default settings"


def _verdict(overhead: Interval, bottom_up_pct: float) -> str:
    """Judged on the end-to-end figure alone: the warm bottom-up figure is shown for scale but understates the
    cost inside a busy job several times over (see benchmarks/collector_insitu.py).
    PASS when the whole 95 % interval is within the target, FAIL when all of it is over, INCONCLUSIVE otherwise."""
    figures = (f"end-to-end {overhead.mean:+.2f} %, 95 % interval [{overhead.low:+.2f}, {overhead.high:+.2f}] % over "
               f"{overhead.n} repeat(s) (warm bottom-up {bottom_up_pct:.2f} %); target ≤ {TARGET_PCT:g} %")
    if overhead.n < 2:
        return f"INCONCLUSIVE: {figures} (use --repeats >= 2 for an interval)"
    if overhead.low > TARGET_PCT:
        return f"FAIL: {figures}"
    if overhead.high <= TARGET_PCT:
        return f"PASS: {figures}"
    return f"INCONCLUSIVE: {figures}"


def _fmt(i: Interval, unit: str = "%") -> str:
    return f"{i.mean:+.2f} {unit} (95 % interval [{i.low:+.2f}, {i.high:+.2f}], sd {i.sd:.2f}, n {i.n})"


def _print_report(rep: Report) -> None:
    print()
    print(f"rankwatch collector overhead — {rep.nproc} ranks ({rep.layout}), {rep.hosts} host, {rep.steps} steps "
          f"(first {rep.warmup} excluded), {rep.repeats} repeat(s); ON = collector + gpu={rep.gpu_on}, OFF = no-op; "
          f"{rep.settings}")
    print(f"machine load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in rep.load_before)} at the start, "
          f"{'/'.join(f'{x:.2f}' for x in rep.load_after)} at the end")
    print()
    print("step time, ms/step, in each repeat's common window (both arms past warm-up, neither finished; trainer's "
          "clock, slowest rank)")
    print(f"  {'repeat':<7}{'started':<9}{'window s':>9}{'steps':>9}{'ON mean':>9}{'OFF mean':>9}{'overhead':>10}"
          f"{'ON med':>8}{'OFF med':>8}{'ON self':>9}")
    for r in rep.per_repeat:
        self_ms = f"{r.on_self_ms:.2f}" if r.on_self_ms is not None else "-"
        print(f"  {r.repeat:<7}{r.order:<9}{r.window_s:>9.1f}{f'{r.on_steps}/{r.off_steps}':>9}{r.on_ms:>9.2f}"
              f"{r.off_ms:>9.2f}{r.overhead_pct:>+9.2f}%{r.on_median_ms:>8.2f}{r.off_median_ms:>8.2f}{self_ms:>9}")
    print(f"  medians over repeats: ON {rep.on_ms_median:.2f}, OFF {rep.off_ms_median:.2f} ms/step; overhead median "
          f"{rep.overhead_pct_median:+.2f} %, min {rep.overhead_pct_min:+.2f} %, max {rep.overhead_pct_max:+.2f} %")
    print(f"  step-time overhead: {_fmt(rep.overhead)}")
    if rep.method_error_pct is not None:
        print(f"  ON: trainer clock vs collector's steps table (medians over steps {rep.warmup}..{rep.steps - 1}) "
              f"differ by {rep.method_error_pct:.2f} % (median over repeats)")
    print()
    print("CPU per step in the window, ms (mean over ranks; training thread = the hot path, process = with "
          "background threads)")
    print(f"  {'repeat':<8}{'thread ON':>10}{'OFF':>8}{'+%':>8}{'process ON':>12}{'OFF':>8}{'+%':>8}")
    for r in rep.per_repeat:
        t_pct = (r.on_thread_cpu_ms - r.off_thread_cpu_ms) / r.off_thread_cpu_ms * 100
        p_pct = (r.on_process_cpu_ms - r.off_process_cpu_ms) / r.off_process_cpu_ms * 100
        print(f"  {r.repeat:<8}{r.on_thread_cpu_ms:>10.2f}{r.off_thread_cpu_ms:>8.2f}{t_pct:>+7.2f}%"
              f"{r.on_process_cpu_ms:>12.2f}{r.off_process_cpu_ms:>8.2f}{p_pct:>+7.2f}%")
    print(f"  training-thread CPU overhead {_fmt(rep.thread_cpu_overhead)}; {rep.thread_cpu_extra_ms:.3f} ms a step")
    print(f"  process CPU overhead {_fmt(rep.process_cpu_overhead)}")
    writer = statistics.median(r.writer_cpu_us_per_rank_step for r in rep.per_repeat)
    print(f"  of which the part-file writer thread: {writer:.0f} µs a step (whole run, median over repeats; "
          "it builds the rows of steps, phases and collectives and writes the parquet parts)")
    print()
    m = rep.micro
    coll = statistics.median(r.collectives_per_rank_step for r in rep.per_repeat)
    print(f"recording cost per collective, µs of CPU (in process, median of {m.batches} × {m.n}, minus the bare loop)")
    print(f"  {'Collector + MemorySink (started, in a step)':<46}{m.memory_sink_us:>8.2f}")
    print(f"  {'Collector + ParquetSink (started, in a step)':<46}{m.parquet_sink_us:>8.2f}")
    print(f"  {'NullCollector (nullcontext), for scale':<46}{m.null_us:>8.2f}")
    print(f"  {coll:.1f} collectives per rank-step → {coll * m.parquet_sink_us:.1f} µs/step "
          f"= {rep.collective_cost_pct_of_step:.3f} % of a step")
    print()
    print("telemetry (ON long runs)")
    print(f"  bytes per rank-step  {rep.bytes_per_rank_step:>10.1f}  (min {rep.bytes_per_rank_step_min:.1f}, "
          f"max {rep.bytes_per_rank_step_max:.1f})")
    denom = rep.nproc * rep.steps
    for table in rep.per_repeat[0].bytes_by_table:
        per = statistics.median(r.bytes_by_table[table] / denom for r in rep.per_repeat)
        print(f"    {table:<18} {per:>10.1f}")
    print(f"  dropped rows (max over repeats): {max(r.dropped_rows for r in rep.per_repeat)}")
    print()
    print(f"collector work per rank-step, bottom-up: {rep.bottom_up_us_per_step:.1f} µs of CPU = "
          f"{rep.bottom_up_pct:.3f} % of the OFF step, {rep.bottom_up_pct_of_thread_cpu:.2f} % of its training "
          "thread's CPU (synthetic step, warm: the canary's calls with no training work, ON minus NullCollector)")
    print()
    _print_floors(rep)
    print()
    print(f"verdict: {rep.verdict}")


def _print_floors(rep: Report) -> None:
    """What two pieces of required work cost by themselves, next to the target's budget: the gradient norm (one
    read of the gradients every step) and the part files (one per table with rows at every flush, so the live
    fail-stop analysis sees each rank within a few heartbeats)."""
    thread_us = statistics.median(r.off_thread_cpu_ms for r in rep.per_repeat) * 1e3
    process_us = statistics.median(r.off_process_cpu_ms for r in rep.per_repeat) * 1e3
    writer_us = statistics.median(r.writer_cpu_us_per_rank_step for r in rep.per_repeat)
    parts = statistics.median(r.parts_per_rank for r in rep.per_repeat)
    g = rep.grad_norm
    print(f"floors: required work alone, against the target's budget ({rep.target_pct:g} % of an OFF rank's CPU per "
          f"step = {process_us * rep.target_pct / 100:.0f} µs, of its training thread's = "
          f"{thread_us * rep.target_pct / 100:.0f} µs)")
    print(f"  gradient norm, one dot per DDP bucket after the averaging division ({g.grad_bytes / 1e6:.2f} MB in "
          f"{g.buckets} bucket(s), in process): {g.warm_us:.0f} µs warm, {g.evicted_us:.0f} µs after other memory "
          f"traffic = {g.warm_us / thread_us * 100:.2f}–{g.evicted_us / thread_us * 100:.2f} % of the OFF training "
          "thread's CPU per step")
    print(f"  part files, {parts:.0f} per rank in the ON run: the writer thread's {writer_us:.0f} µs a step = "
          f"{writer_us / process_us * 100:.2f} % of an OFF rank's process CPU per step, "
          f"{writer_us * rep.steps / parts / 1e3:.2f} ms of writer CPU per part (rows built in it)")
    o = rep.overhead
    if o.n >= 2:
        # the largest mean that still PASSes with this run's spread: its interval's upper end at the target
        room = rep.target_pct - (o.high - o.mean)
        print(f"  this run's spread (sd {o.sd:.2f} % per repeat, {o.n} repeats): a PASS needs a mean overhead of at most "
              f"{room:+.2f} %, about {max(room, 0.0) / 100 * process_us:.0f} µs of CPU per rank-step")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    import dataclasses

    from rankwatch.canary.config import CanaryConfig

    CANARY_DEFAULTS = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(CanaryConfig)})
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=300, help="steps per launch (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="first steps excluded (default 30)")
    p.add_argument("--repeats", type=int, default=10, help="ON/OFF pairs, each run together (default 10)")
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--layout", default="dp=2,tp=2,pp=1", help="dp=N,tp=N,pp=N (default dp=2,tp=2,pp=1)")
    p.add_argument("--global-batch", type=int, default=CANARY_DEFAULTS.global_batch,
                   help=f"canary global batch, both arms (default {CANARY_DEFAULTS.global_batch}, the canary's): "
                        "more work per step, the same collector events")
    p.add_argument("--fingerprint-every", type=int, default=CANARY_DEFAULTS.fingerprint_every,
                   help=f"ON arm's fingerprint interval (default {CANARY_DEFAULTS.fingerprint_every}, the collector's; "
                        "0 = none: for a cost breakdown)")
    p.add_argument("--no-grad-norm", action="store_true",
                   help="ON arm skips the pre-all-reduce gradient norm (for a cost breakdown only)")
    p.add_argument("--micro-n", type=int, default=20_000, help="collectives per micro-benchmark batch")
    p.add_argument("--micro-batches", type=int, default=7, help="micro-benchmark batches (median)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    args.defaults = CANARY_DEFAULTS
    if args.global_batch < 1 or args.fingerprint_every < 0:
        p.error("--global-batch must be >= 1 and --fingerprint-every >= 0")
    if not 1 <= args.warmup < args.steps:
        p.error(f"need 1 <= --warmup < --steps, got --warmup {args.warmup} --steps {args.steps}")
    if args.repeats < 1 or args.micro_n < 1 or args.micro_batches < 1:
        p.error("--repeats, --micro-n and --micro-batches must be >= 1")
    from rankwatch.base.topology import Layout

    try:
        args.layout = str(Layout.parse(args.layout, nproc=args.nproc))
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    load_before = _load()
    print(f"collector_overhead: {args.repeats} repeat(s) × 2 launches (ON, OFF) of {args.steps} steps, "
          f"{args.nproc} ranks {args.layout}, global batch {args.global_batch}; ON: fingerprints every "
          f"{args.fingerprint_every} steps, gradient norm {'off' if args.no_grad_norm else 'on'}; "
          f"load average {load_before[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as tmp:
        timings, results = _run_repeats(args, Path(tmp))
    print("  micro-benchmark ...", flush=True)
    micro = _micro(args.micro_n, args.micro_batches)
    coll_per_step = statistics.median(r.collectives_per_rank_step for r in results)
    phases_per_step = statistics.median(r.phases_per_rank_step for r in results)
    step_on_us, step_off_us = _synthetic_step_us(
        collectives=round(coll_per_step), phases=round(phases_per_step), steps=500, layout=args.layout, nproc=args.nproc
    )
    grad_norm = _grad_norm_floor(layout=args.layout, nproc=args.nproc)

    on = statistics.median(r.on_ms for r in results)
    off = statistics.median(r.off_ms for r in results)
    overheads = [r.overhead_pct for r in results]
    selfs = [r.on_self_ms for r in results if r.on_self_ms is not None]
    errors = [abs(r.on_trainer_median_ms - r.on_self_ms) / r.on_self_ms * 100 for r in results if r.on_self_ms]
    per_rank_step = [r.telemetry_bytes / (args.nproc * args.steps) for r in results]
    step_ms = statistics.median(selfs) if selfs else off
    overhead = t_interval(overheads)
    bottom_up_pct = (step_on_us - step_off_us) / (off * 1e3) * 100
    settings = _settings(args)
    report = Report(
        nproc=args.nproc,
        layout=args.layout,
        hosts=1,
        settings=settings,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        gpu_on="replay",
        load_before=load_before,
        load_after=_load(),
        launches=tuple(timings),
        per_repeat=tuple(results),
        on_ms_median=on,
        off_ms_median=off,
        overhead=overhead,
        overhead_pct_median=statistics.median(overheads),
        overhead_pct_min=min(overheads),
        overhead_pct_max=max(overheads),
        on_self_ms_median=statistics.median(selfs) if selfs else None,
        method_error_pct=statistics.median(errors) if errors else None,
        bytes_per_rank_step=statistics.median(per_rank_step),
        bytes_per_rank_step_min=min(per_rank_step),
        bytes_per_rank_step_max=max(per_rank_step),
        micro=micro,
        collective_cost_pct_of_step=coll_per_step * micro.parquet_sink_us / (step_ms * 1e3) * 100,
        grad_norm=grad_norm,
        target_pct=TARGET_PCT,
        thread_cpu_overhead=t_interval(
            [(r.on_thread_cpu_ms - r.off_thread_cpu_ms) / r.off_thread_cpu_ms * 100 for r in results]
        ),
        process_cpu_overhead=t_interval(
            [(r.on_process_cpu_ms - r.off_process_cpu_ms) / r.off_process_cpu_ms * 100 for r in results]
        ),
        thread_cpu_extra_ms=statistics.mean(r.on_thread_cpu_ms - r.off_thread_cpu_ms for r in results),
        bottom_up_us_per_step=step_on_us - step_off_us,
        bottom_up_pct=bottom_up_pct,
        bottom_up_pct_of_thread_cpu=(step_on_us - step_off_us)
        / (statistics.median(r.off_thread_cpu_ms for r in results) * 1e3) * 100,
        verdict=_verdict(overhead, bottom_up_pct) if settings == "default settings"
        else f"(not the benchmark's verdict: {settings}) {_verdict(overhead, bottom_up_pct)}",
    )
    _print_report(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
