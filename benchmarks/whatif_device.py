"""The what-if on a CUDA job's device clocks, against measurement: simulated GPU-timed runs (`rankwatch simulate
--timing gpu`: what a CUDA job's collector writes, the host's times only enqueueing) with one fault, each beside the
same run without it (same seed, same noise), over the same steps. Prints the what-if S of the faulty run, the
measured ratio of the two runs' device time (the slowest rank's summed `steps.device_ns`), the error, the clean
run's S, the faulty run's fidelity, and what `analyze` says with its impact against the measured loss.

    .venv/bin/python benchmarks/whatif_device.py [--seeds 2] [--steps 60] [--quick]

Faults: a slow device (its kernels 10 % and 30 % longer), a host stall (the training thread sleeps in its forward
pass, so its device idles: 20 %), a bursty slow device (30 % for 3 steps of every 10), on three layouts. A what-if
that read the CPU clock here would see none of them: the thread waits at one sync point a step for the slowest
device, the same on every rank (`tests/unit/test_timing_modes.py`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

FIRST = 5
"""Steps compared: FIRST .. steps-1 (the what-if's default window leaves step 0 out; the fault starts at step 1)."""


def _measured(run: Path, first: int, last: int) -> float:
    from rankwatch.analytics.store import connect

    row = connect(run).execute(f"SELECT max(s) FROM (SELECT rank, sum(device_ns) s FROM steps WHERE step BETWEEN "
                               f"{first} AND {last} GROUP BY rank)").fetchone()
    assert row is not None and row[0] is not None, f"{run}: no device step time"
    return float(row[0])


def main() -> None:
    from rankwatch.analytics.analyze import analyze
    from rankwatch.analytics.whatif import whatif
    from rankwatch.base.topology import Layout
    from rankwatch.simulator import SimConfig, simulate
    from rankwatch.simulator.config import Timing
    from rankwatch.simulator.faults import Straggler, StragglerCause

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="one layout, one fault, one seed")
    args = p.parse_args()
    layouts = [(Layout(dp=8, tp=2, pp=2), 4, 13), (Layout(dp=16), 2, 5), (Layout(dp=4, tp=4, pp=4), 8, 42)]
    faults: list[tuple[str, Any]] = [
        ("slow device 10 %", lambda r: Straggler(rank=r, from_step=1, slow=0.1)),
        ("slow device 30 %", lambda r: Straggler(rank=r, from_step=1, slow=0.3)),
        ("host stall 20 %", lambda r: Straggler(rank=r, from_step=1, slow=0.2, cause=StragglerCause.HOST_STALL)),
        ("bursty 30 %, 3 of 10", lambda r: Straggler(rank=r, from_step=1, slow=0.3, period=10, burst=3)),
    ]
    seeds = range(1, args.seeds + 1)
    if args.quick:
        layouts, faults, seeds = layouts[:1], faults[:1], range(1, 2)
    last = args.steps - 1
    print(f"{'layout':<14} {'fault':<22} {'seed':>4} {'S (what-if)':>11} {'measured':>9} {'error':>7} {'clean S':>8} "
          f"{'fidelity':>8}  analyze: the faulty rank's incident, impact share vs measured loss")
    errors: list[float] = []
    impact_errors: list[float] = []
    cleans: list[float] = []
    wrong: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for layout, hosts, rank in layouts:
            for seed in seeds:
                def cfg(*f: Any) -> SimConfig:
                    return SimConfig(layout=layout, hosts=hosts, steps=args.steps, seed=seed, checkpoint_every=0,
                                     faults=f, timing=Timing.GPU)

                clean_dir = Path(tmp) / f"{layout}-{seed}-clean"
                simulate(cfg(), clean_dir)
                clean = whatif(clean_dir, steps=(FIRST, last))
                cleans.append(clean.slowdown)
                clean_found = [str(i.subject) for i in analyze(clean_dir).incidents]
                if clean_found:
                    wrong.append(f"{layout} seed {seed} clean: {clean_found}")
                base = _measured(clean_dir, FIRST, last)
                for name, make in faults:
                    run = Path(tmp) / f"{layout}-{seed}-{name.replace(' ', '_')}"
                    simulate(cfg(make(rank)), run)
                    w = whatif(run, steps=(FIRST, last))
                    ratio = _measured(run, FIRST, last) / base
                    err = w.slowdown / ratio - 1
                    errors.append(err)
                    loss = 1 - base / _measured(run, FIRST, last)
                    found = analyze(run).incidents
                    mine = [i for i in found if rank in i.ranks]
                    others = [str(i.subject) for i in found if rank not in i.ranks]
                    said = "none"
                    if mine and mine[0].impact is not None and mine[0].impact.share is not None:
                        share = mine[0].impact.share
                        said = f"{mine[0].klass} {mine[0].subject} {share:.1%} vs {loss:.1%}"
                        if loss >= 0.01:  # a relative error of a loss under 1 % is noise over noise
                            impact_errors.append(share / loss - 1)
                            said += f" ({share / loss - 1:+.0%})"
                    elif mine:
                        said = f"{mine[0].klass} {mine[0].subject} (impact {mine[0].impact})"
                    if not mine or others:
                        wrong.append(f"{layout} seed {seed} {name}: rank {rank} {'found' if mine else 'missed'}, "
                                     f"others {others}")
                    print(f"{str(layout):<14} {name:<22} {seed:>4} {w.slowdown:>11.3f} {ratio:>9.3f} {err:>+7.1%} "
                          f"{clean.slowdown:>8.3f} {w.fidelity:>8.3f}  {said}", flush=True)
    print(f"\nS against the measured ratio: {len(errors)} runs, error median {statistics.median(errors):+.1%}, "
          f"largest {max(errors, key=abs):+.1%} (target: within 10 %)")
    if impact_errors:
        print(f"impact share against the measured loss (losses of 1 % or more: {len(impact_errors)} runs): median "
              f"{statistics.median(impact_errors):+.0%}, largest {max(impact_errors, key=abs):+.0%} (target: within "
              "30 %)")
    print(f"clean runs' S: {min(cleans):.3f}..{max(cleans):.3f} (target: below 1.03)")
    print(f"wrong or missed: {len(wrong)}" + "".join(f"\n  {x}" for x in wrong))
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
