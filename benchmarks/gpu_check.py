"""One prepared check of rankwatch's GPU paths, for a lent GPU machine (under 5 minutes there, under a minute here).

    python benchmarks/gpu_check.py [--out DIR]          # where rankwatch is installed (`make setup`)
    PYTHONPATH=src python3 benchmarks/gpu_check.py       # a bare checkout (a lent GPU machine has no install)

With CUDA it checks, against the real device:

- ``nvml sampler``: every `gpu` table column read at least once non-null over a few samples (the null ones named;
  the core ones — clocks, power, temperature, utilization, memory, throttle reasons — must be there), with the SM
  clock against its maximum, the throttle reasons and the ECC counters.
- ``gpu_slow 1 rank (device)``: a 1-rank NCCL canary on cuda:0 (a model big enough to keep the device busy) with
  ``gpu_slow:rank=0,from=S,factor=F``. The slowdown must show on the device clock and not in the host's enqueue
  time: the median `device_compute_ns` rises by (F - 1) times its earlier value within [0.6, 1.5] of that, and the
  host time inside the step's phases (forward + backward + optimizer `duration_ns`, where the thread only enqueues;
  it waits at the loss read after them) rises by less than 20 % of the device rise. `compute_ns` (host, sync wait
  included) is reported: it absorbs the slowdown at the sync, as the schema says.
- ``gpu_slow 2 ranks (analyze)`` (>= 2 GPUs): a dp=2 NCCL canary with a gpu_slow rank, which
  `rankwatch.analytics.analyze.analyze` must name as the subject of a straggler incident.
- ``collector overhead (GPU step)``: a real GPU training step with the collector ON (CUDA device timer, NVML sampler)
  and OFF, in alternating blocks; per-repeat overhead of the median step time, mean with its 95 % t interval (PASS:
  the upper end <= 1 %, FAIL: the lower end over it, else INCONCLUSIVE). The ON arm's rows must carry device times.

Everywhere (without CUDA: only these, and the script says so): the replay GPU sampler (every column, a throttle, ECC
errors, a replay of recorded rows), the fake device timer through the collector (a 2x device slowdown shows in
`device_compute_ns`, not in `compute_ns`), and the gpu_slow CPU fallback (calibrated work proportional to the factor
on the thread's CPU clock; a 1-rank gloo canary announces it once and its `compute_ns` grows by the factor).

Prints one table (check, result, figures) and writes it, with a JSON copy, under --out. Exit status 1 when any check
FAILs; SKIP and INCONCLUSIVE are not failures.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Nothing heavy at module level: spawn re-imports this script in every canary rank.

PASS, FAIL, SKIP, INCONCLUSIVE = "PASS", "FAIL", "SKIP", "INCONCLUSIVE"
OVERHEAD_TARGET_PCT = 1.0
"""The collector's step-time overhead target (as benchmarks/collector_overhead.py)."""
GPU_SLOW_FACTOR = 2.0
DEVICE_RISE = (0.6, 1.5)
"""Accepted device_compute_ns rise, as a fraction of the (factor - 1) x earlier value it should be."""
HOST_SHARE_MAX = 0.2
"""Largest rise of the host's in-phase (enqueue) time, as a fraction of the device rise."""
CORE_GPU_COLUMNS = ("sm_clock_mhz", "mem_clock_mhz", "sm_clock_max_mhz", "power_w", "power_limit_w",
                    "temperature_c", "gpu_util_pct", "mem_util_pct", "mem_used_bytes", "throttle_reasons")
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Two-sided 95 % t quantiles for 1..30 degrees of freedom (beyond: 1.96)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    check: str
    result: str
    figures: str


def _failed(name: str, exc: Exception) -> Result:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return Result(check=name, result=FAIL, figures=f"{type(exc).__name__}: {first}"[:300])


