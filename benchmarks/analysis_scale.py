"""Full analysis of 2,048 ranks x 1,000 steps on this machine, and of the latest 20-step window of the same run.

    .venv/bin/python benchmarks/analysis_scale.py [--ranks 2048] [--hosts 256] [--layout dp=64,tp=8,pp=4]
                                                  [--steps 1000] [--run DIR] [--keep]

Simulates the run once (with a straggler, so the detectors have something to find), then, each in a fresh child
process, reports wall time, stages and peak resident memory (VmHWM) of:

1. `rankwatch analyze` of the whole run (cold: every part file read);
2. `rankwatch analyze --window 20` (cold: every part file opened again, only the last 20 steps kept);
3. the live monitor's tick over the rank layout: a `LiveAnalyzer` that already holds the run up to step S-20 reads
   the part files that the last 20 steps add (the run's parts split with `simulator.split_tail`, one new part per
   rank and table) and analyzes the latest 20-step window (it analyzed the run once before, as the monitor's
   previous tick did: what a tick caches, such as the process groups, is warm);
4. the same tick with host rollups (`collector.rollup`), as a run with one rollup agent per host produces it: the
   run up to step S-20 rolled up per host (timed: what the agents did during the run), the monitor's cold refresh
   over it, then the tail's rank parts arrive and each host's agent rolls its ranks' new parts up (timed per host:
   the agent's cost per round), and the monitor's tick reads one host part per table and host. With the
   `LiveConfig` default, a host whose agent published within the last minute has no rank folder listed (its newest
   rows come with its agent's next round); the tick reading host rollups only (`rank_parts=False`) is shown beside.

Targets (issue 3): full <= 60 s and <= 8 GB peak; the live window tick (with host rollups) <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rankwatch.base.rundir import TELEMETRY_DIR
from rankwatch.base.topology import Layout
from rankwatch.collector.rollup import ROLLUP_DIR, rollup_all
from rankwatch.simulator import SimConfig, parse_sim_fault, simulate, split_tail

TARGET_FULL_S = 60.0
TARGET_PEAK_GB = 8.0
TARGET_WINDOW_S = 2.0

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from rankwatch.analytics.analyze import AnalysisConfig, analyze
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
a = analyze(sys.argv[1], config=AnalysisConfig(window_steps=int(sys.argv[2]) if sys.argv[2] != "all" else None))
wall = time.perf_counter() - t0
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of a big parent would report the parent's.
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"wall_s": wall, "import_s": t_import, "peak_bytes": peak, "incidents": len(a.incidents),
                  "classes": sorted({str(i.klass) for i in a.incidents}), "stages": a.seconds}))
"""


_LIVE = """
import json, os, shutil, statistics, sys, time
from pathlib import Path
from rankwatch.analytics.live import LiveAnalyzer, LiveConfig
from rankwatch.collector.rollup import host_ranks, rollup
run, staging, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rolled = mode != "rank-layout"  # else "rank-parts" (the LiveConfig default) or "hosts-only", each with host rollups
live = LiveAnalyzer(run, LiveConfig(window_steps=20, keep_steps=1000, rank_parts=mode != "hosts-only"))
t0 = time.perf_counter(); first = live.refresh(); cold = time.perf_counter() - t0
live.analyze()  # the monitor's previous tick: it analyzes after every refresh
manifests = {m: m.read_bytes() for m in run.glob("telemetry/*/_rollup/*/_manifest.json")}
moved = []
for f in staging.rglob("*.parquet"):
    target = run / f.relative_to(staging)
    shutil.move(f, target)
    moved.append((target, f))
try:
    per_host, tail_parts, host_parts = [], 0, 0
    for host, ranks in (host_ranks(run).items() if rolled else ()):  # each host's agent, one after the other here
        r = rollup(run, host, ranks=ranks, delete=False)
        per_host.append(r.seconds)
        tail_parts += r.rank_parts
        host_parts += r.host_parts
    t0, c0 = time.perf_counter(), time.process_time()
    new = live.refresh()
    t_refresh = time.perf_counter() - t0
    a = live.analyze()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
finally:
    # back to staging, so the benchmark can run again, and the manifests as they were (the tail's host parts
    # are orphans then)
    for target, f in moved:
        shutil.move(target, f)
    for m, text in manifests.items():
        m.write_bytes(text)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
out = {"wall_s": wall, "import_s": 0.0, "peak_bytes": peak, "incidents": len(a.incidents),
       "classes": sorted({str(i.klass) for i in a.incidents}),
       "stages": [("refresh", t_refresh), *a.seconds], "cold_refresh_s": cold, "parts": [first, new],
       "window": [a.first_step, a.last_step], "cpu_s": cpu, "load": os.getloadavg()[0]}
if rolled:
    q = statistics.quantiles(per_host, n=10)
    out.update({"hosts": len(per_host), "host_rollup_s": [statistics.median(per_host), q[-1], max(per_host)],
                "tail_rank_parts": tail_parts, "tail_host_parts": host_parts})
print(json.dumps(out))
"""


def _analyze_child(run: Path, window: str) -> dict[str, object]:
    return _child(_CHILD, str(run), window)


