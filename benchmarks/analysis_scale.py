"""Full analysis of 2,048 ranks x 1,000 steps on this machine, and of the latest 20-step window of the same run.

    .venv/bin/python benchmarks/analysis_scale.py [--ranks 2048] [--hosts 256] [--layout dp=64,tp=8,pp=4]
                                                  [--steps 1000] [--run DIR] [--keep]

Simulates the run once (with a straggler, so the detectors have something to find), then, each in a fresh child
process, reports wall time, stages and peak resident memory (VmHWM) of:

1. `rankwatch analyze` of the whole run (cold: every part file read);
2. `rankwatch analyze --window 20` (cold: every part file opened again, only the last 20 steps kept);
3. the live monitor's tick: a `LiveAnalyzer` that already holds the run up to step S-20 reads the part files
   that the last 20 steps add (the run's parts split with `simulator.split_tail`) and analyzes the latest
   20-step window.

Targets (issue 3): full <= 60 s and <= 8 GB peak; window <= 2 s.
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

from rankwatch.simulator import SimConfig, parse_sim_fault, simulate, split_tail
from rankwatch.trainer.parallel import Layout

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
import json, shutil, sys, time
from pathlib import Path
from rankwatch.analytics.live import LiveAnalyzer, LiveConfig
run, staging = Path(sys.argv[1]), Path(sys.argv[2])
live = LiveAnalyzer(run, LiveConfig(window_steps=20, keep_steps=1000))
t0 = time.perf_counter(); first = live.refresh(); cold = time.perf_counter() - t0
moved = []
for f in staging.rglob("*.parquet"):
    target = run / f.relative_to(staging)
    shutil.move(f, target)
    moved.append((target, f))
t0 = time.perf_counter()
new = live.refresh()
t_refresh = time.perf_counter() - t0
a = live.analyze()
wall = time.perf_counter() - t0
for target, f in moved:  # back to staging, so the benchmark can run again
    shutil.move(target, f)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"wall_s": wall, "import_s": 0.0, "peak_bytes": peak, "incidents": len(a.incidents),
                  "classes": sorted({str(i.klass) for i in a.incidents}),
                  "stages": [("refresh", t_refresh), *a.seconds], "cold_refresh_s": cold, "parts": [first, new],
                  "window": [a.first_step, a.last_step]}))
"""


def _analyze_child(run: Path, window: str) -> dict[str, object]:
    return _child(_CHILD, str(run), window)


def _child(script: str, *args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2048)
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--layout", default="dp=64,tp=8,pp=4")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--run", type=Path, default=None, help="simulate into (or reuse) this folder")
    ap.add_argument("--keep", action="store_true", help="keep the simulated run")
    args = ap.parse_args()
    run = args.run or Path(tempfile.mkdtemp(prefix="rankwatch-scale-")) / "run"
    if not (run / "labels.json").exists():
        cfg = SimConfig(name="scale", layout=Layout.parse(args.layout, nproc=args.ranks), hosts=args.hosts,
                        steps=args.steps, seed=7, checkpoint_every=250,
                        faults=(parse_sim_fault(f"straggler:rank={args.ranks // 3},from={args.steps // 2},slow=0.1"),))
        t0 = time.perf_counter()
        simulate(cfg, run)
        print(f"simulated {args.ranks} ranks x {args.steps} steps in {time.perf_counter() - t0:.1f}s -> {run}")
    size = sum(f.stat().st_size for f in run.rglob("*.parquet"))
    files = sum(1 for _ in run.rglob("*.parquet"))
    print(f"telemetry: {files} part files, {size / 2**20:.0f} MiB")
    full = _analyze_child(run, "all")
    window = _analyze_child(run, "20")
    staging = run.parent / "staging"
    if not staging.exists():
        t0 = time.perf_counter()
        tails = split_tail(run, args.steps - 20, staging)
        print(f"split the last 20 steps into {tails} new part files in {time.perf_counter() - t0:.0f}s")
    live = _child(_LIVE, str(run), str(staging))
    print(f"live monitor: cold refresh {float(live['cold_refresh_s']):.1f}s over {live['parts'][0]} parts; "  # type: ignore[arg-type, index]
          f"the tick reads {live['parts'][1]} new parts, window steps {live['window']}")  # type: ignore[index]
    ok = True
    for name, r, target in (("full run", full, TARGET_FULL_S), ("cold window", window, TARGET_WINDOW_S),
                            ("live window tick", live, TARGET_WINDOW_S)):
        wall, peak = float(r["wall_s"]), int(r["peak_bytes"])  # type: ignore[arg-type, call-overload]
        stages = ", ".join(f"{s} {t:.1f}s" for s, t in r["stages"])  # type: ignore[attr-defined]
        print(f"{name:>16}: {wall:6.1f}s (target <= {target:.0f}s), peak RSS {peak / 2**30:.2f} GiB "
              f"(target <= {TARGET_PEAK_GB:.0f}), {r['incidents']} incident(s) {r['classes']}; import {float(r['import_s']):.1f}s")  # type: ignore[arg-type]
        print(f"{'':>16}  stages: {stages}")
        if name != "cold window":  # the window target is the live monitor's; the cold figure is reported beside it
            ok &= wall <= target and peak <= TARGET_PEAK_GB * 2**30
    print("verdict:", "PASS" if ok else "FAIL")
    if args.run is None and not args.keep:
        shutil.rmtree(run.parent, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
