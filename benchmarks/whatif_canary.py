"""What-if against measurement on the real canary: for each layout, a run with one slow rank and the same run without
the fault, side by side, repeated. Prints the slow run's what-if S, the measured ratio of the two runs' times over
the same steps, the error, the clean run's S, and how closely each replay reproduced its run (fidelity).

    .venv/bin/python benchmarks/whatif_canary.py [--pairs 3] [--steps 16] [--delay 0.06] [--pace 0.12]
        [--layouts dp=4:2 dp=2,pp=2:3]     # layout:slow rank; the world size is the layout's
    .venv/bin/python benchmarks/whatif_canary.py --layouts dp=2:1 pp=2:1    # a core per rank on 2 cores

4 ranks on this 2-core machine share the cores: each rank's jitter then includes waiting for a core, real time
the job loses and a clean run's S counts. With 2 ranks each has a core of its own, as on a GPU host.

The canary is paced (`pace_s`, a sleep in each microbatch's compute) so its steps last like a bigger model's on a
2-core machine; the fault is `canary.faults.Slow`: a sleep of `--delay` seconds in every step of one rank.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    from rankwatch.analytics.whatif import whatif
    from rankwatch.base.topology import Layout
    from rankwatch.canary import CanaryConfig, launch
    from rankwatch.canary.faults import Faults
    from rankwatch.canary.model import ModelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--delay", type=float, default=0.06)
    p.add_argument("--pace", type=float, default=0.12)
    p.add_argument("--layouts", nargs="+", default=["dp=4:2", "dp=2,pp=2:3"],
                   help="LAYOUT:SLOW_RANK each (default: a replica of dp=4; a last-stage rank of dp=2,pp=2)")
    args = p.parse_args()
    small = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2)
    layouts = []
    for spec in args.layouts:
        text, _, rank = spec.rpartition(":")
        if not text or not rank.isdigit():
            p.error(f"--layouts {spec!r}: expected LAYOUT:SLOW_RANK, e.g. dp=2,pp=2:3")
        layouts.append((text, int(rank)))
    print(f"{'layout':<10} {'pair':>4} {'S (what-if)':>11} {'measured':>9} {'error':>7} {'clean S':>8} "
          f"{'fidelity':>15}  top saving")
    with tempfile.TemporaryDirectory() as tmp:
        for text, slow_rank in layouts:
            errors, cleans = [], []
            for pair in range(args.pairs):
                runs = []
                for name, faults in (("clean", Faults()), ("slow", Faults().slow(rank=slow_rank, delay_s=args.delay))):
                    run_dir = Path(tmp) / f"{text}-{pair}-{name}"
                    cfg = CanaryConfig(run_dir=run_dir, steps=args.steps, layout=Layout.parse(text),
                                       faults=faults, gpu="off", pace_s=args.pace, fingerprint_every=0,
                                       checkpoint_every=0, model=small, seed=pair)
                    result = launch(cfg, timeout_s=300)
                    if not result.ok:
                        raise SystemExit(f"{text} {name} run failed: {result}")
                    runs.append(whatif(run_dir))
                clean, slow = runs
                measured = slow.measured_ns / clean.measured_ns
                error = slow.slowdown / measured - 1
                errors.append(abs(error))
                cleans.append(clean.slowdown)
                top = slow.by_rank[0]
                print(f"{text:<10} {pair:>4} {slow.slowdown:>11.3f} {measured:>9.3f} {error:>+7.1%} "
                      f"{clean.slowdown:>8.3f} {clean.fidelity:>7.3f}/{slow.fidelity:<7.3f}  "
                      f"{top.subject} {top.saved_share:.1%}")
            print(f"{text:<10} worst |error| {max(errors):.1%}, median {statistics.median(errors):.1%}; "
                  f"clean S at most {max(cleans):.3f}")
            for warning in slow.warnings:  # e.g. ranks alone in their stage: no peer, no ideal of their own
                print(f"{text:<10} what-if warning: {warning}")


if __name__ == "__main__":
    main()