def _guard(name: str, fn: Callable[[], Result]) -> Result:
    """A check that raises is a FAIL naming the exception (the table is still printed)."""
    try:
        return fn()
    except Exception as exc:
        return _failed(name, exc)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean with its two-sided 95 % t interval (n = 1: unbounded)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, -math.inf, math.inf
    df = len(values) - 1
    half = (_T975[df - 1] if df <= len(_T975) else 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def _read(run_dir: Path, table: str) -> list[dict[str, Any]]:
    """Every row of one telemetry table of a run, from its rank part files (pyarrow only: a lent machine may lack
    duckdb)."""
    import pyarrow.parquet as pq

    from rankwatch.base.rundir import TELEMETRY_DIR

    out: list[dict[str, Any]] = []
    for part in sorted((run_dir / TELEMETRY_DIR / table).glob("rank=*/part-*.parquet")):
        rank = int(part.parent.name.split("=", 1)[1])
        for row in pq.read_table(part).to_pylist():
            row.setdefault("rank", rank)
            out.append(row)
    return out


# -------------------------------------------------------------------------------------------- everywhere


def check_cuda() -> Result:
    import torch

    if not torch.cuda.is_available():
        return Result(check="cuda", result=SKIP, figures=f"no CUDA device (torch {torch.__version__}): GPU checks "
                      "skipped, CPU-side checks only")
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return Result(check="cuda", result=PASS, figures=f"{torch.cuda.device_count()} x {', '.join(names)}, torch "
                  f"{torch.__version__}, CUDA {torch.version.cuda}")


def check_replay_sampler() -> Result:
    from rankwatch.base.schema import Gpu, Table, ThrottleReason, column_names
    from rankwatch.collector.gpu import H100_SXM, ReplaySampler
    from rankwatch.collector.sink import rows_to_table

    sampler = ReplaySampler(host="host0", indices=[0, 1], seed=3)
    healthy = sampler.sample(0)
    row = dict(zip(column_names(Table.GPU), healthy.row(rank=0, step=0)))
    # the profile remaps rows instead of retiring pages (H100, H200): those columns are null, as on the device
    unsupported = {str(Gpu.RETIRED_PAGES_SBE), str(Gpu.RETIRED_PAGES_DBE)} if H100_SXM.row_remapping else set()
    nulls = sorted(k for k, v in row.items() if v is None and k not in unsupported)
    sampler.throttle(1, reason=ThrottleReason.HW_THERMAL_SLOWDOWN)
    sampler.add_ecc(1, sbe=2, dbe=1)
    hot = sampler.sample(1)
    throttled = bool((hot.throttle_reasons or 0) & int(ThrottleReason.HW_THERMAL_SLOWDOWN))
    slower = (hot.sm_clock_mhz or 0) < 0.8 * (hot.sm_clock_max_mhz or 1)
    ecc = (hot.ecc_sbe_volatile, hot.ecc_dbe_volatile) == (2, 1)
    recorded = rows_to_table(Table.GPU, [sampler.sample(0).row(rank=0, step=s) for s in range(3)])
    replayed = ReplaySampler.from_table(recorded)
    again = replayed.sample(0)
    same = (again.device_uuid, again.sm_clock_mhz) == (recorded.column("device_uuid")[0].as_py(),
                                                        recorded.column("sm_clock_mhz")[0].as_py())
    ok = not nulls and throttled and slower and ecc and same
    figures = (f"{len(row) - len(nulls)}/{len(row)} columns non-null (null by profile: {', '.join(sorted(unsupported))}"
               f"{'; null: ' + ', '.join(nulls) if nulls else ''}); throttle bit {throttled}, SM {hot.sm_clock_mhz}/"
               f"{hot.sm_clock_max_mhz} MHz; ECC sbe/dbe {hot.ecc_sbe_volatile}/{hot.ecc_dbe_volatile}; "
               f"replay of recorded rows {'matches' if same else 'differs'}")
    return Result(check="replay sampler", result=PASS if ok else FAIL, figures=figures)


def _fake_device_steps(factor_from: int, steps: int, factor: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Steps through a real Collector with a `FakeDeviceTimer` (the one place this script drives the fake): each
    phase enqueues its device work and returns at once, the host's own time per phase is constant, and from
    `factor_from` the forward phase enqueues `factor` times the step's device work (a slow device)."""
    from rankwatch.base.schema import Table, column_names
    from rankwatch.collector.collector import Collector, CollectorConfig
    from rankwatch.collector.device import FakeDeviceTimer
    from rankwatch.collector.sink import MemorySink

    work = {"forward": 2_000_000, "backward": 4_000_000, "optimizer": 1_000_000}  # device ns per phase
    dev = FakeDeviceTimer(capacity=512)
    sink = MemorySink()
    with tempfile.TemporaryDirectory() as tmp:
        c = Collector(CollectorConfig(run_dir=Path(tmp), handle_sigterm=False), rank=0, world_size=1, sink=sink,
                      device_timer=dev).start()
        for step in range(steps):
            with c.step(step):
                for name, ns in work.items():
                    with c.phase(name):
                        extra = (factor - 1.0) * sum(work.values()) if name == "forward" and step >= factor_from else 0
                        dev.enqueue(int(ns + extra))
                        time.sleep(0.0005)  # the host's own enqueue time, the same at every step
                dev.run_all()  # the loss read: the device finishes the step's work before the step ends
        c.close(exit_code=0)
    steps_rows = [dict(zip(column_names(Table.STEPS), r)) for r in sink.rows(Table.STEPS)]
    phase_rows = [dict(zip(column_names(Table.PHASES), r)) for r in sink.rows(Table.PHASES)]
    return steps_rows, phase_rows


def check_fake_device_timer() -> Result:
    """The collector's device columns from the fake timer: a 2x device slowdown doubles device_compute_ns and
    leaves the host's phase time alone."""
    from rankwatch.base.schema import Phases, Steps

    start, steps = 10, 20
    rows, phases = _fake_device_steps(start, steps, GPU_SLOW_FACTOR)
    filled = sum(1 for r in rows if r[Steps.DEVICE_NS] is not None and r[Steps.DEVICE_COMPUTE_NS] is not None)
    phase_filled = sum(1 for p in phases if p[Phases.DEVICE_DURATION_NS] is not None)
    before = _median([r[Steps.DEVICE_COMPUTE_NS] for r in rows if r[Steps.STEP] < start and r[Steps.DEVICE_COMPUTE_NS]])
    after = _median([r[Steps.DEVICE_COMPUTE_NS] for r in rows if r[Steps.STEP] >= start and r[Steps.DEVICE_COMPUTE_NS]])
    host = {s: sum(p[Phases.DURATION_NS] for p in phases if p[Phases.STEP] == s) for s in range(steps)}
    host_before = _median([host[s] for s in range(start)])
    host_after = _median([host[s] for s in range(start, steps)])
    ratio = after / before if before else math.nan
    host_rise = host_after - host_before
    ok = (filled == len(rows) == steps and phase_filled == len(phases) and abs(ratio - GPU_SLOW_FACTOR) < 0.05
          and host_rise < HOST_SHARE_MAX * (after - before))
    figures = (f"device columns on {filled}/{len(rows)} steps, {phase_filled}/{len(phases)} phases; device_compute "
               f"{before / 1e6:.2f} -> {after / 1e6:.2f} ms (x{ratio:.2f}, want x{GPU_SLOW_FACTOR:g}); host phases "
               f"{host_before / 1e6:.2f} -> {host_after / 1e6:.2f} ms")
    return Result(check="fake device timer -> collector", result=PASS if ok else FAIL, figures=figures)


def check_cpu_fallback_work() -> Result:
    """The gpu_slow work on CPU, calibrated on a small MLP step, on the thread's CPU clock (one intra-op thread)."""
    import torch

    from rankwatch.canary.loop import ExtraCompute

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        w1, w2 = torch.randn(256, 512, generator=gen), torch.randn(512, 256, generator=gen)
        x = torch.randn(64, 256, generator=gen)

        def own() -> None:
            for _ in range(4):
                torch.relu(x @ w1) @ w2

        extra = ExtraCompute.calibrate(torch.device("cpu"), own)
        best = {1.0: math.inf, 1.5: math.inf, 2.0: math.inf, 3.0: math.inf}
        for _ in range(12):
            for factor in best:
                t0 = time.thread_time()
                own()
                extra.run(factor)
                best[factor] = min(best[factor], time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    added = {f: (best[f] - best[1.0]) / best[1.0] / (f - 1) for f in (1.5, 2.0, 3.0)}
    ok = all(0.5 < a < 2.0 for a in added.values())
    figures = (f"own step {extra.own_s * 1e3:.2f} ms, products {extra.size}x{extra.size} of "
               f"{extra.matmul_s * 1e3:.3f} ms; step x" + ", x".join(f"{best[f] / best[1.0]:.2f} at {f:g}"
                                                                     for f in (1.5, 2.0, 3.0)))
    return Result(check="gpu_slow CPU fallback (work)", result=PASS if ok else FAIL, figures=figures)


def _canary_config(run_dir: Path, *, layout: str, steps: int, faults: Any, cuda: bool) -> Any:
    from rankwatch.base.topology import Layout
    from rankwatch.canary.config import CanaryConfig
    from rankwatch.canary.model import ModelConfig

    world = 1
    for part in layout.split(","):
        world *= int(part.split("=")[1])
    cfg = CanaryConfig(run_dir=run_dir, steps=steps, layout=Layout.parse(layout, nproc=world), faults=faults,
                       pg_timeout_s=30.0, flush_interval_s=0.5, heartbeat_interval_s=0.5, gpu_interval_s=0.5,
                       fingerprint_every=0)
    if not cuda:
        return replace(cfg, backend="gloo", gpu="replay")
    # big enough that the device, not the host's kernel launches, bounds a step (a few ms of fp32 matrix work)
    return replace(cfg, backend="nccl", gpu="nvml", threads=2, global_batch=1024,
                   model=ModelConfig(d_model=2048, d_hidden=8192, blocks_per_stage=2))


def _launch(cfg: Any) -> Any:
    from rankwatch.canary.launcher import launch

    result = launch(cfg, timeout_s=150, failure_grace_s=cfg.pg_timeout_s + 5, term_grace_s=3.0)
    if not result.ok:
        raise RuntimeError(f"canary failed: exit codes {result.exit_codes}")
    return result


def check_cpu_fallback_canary(out: Path) -> Result:
    """A 1-rank gloo canary with gpu_slow: the CPU fallback is announced once, and the training thread's CPU time per
    step grows by the factor (its CPU clock, from the canary's step times: on a shared host the wall clock of a
    step, hence `compute_ns`, moves with the load; it is reported, not judged)."""
    from rankwatch.base.rundir import STEP_TIMES_DIR
    from rankwatch.base.schema import EventKind, Events, Steps, Table
    from rankwatch.canary.faults import Faults
    from rankwatch.canary.loop import GPU_SLOW_CPU_WARNING

    start, steps = 15, 40
    run_dir = out / "cpu_fallback_canary"
    faults = Faults().gpu_slow(rank=0, from_step=start, factor=GPU_SLOW_FACTOR)
    cfg = replace(_canary_config(run_dir, layout="dp=1", steps=steps, faults=faults, cuda=False), record_step_times=True)
    _launch(cfg)
    rows = _read(run_dir, str(Table.STEPS))
    warnings = [e for e in _read(run_dir, str(Table.EVENTS)) if e[Events.KIND] == str(EventKind.WARNING)
                and (e[Events.MESSAGE] or "").startswith(GPU_SLOW_CPU_WARNING)]
    cpu = json.loads((run_dir / STEP_TIMES_DIR / "rank-0.json").read_text())["thread_cpu_ns"]
    per_step = {step: cpu[i] - cpu[i - 1] for i, step in enumerate(range(steps)) if i}  # step i ends at cpu[i]
    cpu_b = _median([ns for s, ns in per_step.items() if 5 <= s < start])
    cpu_a = _median([ns for s, ns in per_step.items() if s >= start + 2])
    wall_b = _median([r[Steps.COMPUTE_NS] for r in rows if 5 <= r[Steps.STEP] < start])
    wall_a = _median([r[Steps.COMPUTE_NS] for r in rows if r[Steps.STEP] >= start + 2])
    rise = (cpu_a / cpu_b - 1) / (GPU_SLOW_FACTOR - 1)
    # The products add (factor - 1) x the calibrated own compute, while the thread's step also spends CPU on the
    # collector, gloo and the optimizer, which they do not scale: 0.35-0.7 of the full rise is measured (the same
    # bound as tests/integration/test_fault_injection.py's, > 1.2 at factor 2).
    ok = len(warnings) == 1 and 0.2 < rise < 2.0
    said = warnings[0][Events.MESSAGE] if warnings else "none"
    figures = (f"{len(warnings)} warning event(s): '{said}'; thread CPU per step {cpu_b / 1e6:.2f} -> "
               f"{cpu_a / 1e6:.2f} ms (x{cpu_a / cpu_b:.2f} at factor {GPU_SLOW_FACTOR:g}); compute_ns "
               f"{wall_b / 1e6:.2f} -> {wall_a / 1e6:.2f} ms")
    return Result(check="gpu_slow CPU fallback (canary)", result=PASS if ok else FAIL, figures=figures)


# ------------------------------------------------------------------------------------------------- CUDA


def check_nvml() -> Result:
    import torch

    from rankwatch.base.schema import Table, column_names
    from rankwatch.collector.gpu import GpuUnavailable, NvmlSampler

    try:
        sampler = NvmlSampler([0])
    except GpuUnavailable as exc:
        return Result(check="nvml sampler", result=FAIL, figures=str(exc))
    seen: dict[str, Any] = {}
    try:
        a = torch.randn(4096, 4096, device="cuda")
        for i in range(6):
            for _ in range(20):  # some load, so clocks and utilization are those of a working device
                a = (a @ a).clamp_(-1, 1)
            if i:
                torch.cuda.synchronize()
            row = dict(zip(column_names(Table.GPU), sampler.sample(0).row(rank=0, step=i)))
            for k, v in row.items():
                if v is not None and (k not in seen or seen[k] in (None, [])):
                    seen[k] = v
                seen.setdefault(k, None)
            time.sleep(0.2)
    finally:
        sampler.close()
    nulls = sorted(k for k, v in seen.items() if v is None)
    missing_core = [c for c in CORE_GPU_COLUMNS if seen.get(c) is None]
    reasons = seen.get("throttle_reasons")
    figures = (f"{len(seen) - len(nulls)}/{len(seen)} columns non-null; null: {', '.join(nulls) or 'none'}; SM "
               f"{seen.get('sm_clock_mhz')}/{seen.get('sm_clock_max_mhz')} MHz, mem {seen.get('mem_clock_mhz')} MHz; "
               f"throttle reasons {hex(reasons) if isinstance(reasons, int) else reasons}; ECC sbe/dbe volatile "
               f"{seen.get('ecc_sbe_volatile')}/{seen.get('ecc_dbe_volatile')}, aggregate "
               f"{seen.get('ecc_sbe_aggregate')}/{seen.get('ecc_dbe_aggregate')}; power {seen.get('power_w')}/"
               f"{seen.get('power_limit_w')} W, {seen.get('temperature_c')} C")
    return Result(check="nvml sampler", result=FAIL if missing_core else PASS,
                  figures=(f"core columns null: {', '.join(missing_core)}; " if missing_core else "") + figures)


def check_gpu_slow_device(out: Path) -> Result:
    from rankwatch.base.schema import EventKind, Events, Phases, Steps, Table
    from rankwatch.canary.faults import Faults
    from rankwatch.canary.loop import GPU_SLOW_CPU_WARNING

    start, steps = 25, 60
    run_dir = out / "gpu_slow_1rank"
    faults = Faults().gpu_slow(rank=0, from_step=start, factor=GPU_SLOW_FACTOR)
    _launch(_canary_config(run_dir, layout="dp=1", steps=steps, faults=faults, cuda=True))
    rows = [r for r in _read(run_dir, str(Table.STEPS)) if r[Steps.STEP] >= 5]
    phases = _read(run_dir, str(Table.PHASES))
    fallback = [e for e in _read(run_dir, str(Table.EVENTS)) if e[Events.KIND] == str(EventKind.WARNING)
                and (e[Events.MESSAGE] or "").startswith(GPU_SLOW_CPU_WARNING)]
    filled = [r for r in rows if r[Steps.DEVICE_COMPUTE_NS] is not None]
    host: dict[int, int] = {}
    for p in phases:
        if p[Phases.PHASE] in ("forward", "backward", "optimizer"):
            host[p[Phases.STEP]] = host.get(p[Phases.STEP], 0) + p[Phases.DURATION_NS]

    def med(key: str | None, lo: int, hi: int) -> float:
        picked = [r for r in filled if lo <= r[Steps.STEP] < hi]
        return _median([host.get(r[Steps.STEP], 0) if key is None else r[key] for r in picked])

    dev_b, dev_a = med(Steps.DEVICE_COMPUTE_NS, 5, start), med(Steps.DEVICE_COMPUTE_NS, start + 2, steps)
    host_b, host_a = med(None, 5, start), med(None, start + 2, steps)
    cpu_b, cpu_a = med(Steps.COMPUTE_NS, 5, start), med(Steps.COMPUTE_NS, start + 2, steps)
    rise = (dev_a - dev_b) / ((GPU_SLOW_FACTOR - 1) * dev_b) if dev_b else math.nan
    host_share = (host_a - host_b) / (dev_a - dev_b) if dev_a > dev_b else math.inf
    ok = (len(filled) >= 0.9 * len(rows) and not fallback and DEVICE_RISE[0] <= rise <= DEVICE_RISE[1]
          and host_share < HOST_SHARE_MAX)
    figures = (f"device columns on {len(filled)}/{len(rows)} steps; device_compute {dev_b / 1e6:.2f} -> "
               f"{dev_a / 1e6:.2f} ms ({rise:.2f} of the expected rise at factor {GPU_SLOW_FACTOR:g}); host phases "
               f"(enqueue) {host_b / 1e6:.2f} -> {host_a / 1e6:.2f} ms ({host_share:.0%} of the device rise); "
               f"compute_ns (host, sync included) {cpu_b / 1e6:.2f} -> {cpu_a / 1e6:.2f} ms"
               f"{'; CPU fallback announced on CUDA' if fallback else ''}")
    return Result(check="gpu_slow 1 rank (device)", result=PASS if ok else FAIL, figures=figures)


def check_gpu_slow_analyze(out: Path) -> Result:
    import torch

    name = "gpu_slow 2 ranks (analyze)"
    if torch.cuda.device_count() < 2:
        return Result(check=name, result=SKIP, figures=f"{torch.cuda.device_count()} GPU: needs 2")
    try:
        from rankwatch.analytics.analyze import analyze
        from rankwatch.analytics.incidents import IncidentClass, SubjectKind
    except ImportError as exc:
        return Result(check=name, result=SKIP, figures=f"analytics cannot be imported here ({exc}): carry its wheels")
    from rankwatch.canary.faults import Faults

    slow = 1
    run_dir = out / "gpu_slow_2ranks"
    faults = Faults().gpu_slow(rank=slow, from_step=30, factor=GPU_SLOW_FACTOR)
    _launch(_canary_config(run_dir, layout="dp=2", steps=90, faults=faults, cuda=True))
    incidents = analyze(run_dir).incidents
    stragglers = [i for i in incidents if i.klass is IncidentClass.STRAGGLER]
    named = [i for i in stragglers if i.ranks == (slow,) and i.subject.kind in (SubjectKind.RANK, SubjectKind.DEVICE)]
    figures = (f"{len(incidents)} incident(s): " + "; ".join(f"{i.klass} {i.subject} ranks {list(i.ranks)} onset "
                                                               f"{i.onset_step}" for i in incidents[:4]))
    return Result(check=name, result=PASS if named else FAIL, figures=figures or "no incident")


def _gpu_training_step(device: Any, width: int) -> Callable[[Any, int], None]:
    """One real training step of an MLP on `device`, with the collector's step and phases, reading the loss at the
    end (the sync point)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                                      torch.nn.Linear(4 * width, width)) for _ in range(2))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(512, width, device=device)

    def step(c: Any, i: int) -> None:
        with c.step(i) as rec:
            with c.phase("forward"):
                loss = model(x).square().mean()
            with c.phase("backward"):
                loss.backward()
            with c.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            rec.loss = float(loss.detach())  # the sync point: the host waits for the device here

    return step


def check_overhead(out: Path, *, device: str = "cuda:0", width: int = 2048, repeats: int = 12,
                   per_block: int = 30) -> tuple[Result, Result]:
    import torch

    from rankwatch.base.schema import Phases, Steps, Table, column_names
    from rankwatch.collector.collector import Collector, CollectorConfig
    from rankwatch.collector.gpu import open_sampler
    from rankwatch.collector.null import NullCollector
    from rankwatch.collector.sink import MemorySink

    step = _gpu_training_step(torch.device(device), width)
    sink = MemorySink()
    on = Collector(CollectorConfig(run_dir=out / "overhead", handle_sigterm=False, flush_interval_s=1.0), rank=0,
                   world_size=1, sink=sink, gpu_sampler=open_sampler("auto", host="local", indices=[0])).start()
    off = NullCollector(rank=0, world_size=1)
    counter = iter(range(10**9))
    for _ in range(10):  # warm-up: kernels chosen, allocator settled, device timer decided
        step(on, next(counter))

    def block(c: Any) -> float:
        times = []
        for _ in range(per_block):
            t0 = time.perf_counter()
            step(c, next(counter))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    overheads: list[float] = []
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(repeats):
        order = (("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on))
        got = {arm: block(c) for arm, c in order}
        on.flush()  # outside the timed blocks: what a parquet sink's writer thread does in the background
        for arm in got:
            medians[arm].append(got[arm])
        overheads.append((got["on"] / got["off"] - 1) * 100)
    on.close(exit_code=0)
    mean, low, high = t_interval(overheads)
    verdict = PASS if high <= OVERHEAD_TARGET_PCT else FAIL if low > OVERHEAD_TARGET_PCT else INCONCLUSIVE
    overhead = Result(check="collector overhead (GPU step)", result=verdict,
                      figures=f"{mean:+.2f} % (95 % interval [{low:+.2f}, {high:+.2f}] %, {repeats} alternating "
                              f"repeats of {per_block} steps; step {_median(medians['off']) * 1e3:.2f} ms OFF, "
                              f"{_median(medians['on']) * 1e3:.2f} ms ON); target <= {OVERHEAD_TARGET_PCT:g} %")
    steps: list[dict[str, Any]] = [dict(zip(column_names(Table.STEPS), r)) for r in sink.rows(Table.STEPS)]
    phases: list[dict[str, Any]] = [dict(zip(column_names(Table.PHASES), r)) for r in sink.rows(Table.PHASES)]
    dev = [s for s in steps if s[Steps.DEVICE_NS] is not None]
    dev_phases = [p for p in phases if p[Phases.DEVICE_DURATION_NS] is not None]
    ratio = _median([s[Steps.DEVICE_NS] / s[Steps.DURATION_NS] for s in dev])
    ok = bool(steps) and len(dev) >= 0.9 * len(steps) and len(dev_phases) >= 0.9 * len(phases) and 0.5 < ratio < 1.1
    timing = Result(check="CUDA device timer (in-process)", result=PASS if ok else FAIL,
                    figures=f"device columns on {len(dev)}/{len(steps)} steps, {len(dev_phases)}/{len(phases)} "
                            f"phases; device_ns / duration_ns median {ratio:.2f} (a device-bound step: near 1); "
                            f"device marks dropped {getattr(on, 'device_dropped', '?')}")
    return overhead, timing


# ------------------------------------------------------------------------------------------------ report


def render(results: list[Result]) -> str:
    lines = ["| check | result | figures |", "|---|---|---|"]
    lines += [f"| {r.check} | {r.result} | {r.figures.replace('|', '/')} |" for r in results]
    return "\n".join(lines)


def run_checks(out: Path) -> Iterator[Result]:
    import torch

    cuda = torch.cuda.is_available()
    yield _guard("cuda", check_cuda)
    yield _guard("replay sampler", check_replay_sampler)
    yield _guard("fake device timer -> collector", check_fake_device_timer)
    yield _guard("gpu_slow CPU fallback (work)", check_cpu_fallback_work)
    yield _guard("gpu_slow CPU fallback (canary)", lambda: check_cpu_fallback_canary(out))
    if not cuda:
        return
    yield _guard("nvml sampler", check_nvml)
    yield _guard("gpu_slow 1 rank (device)", lambda: check_gpu_slow_device(out))
    yield _guard("gpu_slow 2 ranks (analyze)", lambda: check_gpu_slow_analyze(out))
    try:
        pair: tuple[Result, ...] = check_overhead(out)
    except Exception as exc:
        pair = (_failed("collector overhead (GPU step)", exc),)
    yield from pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=None, help="where the table, its JSON and the runs go "
                        "(default: a new temporary folder)")
    args = parser.parse_args(argv)
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="rankwatch-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: list[Result] = []
    runs = out / "runs"
    shutil.rmtree(runs, ignore_errors=True)  # this script's own runs: a canary run directory must start empty
    for r in run_checks(runs):
        results.append(r)
        print(f"[{time.monotonic() - started:5.1f} s] {r.check}: {r.result}", file=sys.stderr, flush=True)
    table = render(results)
    print(table)
    failed = [r.check for r in results if r.result == FAIL]
    print(f"\n{len(results)} checks in {time.monotonic() - started:.0f} s; "
          f"{'failed: ' + ', '.join(failed) if failed else 'none failed'}")
    (out / "gpu_check.md").write_text(table + "\n")
    (out / "gpu_check.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
