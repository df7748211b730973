"""Where the collector's time goes inside a real job: wall time per step in each hot-path method, on rank 0.

    .venv/bin/python benchmarks/collector_insitu.py [--steps 300] [--nproc 4] [--layout dp=2,tp=2]

Each rank wraps the collector's hot-path methods with a perf_counter accumulator before it trains (the
wrapper adds its own ~0.3 µs a call), then rank 0 prints µs per step per method. `Faults.__bool__` — a
trivial method the canary calls at every collective, collector on or off — is the control: what a near-empty
Python call costs in this job, to compare with its cost in a warm loop (printed too). Nested methods are
included in their callers' figures (`_Timed.__enter__` includes `CollectiveTracker.enter`). Wall time includes
any preemption of the rank while inside the method, as it does for the training step itself.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Nothing heavy at module level: spawn re-imports this script in every rank.

_ACC: dict[str, int] = {}


def _wrap(cls: type, name: str) -> None:
    f: Callable[..., Any] = getattr(cls, name)
    key = f"{cls.__name__}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return f(*args, **kwargs)
        finally:
            _ACC[key] = _ACC.get(key, 0) + time.perf_counter_ns() - t0

    setattr(cls, name, timed)


def _hot_path() -> list[tuple[type, str]]:
    import rankwatch.collector.collectives as K
    import rankwatch.collector.collector as C
    from rankwatch.trainer.faults import Faults

    return [
        (Faults, "__bool__"),
        (C.Collector, "_begin_step"),
        (C.Collector, "_end_step"),
        (C._Phase, "__enter__"),
        (C._Phase, "__exit__"),
        (K._Timed, "__enter__"),
        (K._Timed, "__exit__"),
        (K.CollectiveTracker, "enter"),
        (K.CollectiveTracker, "exit"),
        (K.CollectiveTracker, "info"),
        (C.Collector, "maybe_fingerprint"),
    ]


def _rank(index: int, cfg: Any, port: int) -> None:
    from rankwatch.trainer.canary import _Rank

    for cls, name in _hot_path():
        _wrap(cls, name)
    r = _Rank(cfg, index, port)
    r.setup()
    r.run()
    if index == 0:
        print(f"rank 0, µs of wall time per step ({cfg.steps} steps, {cfg.layout}):", flush=True)
        for key, ns in sorted(_ACC.items(), key=lambda kv: -kv[1]):
            print(f"  {key:<34}{ns / cfg.steps / 1e3:>9.1f}", flush=True)
    r.c.close(exit_code=0)
    os._exit(0)


def main() -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from rankwatch.trainer.canary import CanaryConfig
    from rankwatch.trainer.faults import Faults
    from rankwatch.trainer.parallel import Layout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layout", default="dp=2,tp=2")
    args = p.parse_args()
    faults = Faults()
    start = time.perf_counter()
    for _ in range(100_000):
        bool(faults)
    print(f"warm loop: Faults.__bool__ {(time.perf_counter() - start) / 100_000 * 1e6:.2f} µs a call")
    with tempfile.TemporaryDirectory(prefix="rankwatch-insitu-") as tmp:
        cfg = CanaryConfig(
            run_dir=Path(tmp), steps=args.steps, layout=Layout.parse(args.layout, nproc=args.nproc), gpu="replay"
        )
        store = dist.TCPStore("127.0.0.1", 0, cfg.world_size, is_master=True, wait_for_workers=False)
        mp.start_processes(_rank, args=(cfg, store.port), nprocs=cfg.world_size, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
