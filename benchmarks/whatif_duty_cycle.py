"""An outside SIGSTOP duty cycle on one canary rank (stopped 35 ms of every 100 ms, from another process, as an
operator's tool or a noisy neighbour would): the what-if S of that run against the measured ratio to the same run
without it, and what fixing the rank's own work saves.

    .venv/bin/python benchmarks/whatif_duty_cycle.py [--pairs 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path


def _pid_of(run_dir: Path, rank: int) -> int | None:
    """The rank's pid from its topology row, once written (the canary flushes it before training)."""
    import duckdb

    for _ in range(600):
        try:
            rows = duckdb.execute(f"SELECT pid FROM read_parquet('{run_dir}/telemetry/topology/rank={rank}/*.parquet')"
                                  ).fetchall()
            if rows:
                return int(rows[0][0])
        except duckdb.Error:
            pass
        time.sleep(0.05)
    return None


def _duty(run_dir: Path, rank: int, stop: threading.Event, stopped_s: float, period_s: float) -> None:
    pid = _pid_of(run_dir, rank)
    while pid is not None and not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(period_s - stopped_s)
        except ProcessLookupError:
            return


def main() -> None:
    from rankwatch.analytics.whatif import whatif
    from rankwatch.base.topology import Layout
    from rankwatch.canary import CanaryConfig, launch
    from rankwatch.canary.model import ModelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    small = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2)
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            results = []
            for name in ("clean", "duty"):
                run_dir = Path(tmp) / f"{name}{pair}"
                cfg = CanaryConfig(run_dir=run_dir, steps=args.steps, layout=Layout.parse("dp=4", nproc=4), gpu="off",
                                   pace_s=0.05, fingerprint_every=0, checkpoint_every=0, model=small, seed=pair)
                stop = threading.Event()
                if name == "duty":
                    threading.Thread(target=_duty, args=(run_dir, 2, stop, 0.035, 0.100), daemon=True).start()
                result = launch(cfg, timeout_s=300)
                stop.set()
                if not result.ok:
                    raise SystemExit(f"{name} run failed: {result}")
                results.append(whatif(run_dir))
            clean, duty = results
            top = duty.by_rank[0]
            print(f"pair {pair}: S {duty.slowdown:.3f}, measured {duty.measured_ns / clean.measured_ns:.3f}, clean S "
                  f"{clean.slowdown:.3f}; lost {duty.lost_share:.1%}; fixing {top.subject} saves {top.saved_share:.1%}; "
                  f"most often last: {duty.last_rank}", flush=True)
            print("\n".join(duty.describe()[1:]), flush=True)


if __name__ == "__main__":
    main()
