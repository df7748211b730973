"""An outside SIGSTOP duty cycle on one canary rank (stopped 35 ms of every 100 ms, from another process, as an
operator's tool or a noisy neighbour would): the what-if S of that run against the measured ratio to the same run
without it, what fixing the rank saves, and what `rankwatch analyze` reports.

    .venv/bin/python benchmarks/whatif_duty_cycle.py [--pairs 10] [--steps 30]

Per pair: an untouched run, the duty-cycled run, the untouched run again (the two untouched runs' mean is the
reference: a shared machine's drift between runs cancels). The untouched runs' S (reported:
`benchmarks/whatif_canary.py` holds the clean-run target) and incidents (target: none), whether the duty run's
analysis names rank 2 (target: 10 of 10) and its incident's impact against the measured loss (the duty run's time
over the replayed steps less the reference's; target: within 30 %). Exits 1 when a pair misses a target.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import nullcontext
from pathlib import Path


def main() -> None:
    from rankwatch.analytics import analyze
    from rankwatch.analytics.whatif import whatif
    from rankwatch.base.topology import Layout
    from rankwatch.canary import CanaryConfig, launch
    from rankwatch.canary.model import ModelConfig
    from rankwatch.canary.outside import DutyCycle

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--keep", type=Path, default=None, help="keep the runs under this folder")
    args = p.parse_args()
    small = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or Path(scratch)
        misses = 0
        table = []
        for pair in range(args.pairs):
            results, found = [], []
            for name in ("clean", "duty", "again"):  # untouched before and after: a machine's drift cancels
                run_dir = Path(tmp) / f"{name}{pair}"
                cfg = CanaryConfig(run_dir=run_dir, steps=args.steps, layout=Layout.parse("dp=4", nproc=4), gpu="off",
                                   pace_s=0.05, fingerprint_every=0, checkpoint_every=0, model=small, seed=pair)
                with DutyCycle(run_dir, rank=2, stopped_s=0.035, period_s=0.100) if name == "duty" else nullcontext():
                    result = launch(cfg, timeout_s=300)
                if not result.ok:
                    raise SystemExit(f"{name} run failed: {result}")
                results.append(whatif(run_dir))
                found.append(analyze(run_dir).incidents)
            clean, duty, again = results
            reference_ns = (clean.measured_ns + again.measured_ns) / 2
            lost_ms = (duty.measured_ns - reference_ns) / 1e6
            named = [i for i in found[1] if 2 in i.ranks and str(i.klass) == "straggler"]
            impact = named[0].impact if named else None
            impact_ms = impact.lost_s * 1e3 if impact is not None and impact.lost_s is not None else None
            within = impact_ms is not None and lost_ms > 0 and abs(impact_ms - lost_ms) <= 0.3 * lost_ms
            ok = bool(named) and within and not found[0] and not found[2]
            misses += not ok
            top = duty.by_rank[0]
            row = (f"| {pair} | {duty.slowdown:.3f} | {duty.measured_ns / reference_ns:.3f} | "
                   f"{clean.slowdown:.3f}, {again.slowdown:.3f} "
                   f"| {len(found[0]) + len(found[2])} | {top.subject} {top.saved_share:.1%} | "
                   f"{'found' if named else 'MISSED'} | {lost_ms:.0f} | "
                   f"{'-' if impact_ms is None else f'{impact_ms:.0f}'} | "
                   f"{'-' if impact_ms is None or lost_ms <= 0 else f'{impact_ms / lost_ms - 1:+.0%}'} |")
            table.append(row)
            print(f"pair {pair}: fidelity {duty.fidelity:.3f}, S {duty.slowdown:.3f}, measured {duty.measured_ns / reference_ns:.3f}, clean S "
                  f"{clean.slowdown:.3f} and {again.slowdown:.3f}, clean incidents {len(found[0]) + len(found[2])}; lost {lost_ms:.0f} ms measured; rank 2 "
                  f"{'found' if named else 'MISSED'}" + (f", impact {impact_ms:.0f} ms" if impact_ms is not None else "")
                  + ("" if ok else "  <- misses a target"), flush=True)
            print("\n".join(duty.describe()[1:]), flush=True)
        print("\n| pair | S (what-if) | measured ratio | clean S | clean incidents | top rank saves | rank 2 | "
              "measured loss ms | impact ms | impact vs loss |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(table))
        print(f"\n{args.pairs - misses} of {args.pairs} pairs meet every target")
        raise SystemExit(1 if misses else 0)


if __name__ == "__main__":
    main()
