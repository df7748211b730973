"""Checkpoint interval and goodput: a simulated 30-day job at 16,384 and 2,048 GPUs under the Llama 3 interruption
rate, with save and restore costs scaled from the canary's measured ones; goodput at fixed intervals against the
advised one (`analytics.interval.advised_interval`), synchronous against asynchronous saves.

    .venv/bin/python benchmarks/goodput.py [--seeds 100] [--days 30] [--shape 1.0] [--save-s 0.0895] ...
    .venv/bin/python benchmarks/goodput.py --from-run RUN [RUN ...]     # the costs measured in real canary runs

Interruptions: Meta, "The Llama 3 Herd of Models" (2024), section 3.3.4: 419 unexpected interruptions in a 54-day
snapshot of pre-training on 16,384 H100 GPUs. Assumed here: a Poisson process at that rate (job MTBF 3.09 h), each
GPU failing independently, so the rate scales with the GPU count (24.7 h at 2,048); the 47 planned interruptions of
the same snapshot are left out (a planned stop can save first and loses no work). `--shape` below 1 draws the times
between interruptions from a Weibull of the same mean instead (burstier).

Costs: the canary's (4 CPU ranks, dp=2,tp=2; docs/benchmarks.md, "Checkpoint save and load" and "Fault drills"),
scaled by k = the per-GPU checkpoint shard at scale / the canary's per-rank shard, i.e. at the canary's measured
per-rank bandwidth. The shard at scale: a 405B-parameter model at 14 bytes a parameter (bf16 weights, fp32 master
weights, two fp32 Adam moments: our assumption of a common mixed-precision layout) over 16,384 GPUs, 346 MB; the
canary's, 3.30 MB. Sync save, async pause and async write scale by k; of the restore (the canary's time to training
again after a kill), only the verified load scales, the rest (detect, decide, relaunch, gate) is kept as measured.
The defaults are the figures of docs/benchmarks.md; `--from-run` takes them from real runs instead
(`analytics.costs.measured_costs`: mean blocking time of synchronous saves, pause and background write of
asynchronous ones, time from a failure to training again, checkpoint load and verify), a flag given beside it wins,
and the command prints which figure came from where (a figure the runs did not measure keeps its default).
The same per-GPU costs are used at 2,048 GPUs (the shard per GPU held equal). Training is assumed not to slow
while an asynchronous write runs beside it.

Every interval sees the same interruption times for a seed (common random numbers), so differences are paired. The
exit status is 1 where the advised interval's mean goodput is below a fixed interval's by more than the standard
error of the paired differences over the seeds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from pathlib import Path

from rankwatch.analytics.costs import Figure, MeasuredCosts, measured_costs
from rankwatch.analytics.interval import (
    LLAMA3_DEVICE_MTBF_S, InterruptionModel, IntervalCosts, advised_interval, expected_figures, job_mtbf_s,
    simulate_goodput, young_daly_interval, young_interval,
)

FIXED_MIN = (10, 30, 60, 120)
RANKS = (16_384, 2_048)
AROUND = (0.5, 0.8, 1.25, 2.0)
DEFAULTS = {
    "save_s": (0.0895, "canary sync save: the sum of its phases' medians (snapshot .. publish)"),
    "async_pause_s": (0.0057, "canary async pause: snapshot + serialize"),
    "async_write_s": (0.0838, "canary async write: write + fsync + publish"),
    "restore_s": (15.3, "canary kill drill: interruption to training again"),
    "load_s": (0.634, "canary verified load, the part of restore that scales"),
}
"""Each cost flag's default (docs/benchmarks.md, "Checkpoint save and load" and "Fault drills") and its help."""


def _measured(costs: MeasuredCosts) -> dict[str, Figure]:
    """The figure of `costs` each cost flag stands for."""
    return {"save_s": costs.sync_save, "async_pause_s": costs.async_pause, "async_write_s": costs.async_write,
            "restore_s": costs.restore, "load_s": costs.load}


def _resolve(args: argparse.Namespace) -> list[str]:
    """Set each cost flag not given on the command line: the runs' measured figure (`--from-run`), else its default.
    Returns a line per flag saying where its value came from."""
    costs = measured_costs(args.from_run) if args.from_run else None
    figures = _measured(costs) if costs is not None else {}
    lines = []
    for name, (default, _) in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        fig = figures.get(name)
        if getattr(args, name) is not None:
            lines.append(f"{flag} {getattr(args, name):g}: given")
        elif fig is not None and fig.seconds is not None:
            setattr(args, name, fig.seconds)
            lines.append(f"{flag} {fig.seconds:.4g}: measured in {len(args.from_run)} run(s), n={fig.count}")
        else:
            setattr(args, name, default)
            lines.append(f"{flag} {default:g}: default" + (f" (not measured: {fig.why})" if fig is not None else ""))
    if costs is not None:
        lines.append(f"--canary-mb {args.canary_mb:g}: not measured from the runs (give it for another model)")
        lines += [f"warning: {w}" for w in costs.warnings]
    return lines


def _rows(costs: IntervalCosts) -> list[tuple[str, float]]:
    rows = [(f"{m} min", m * 60.0) for m in FIXED_MIN]
    rows.append(("Young/Daly", young_daly_interval(costs.save_s, costs.mtbf_s)))
    rows.append(("advised", advised_interval(costs)))
    return rows


