"""Checkpoint save and load wall times of the canary, per phase, from the collector's checkpoint_phases rows.

    .venv/bin/python benchmarks/checkpoint_times.py [--steps 8] [--every 2] [--layout dp=2,tp=2] [--small]

Runs the canary with a checkpoint every `--every` steps, then a fresh job of the same layout that loads the newest
committed checkpoint (verify + load). Prints, per phase, the median and max over ranks and checkpoints of the
phase's wall time, and per checkpoint the save time as the job sees it: the slowest rank's sum of phases (the
commit waits for the slowest rank). Times include contention between the ranks for the machine's cores.
"""

from __future__ import annotations

import argparse
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

# Nothing heavy at module level: spawn re-imports this script in every rank.


def _load_rank(rank: int, run_dir: Path, layout_text: str, model_cfg: Any, port: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from rankwatch.base.topology import Layout
    from rankwatch.canary.model import Stage
    from rankwatch.collector.collector import Collector, CollectorConfig
    from rankwatch.recovery.catalog import choose
    from rankwatch.recovery.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    layout = Layout.parse(layout_text)
    store = dist.TCPStore("127.0.0.1", port, layout.world_size, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world_size, timeout=timedelta(seconds=60))
    _, tp, pp = layout.coords(rank)
    model = Stage(model_cfg, seed=0, pp=pp, pp_size=layout.pp, tp=tp, tp_size=layout.tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    c = Collector(CollectorConfig(run_dir=out, handle_sigterm=False), rank=rank, world_size=layout.world_size).start()
    candidate = choose(run_dir, layout=layout, world_size=layout.world_size)
    load_checkpoint(c, candidate, rank=rank, layout=layout, group=dist.group.WORLD, model=model, optimizer=optimizer)
    c.close(exit_code=0)
    dist.destroy_process_group()


def _report(title: str, run_dir: Path) -> None:
    from rankwatch.analytics.store import connect

    con = connect(run_dir)
    print(f"{title}: phase            median ms   max ms   MB (max over ranks)")
    for phase, med, mx, mb in con.execute(
        "SELECT phase, median(duration_ns) / 1e6, max(duration_ns) / 1e6, max(bytes) / 1e6 FROM checkpoint_phases "
        "GROUP BY phase ORDER BY min(start_mono_ns)"
    ).fetchall():
        print(f"  {phase:<20} {med:>9.1f} {mx:>8.1f} {mb or 0:>8.2f}")
    for ckpt, total in con.execute(
        "SELECT checkpoint_id, max(t) / 1e6 FROM (SELECT checkpoint_id, rank, sum(duration_ns) t FROM checkpoint_phases "
        "GROUP BY ALL) GROUP BY ALL ORDER BY checkpoint_id"
    ).fetchall():
        print(f"  {ckpt}: {total:.1f} ms (slowest rank, all phases)")


def main() -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from rankwatch.base.topology import Layout
    from rankwatch.canary import CanaryConfig, launch
    from rankwatch.canary.model import ModelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--layout", default="dp=2,tp=2")
    p.add_argument("--small", action="store_true", help="the tests' small model instead of the default")
    args = p.parse_args()
    model = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2) if args.small else ModelConfig()
    layout = Layout.parse(args.layout)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        result = launch(CanaryConfig(run_dir=run_dir, steps=args.steps, layout=layout, checkpoint_every=args.every,
                                     model=model, gpu="off", flush_interval_s=0.5), timeout_s=600)
        if not result.ok:
            raise SystemExit(f"canary failed: exit codes {result.exit_codes}")
        _report(f"save ({layout}, {layout.world_size} ranks)", run_dir)
        out = Path(tmp) / "load"
        out.mkdir()
        store = dist.TCPStore("127.0.0.1", 0, layout.world_size, is_master=True, wait_for_workers=False)
        mp.start_processes(_load_rank, args=(run_dir, args.layout, model, store.port, out), nprocs=layout.world_size,
                           start_method="spawn")
        _report("load", out)


if __name__ == "__main__":
    main()