def _child(script: str, *args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _with_host_rollups(run: Path, staging: Path) -> tuple[dict[str, object], dict[str, object]]:
    """The live tick with one rollup agent per host (item 4 of the module docstring), reading the rank parts no
    rollup covers too (the default), and reading host rollups only. The run's rank parts are left in place (no
    deletes) and its rollups removed afterwards, so the run is reusable as it was."""
    t0 = time.perf_counter()
    results = rollup_all(run, delete=False)
    base_s = time.perf_counter() - t0
    try:
        print(f"host rollups of steps 0..S-21: {sum(r.rank_parts for r in results.values())} rank parts -> "
              f"{sum(r.host_parts for r in results.values())} host parts on {len(results)} hosts in {base_s:.0f}s "
              f"(one after the other; {base_s / len(results):.2f}s per host)")
        ticks = (_child(_LIVE, str(run), str(staging), "rank-parts"),
                 _child(_LIVE, str(run), str(staging), "hosts-only"))
    finally:
        for folder in (run / TELEMETRY_DIR).glob(f"*/{ROLLUP_DIR}"):
            shutil.rmtree(folder)
    for how, rolled in zip(("default: rank folders of hosts without a running agent", "host rollups only"), ticks):
        med, p90, worst = (float(x) for x in rolled["host_rollup_s"])  # type: ignore[attr-defined]
        hosts = int(rolled["hosts"])  # type: ignore[call-overload]
        print(f"live monitor, host rollups ({how}): cold refresh {float(rolled['cold_refresh_s']):.1f}s over "  # type: ignore[arg-type]
              f"{rolled['parts'][0]} host parts; each host's agent rolls up its "  # type: ignore[index]
              f"{int(rolled['tail_rank_parts']) // hosts} new rank parts in "  # type: ignore[call-overload]
              f"{med:.2f}s median, {p90:.2f}s p90, {worst:.2f}s max; {rolled['tail_rank_parts']} tail rank parts -> "
              f"{rolled['tail_host_parts']} host parts (+ as many manifests replaced); the tick reads "
              f"{rolled['parts'][1]} new parts, window steps {rolled['window']}")  # type: ignore[index]
    return ticks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2048)
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--layout", default="dp=64,tp=8,pp=4")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--run", type=Path, default=None, help="simulate into (or reuse) this folder")
    ap.add_argument("--keep", action="store_true", help="keep the simulated run")
    ap.add_argument("--live-only", action="store_true", help="skip the cold analyses (full run, cold window)")
    args = ap.parse_args()
    run = args.run or Path(tempfile.mkdtemp(prefix="rankwatch-scale-")) / "run"
    if not (run / "labels.json").exists():
        cfg = SimConfig(name="scale", layout=Layout.parse(args.layout, nproc=args.ranks), hosts=args.hosts,
                        steps=args.steps, seed=7, checkpoint_every=250,
                        faults=(parse_sim_fault(f"gpu_slow:rank={args.ranks // 3},from={args.steps // 2},factor=1.1"),))
        t0 = time.perf_counter()
        simulate(cfg, run)
        print(f"simulated {args.ranks} ranks x {args.steps} steps in {time.perf_counter() - t0:.1f}s -> {run}")
    size = sum(f.stat().st_size for f in run.rglob("*.parquet"))
    files = sum(1 for _ in run.rglob("*.parquet"))
    print(f"telemetry: {files} part files, {size / 2**20:.0f} MiB")
    full = None if args.live_only else _analyze_child(run, "all")
    window = None if args.live_only else _analyze_child(run, "20")
    staging = run.parent / "staging"
    if not staging.exists():
        t0 = time.perf_counter()
        tails = split_tail(run, args.steps - 20, staging)
        print(f"split the last 20 steps into {tails} new part files in {time.perf_counter() - t0:.0f}s")
    live = _child(_LIVE, str(run), str(staging), "rank-layout")
    print(f"live monitor, rank layout: cold refresh {float(live['cold_refresh_s']):.1f}s over {live['parts'][0]} parts; "  # type: ignore[arg-type, index]
          f"the tick reads {live['parts'][1]} new parts, window steps {live['window']}")  # type: ignore[index]
    rolled, hosts_only = _with_host_rollups(run, staging)
    ok = True
    for name, r, target in (("full run", full, TARGET_FULL_S), ("cold window", window, TARGET_WINDOW_S),
                            ("tick, rank parts", live, TARGET_WINDOW_S),
                            ("live window tick", rolled, TARGET_WINDOW_S),
                            ("tick, hosts only", hosts_only, TARGET_WINDOW_S)):
        if r is None:
            continue
        wall, peak = float(r["wall_s"]), int(r["peak_bytes"])  # type: ignore[arg-type, call-overload]
        stages = ", ".join(f"{s} {t:.2f}s" for s, t in r["stages"])  # type: ignore[attr-defined]
        print(f"{name:>16}: {wall:6.2f}s (target <= {target:.0f}s), peak RSS {peak / 2**30:.2f} GiB "
              f"(target <= {TARGET_PEAK_GB:.0f}), {r['incidents']} incident(s) {r['classes']}; import {float(r['import_s']):.1f}s")  # type: ignore[arg-type]
        print(f"{'':>16}  stages: {stages}")
        if "cpu_s" in r:  # a shared machine's wall time depends on its load; the CPU time less so
            print(f"{'':>16}  process CPU {float(r['cpu_s']):.2f}s (2 cores), 1-min load average "  # type: ignore[arg-type]
                  f"{float(r['load']):.1f}")  # type: ignore[arg-type]
        # the window target is the live monitor's with host rollups (rank folders listed too, the default); the
        # cold window, the tick over rank parts and the tick reading host rollups only are reported beside it
        if name in ("full run", "live window tick"):
            ok &= wall <= target and peak <= TARGET_PEAK_GB * 2**30
    print("verdict:", "PASS" if ok else "FAIL")
    if args.run is None and not args.keep:
        shutil.rmtree(run.parent, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
