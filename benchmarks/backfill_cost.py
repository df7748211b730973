"""What recording the collectives no wrapper saw costs (`collector/backfill.py`): the writer thread's look at the Flight
Recorder at every flush, in a job whose collectives the wrappers see and in one with a compiled graph's.

    .venv/bin/python benchmarks/backfill_cost.py               # ~10 s on 2 cores, the default read budget (0.5 %)
    .venv/bin/python benchmarks/backfill_cost.py --share 1     # reads unbudgeted: every compiled collective read
    .venv/bin/python benchmarks/backfill_cost.py --steps 3     # every part, briefly (tests/unit/test_backfill.py)

One process (gloo, world size 1, torch threads 1, TORCH_FR_BUFFER_SIZE=2000 as `rankwatch torchrun` sets it), a
Collector with torch.distributed and the functional collectives instrumented (what `attach()` does), a MemorySink,
the ring buffer filled first (2,000 collectives: a look reads the whole buffer). Two phases of `--steps` steps, the
writer's drain run after every step (a flush):

- eager: each step issues `--collectives` all-reduces through the wrappers; every look should find nothing missed
  and never read the entries;
- compiled: each step also calls a compiled function (torch.compile, aot_eager, fullgraph) that issues
  `--compiled` functional all-reduces no wrapper sees; every look reads the entries and records them.

It prints, as a figure table: per phase the writer thread's CPU per look (`time.thread_time_ns` across
`Backfill.rows`, median and max), the reads of the whole buffer (wall time each: torch's dump holds the GIL the
training thread needs), the rows made and the entries that left the ring unread, and the reads' share of the
phase's wall time; then the table at close against torch's count. A look runs once per flush, on the writer thread
(`SinkConfig.flush_interval_s`, 5 s by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = "RANKWATCH_BACKFILL_BENCH_CHILD"


def _child(steps: int, collectives: int, compiled: int, share: float) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from rankwatch.base.schema import Collectives, Table, column_names
    from rankwatch.collector import flight
    from rankwatch.collector.collector import Collector, CollectorConfig
    from rankwatch.collector.funcol import instrument_funcol
    from rankwatch.collector.instrument import instrument_distributed
    from rankwatch.collector.sink import MemorySink

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="backfill-bench-")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    x = torch.ones(256)
    for _ in range(2000):  # a full ring buffer: every read of the entries reads 2,000
        dist.all_reduce(x)
    sink = MemorySink()
    c = Collector(CollectorConfig(run_dir=Path(tmp), handle_sigterm=False, count_collectives=True, liveness=False,
                                  flight_read_share=share), rank=0, world_size=1, sink=sink)
    c.start()
    undo = [instrument_distributed(c), instrument_funcol(c)]
    backfill = c._backfill
    assert backfill is not None, "the Flight Recorder is off"
    cost: list[int] = []
    look = backfill.rows

    def timed(*args: object, **kwargs: object) -> list[tuple[object, ...]]:
        t = time.thread_time_ns()
        try:
            return look(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            cost.append(time.thread_time_ns() - t)

    backfill.rows = timed  # type: ignore[method-assign]

    world = dist.group.WORLD
    assert world is not None

    def f(t: torch.Tensor) -> torch.Tensor:
        for _ in range(compiled):
            t = funcol.all_reduce(t, "sum", world) * 0.5
        return t

    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    g(x)  # compiled before the clock runs (its collectives are the set-up's)
    c.sink.flush()
    phases = {}
    for phase, step_fn in (("eager", None), ("compiled", g)):
        cost.clear()
        reads0, found0, lost0, read_ns0 = backfill.reads, backfill.found, backfill.lost, backfill.read_ns
        wall0 = time.perf_counter()
        for s in range(steps):
            with c.step(s if phase == "eager" else steps + s):
                for _ in range(collectives):
                    dist.all_reduce(x)
                if step_fn is not None:
                    step_fn(x)
            c.sink.flush()
        phases[phase] = (list(cost), backfill.reads - reads0, backfill.found - found0, backfill.lost - lost0,
                         backfill.read_ns - read_ns0, time.perf_counter() - wall0)
    found0, lost0, reads0 = backfill.found, backfill.lost, backfill.reads
    c.record_collective_counts()  # the last look reads whatever it costs, before the groups go
    c.sink.flush()
    closing = (backfill.reads - reads0, backfill.found - found0, backfill.lost - lost0)
    for u in undo:
        u()
    c.close(exit_code=0)
    cols = column_names(Table.COLLECTIVES)
    seqs = [r[cols.index(Collectives.GROUP_SEQ)] for r in sink.rows(Table.COLLECTIVES)]
    events = [r for r in sink.rows(Table.EVENTS) if r[column_names(Table.EVENTS).index("kind")] == "collective_counts"]
    counted = events[0][column_names(Table.EVENTS).index("message")] if events else "none"
    dist.destroy_process_group()
    ring = flight.ring_size()
    rows: list[tuple[str, str]] = []
    for phase, (c_ns, reads, found, lost, read_ns, wall) in phases.items():
        what = (f"{collectives} wrapped all-reduces a step" if phase == "eager" else
                f"{collectives} wrapped + {compiled} compiled all-reduces a step")
        rows.append((f"{phase} ({what}, {steps} steps, a look after each): writer CPU per look, median / max, µs",
                     f"{statistics.median(c_ns) / 1e3:.1f} / {max(c_ns) / 1e3:.1f}"))
        each = f"{read_ns / reads / 1e6:.1f} ms each" if reads else "none"
        rows.append((f"{phase}: reads of the whole ring ({ring:,} entries); rows made; entries left unread",
                     f"{reads} ({each}); {found}; {lost}"))
        rows.append((f"{phase}: reads' share of the phase's wall time (budget {share:.1%})",
                     f"{read_ns / 1e9 / wall * 100:.2f} %"))
    eager_ms = statistics.median(phases["eager"][0]) / 1e6
    rows.append(("a look that reads nothing, at one per 5 s flush: share of a core", f"{eager_ms / 5e3 * 100:.4f} %"))
    rows.append(("at close (the last look, read whatever it costs): reads; rows made; entries left unread",
                 "; ".join(str(x) for x in closing)))
    rows.append(("table at close: rows, distinct operations; torch's count while recording",
                 f"{len(seqs)}, {len(set(seqs))}; {counted}"))
    rows.append(("collector internal errors (in process)", str(c.errors)))
    print("| figure | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--collectives", type=int, default=100)
    p.add_argument("--compiled", type=int, default=10)
    p.add_argument("--share", type=float, default=0.005, help="CollectorConfig.flight_read_share")
    a = p.parse_args()
    if os.environ.get(_CHILD):
        _child(a.steps, a.collectives, a.compiled, a.share)
        return
    env = {**os.environ, _CHILD: "1", "TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode)


if __name__ == "__main__":
    main()
