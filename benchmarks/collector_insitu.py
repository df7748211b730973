"""Where the collector's time goes inside a real job: time per step in each hot-path method, on rank 0.

    .venv/bin/python benchmarks/collector_insitu.py [--steps 300] [--nproc 4] [--layout dp=2,tp=2] [--clock wall|cpu]

Each rank wraps the collector's hot-path methods with a timing accumulator before it trains, then rank 0 prints,
per method, calls per step, time per step and time per call. `Faults.__bool__` — a trivial method the canary
calls at every collective, collector on or off — is the control: what a near-empty Python call plus the wrapper
costs in this job, to compare with its cost in a warm loop (printed too).

Nested methods are included in their callers' figures (`CollectiveTracker.enter` includes `_Open.__enter__`).
The totals count only outermost calls (a per-thread depth counter), so nothing is counted twice: the collector's
time per step on the training path, split into collectives (explicit ones and the DDP hook's enter and exit),
phases and the step context. The wrapper's own cost is inside every figure (about one control call each), so
compare the same design's methods with each other, or two versions of the collector at equal call counts.

``--clock wall`` (default) times with perf_counter: it includes any preemption of the rank while inside the
method, as the training step's wall time does. ``--clock cpu`` times with the thread's CPU clock: preemption is
left out, so figures taken on a loaded machine stay comparable (each reading is a system call, ~1 µs, in every
figure alike).

The method list covers both the current collector and earlier versions of it (a method that does not exist is
skipped), so a checkout of an older collector can be measured with this script for a before/after comparison.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Nothing heavy at module level: spawn re-imports this script in every rank.

_NS: dict[str, int] = {}
_CALLS: dict[str, int] = {}
_TOP_NS: dict[str, int] = {}
"""Per category: time of outermost calls only."""
_TLS = threading.local()
CONTROL = "Faults.__bool__"

#: (module, class, method, category): category None = not part of the collector's totals
_METHODS: tuple[tuple[str, str, str, str | None], ...] = (
    ("rankwatch.canary.faults", "Faults", "__bool__", None),
    # collectives: the context manager (current: _Open; earlier: _Timed around tracker.enter/exit)
    ("rankwatch.collector.collector", "Collector", "collective", "collectives"),
    ("rankwatch.collector.collectives", "_Open", "__enter__", "collectives"),
    ("rankwatch.collector.collectives", "_Open", "__exit__", "collectives"),
    ("rankwatch.collector.collectives", "_Timed", "__enter__", "collectives"),
    ("rankwatch.collector.collectives", "_Timed", "__exit__", "collectives"),
    ("rankwatch.collector.collectives", "CollectiveTracker", "enter", "collectives"),
    ("rankwatch.collector.collectives", "CollectiveTracker", "exit", "collectives"),
    ("rankwatch.collector.collectives", "CollectiveTracker", "_safe_exit", "collectives"),
    ("rankwatch.collector.collectives", "CollectiveTracker", "info", "collectives"),
    # phases
    ("rankwatch.collector.collector", "Collector", "phase", "phases"),
    ("rankwatch.collector.collector", "_Phase", "__enter__", "phases"),
    ("rankwatch.collector.collector", "_Phase", "__exit__", "phases"),
    # the step context (current: _Step; earlier: a generator context manager around _begin_step/_end_step)
    ("rankwatch.collector.collector", "Collector", "step", "step"),
    ("rankwatch.collector.collector", "_Step", "__enter__", "step"),
    ("rankwatch.collector.collector", "_Step", "__exit__", "step"),
    ("rankwatch.collector.collector", "Collector", "_begin_step", "step"),
    ("rankwatch.collector.collector", "Collector", "_end_step", "step"),
    ("contextlib", "_GeneratorContextManager", "__enter__", "step"),
    ("contextlib", "_GeneratorContextManager", "__exit__", "step"),
    # fingerprints (every fingerprint_every steps)
    ("rankwatch.collector.collector", "Collector", "maybe_fingerprint", "fingerprint"),
)


def _is_collector_step(cm: Any) -> bool:
    """A contextlib context manager made by `Collector.step` (earlier versions), not one of the trainer's own."""
    return getattr(getattr(cm, "func", None), "__qualname__", "") == "Collector.step"


def _wrap(cls: type, name: str, category: str | None, clock: Callable[[], int]) -> None:
    f: Callable[..., Any] = getattr(cls, name)
    key = f"{cls.__name__}.{name}"
    generic = cls.__name__ == "_GeneratorContextManager"

    def timed(*args: Any, **kwargs: Any) -> Any:
        if generic and not _is_collector_step(args[0]):
            return f(*args, **kwargs)
        tls = _TLS
        depth = getattr(tls, "depth", 0)
        tls.depth = depth + 1
        t0 = clock()
        try:
            return f(*args, **kwargs)
        finally:
            dt = clock() - t0
            tls.depth = depth
            _NS[key] = _NS.get(key, 0) + dt
            _CALLS[key] = _CALLS.get(key, 0) + 1
            if depth == 0 and category is not None:
                _TOP_NS[category] = _TOP_NS.get(category, 0) + dt

    setattr(cls, name, timed)


def _instrument(clock: Callable[[], int]) -> list[str]:
    import importlib

    wrapped = []
    for module, cls_name, name, category in _METHODS:
        cls = getattr(importlib.import_module(module), cls_name, None)
        if cls is None or name not in vars(cls):
            continue
        _wrap(cls, name, category, clock)
        wrapped.append(f"{cls_name}.{name}")
    return wrapped


def _rank(index: int, cfg: Any, port: int, clock_name: str) -> None:
    from rankwatch.canary.loop import _Rank

    clock = time.thread_time_ns if clock_name == "cpu" else time.perf_counter_ns
    _instrument(clock)
    r = _Rank(cfg, index, port)
    r.setup()
    for acc in (_NS, _CALLS, _TOP_NS):  # setup's calls are not steps
        acc.clear()
    r.run()
    if index == 0:
        steps = cfg.steps
        import rankwatch.collector.collectives as K

        print(f"rank 0, {clock_name} time per step ({steps} steps, {cfg.layout}; collector in {os.path.dirname(K.__file__)}):")
        print(f"  {'method':<34}{'calls/step':>11}{'µs/step':>10}{'µs/call':>9}")
        for key, ns in sorted(_NS.items(), key=lambda kv: -kv[1]):
            calls = _CALLS[key]
            print(f"  {key:<34}{calls / steps:>11.2f}{ns / steps / 1e3:>10.1f}{ns / calls / 1e3:>9.2f}")
        total = sum(_TOP_NS.values())
        print("  collector total (outermost calls only), µs/step: "
              + ", ".join(f"{cat} {ns / steps / 1e3:.1f}" for cat, ns in sorted(_TOP_NS.items()))
              + f"; all {total / steps / 1e3:.1f}", flush=True)
    r.c.close(exit_code=0)
    os._exit(0)


def main() -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from rankwatch.base.topology import Layout
    from rankwatch.canary.config import CanaryConfig
    from rankwatch.canary.faults import Faults

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layout", default="dp=2,tp=2")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="perf_counter or the thread's CPU time")
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
        mp.start_processes(
            _rank, args=(cfg, store.port, args.clock), nprocs=cfg.world_size, join=True, start_method="spawn"
        )


if __name__ == "__main__":
    main()