def _goodputs(costs: IntervalCosts, interval_s: float, *, horizon_s: float, seeds: int,
              failures: InterruptionModel) -> list[float]:
    return [simulate_goodput(costs, interval_s, horizon_s=horizon_s, seed=s, failures=failures).goodput
            for s in range(seeds)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--shape", type=float, default=1.0, help="Weibull shape of the times between interruptions")
    for name, (default, text) in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                       help=f"{text} (default: measured with --from-run, else {default:g})")
    p.add_argument("--from-run", type=Path, nargs="+", default=None, metavar="RUN",
                   help="canary run directories whose measured save, restore and load costs replace the defaults")
    p.add_argument("--canary-mb", type=float, default=3.30, help="canary checkpoint shard per rank")
    p.add_argument("--shard-mb", type=float, default=405e9 * 14 / 16_384 / 1e6,
                   help="checkpoint shard per GPU at scale")
    args = p.parse_args()
    try:
        sources = _resolve(args)
    except ValueError as exc:  # a run that is not one, or holds no step: one line naming it
        raise SystemExit(f"--from-run: {exc}") from None
    if args.load_s > args.restore_s:
        raise SystemExit(f"--load-s {args.load_s:g} is longer than --restore-s {args.restore_s:g}")
    k = args.shard_mb / args.canary_mb
    sync_s, pause_s, write_s = args.save_s * k, args.async_pause_s * k, args.async_write_s * k
    restore_s = args.restore_s - args.load_s + args.load_s * k
    horizon_s = args.days * 86_400.0
    failures = InterruptionModel(shape=args.shape)
    print(f"interruptions: 419 in 54 days at 16,384 GPUs (Llama 3, 2024), per-GPU MTBF "
          f"{LLAMA3_DEVICE_MTBF_S / 86_400 / 365:.2f} years; "
          f"{'Poisson' if args.shape == 1 else f'Weibull shape {args.shape:g} renewal'}; planned stops left out")
    print("costs:\n" + "\n".join(f"  {line}" for line in sources))
    print(f"scale: shard {args.shard_mb:.1f} MB per GPU / canary {args.canary_mb:.2f} MB per rank = k {k:.1f}")
    print(f"costs at scale: sync save {args.save_s * 1e3:.1f} ms x k = {sync_s:.2f} s; async pause "
          f"{args.async_pause_s * 1e3:.1f} ms x k = {pause_s:.2f} s, write {args.async_write_s * 1e3:.1f} ms x k = "
          f"{write_s:.2f} s; restore {args.restore_s - args.load_s:.2f} s + {args.load_s:.3f} s x k = "
          f"{restore_s:.1f} s")
    print(f"job: {args.days:g} days, {args.seeds} seeds (mean +- sd over seeds; model = expected_figures)")
    started = time.perf_counter()
    failed: list[str] = []
    for ranks in RANKS:
        mtbf_s = job_mtbf_s(LLAMA3_DEVICE_MTBF_S, ranks)
        modes = {"sync": IntervalCosts(save_s=sync_s, restore_s=restore_s, mtbf_s=mtbf_s),
                 "async": IntervalCosts(save_s=pause_s, restore_s=restore_s, mtbf_s=mtbf_s, async_write_s=write_s)}
        print(f"\n{ranks:,} GPUs, job MTBF {mtbf_s / 3600:.2f} h; Young sqrt(2CM): sync "
              f"{young_interval(sync_s, mtbf_s) / 60:.2f} min, async {young_interval(pause_s, mtbf_s) / 60:.2f} min")
        print("| interval | sync min | sync simulated | sync model | async min | async simulated | async model |")
        print("|---|---|---|---|---|---|---|")
        cells: dict[str, list[str]] = {}
        checks: list[str] = []
        around: list[str] = []
        for mode, costs in modes.items():
            rows = _rows(costs)
            runs = [_goodputs(costs, s, horizon_s=horizon_s, seeds=args.seeds, failures=failures) for _, s in rows]
            advised = runs[-1]
            for (label, interval_s), goodputs in zip(rows, runs):
                model = expected_figures(costs, interval_s).goodput
                cells.setdefault(label, []).append(
                    f"{interval_s / 60:.2f} | {statistics.mean(goodputs):.2%} ± {statistics.stdev(goodputs):.2%} | "
                    f"{model:.2%}")
                if label.endswith(" min"):
                    diffs = [a - b for a, b in zip(advised, goodputs)]
                    margin, se = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
                    if margin < -se:
                        failed.append(f"{ranks:,} GPUs {mode}: advised {margin * 100:+.3f} pp below {label} "
                                      f"(SE {se * 100:.3f})")
                    checks.append(f"{mode} - {label} {margin * 100:+.3f} (SE {se * 100:.3f})")
            near = [(f, statistics.mean(_goodputs(costs, rows[-1][1] * f, horizon_s=horizon_s, seeds=args.seeds,
                                                  failures=failures)) - statistics.mean(advised)) for f in AROUND]
            around.append(f"{mode} (advised {rows[-1][1]:.1f} s, Daly {rows[-2][1]:.1f} s): "
                          + ", ".join(f"x{f:g} {d * 100:+.3f}" for f, d in near))
        for label, parts in cells.items():
            print(f"| {label} | " + " | ".join(parts) + " |")
        print("advised minus fixed, pp, paired: " + "; ".join(checks))
        print("at multiples of the advised interval, minus the advised one, pp: " + "; ".join(around))
    print(f"\n{time.perf_counter() - started:.1f} s")
    if failed:
        print("FAIL: " + "; ".join(failed))
        return 1
    print("advised >= every fixed interval (within the paired SE), sync and async, at both scales: met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
