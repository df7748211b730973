"""What reading torch's Flight Recorder costs the training thread: the JSON dump (`_dump_fr_trace_json`, torch's only
non-pickle interface to the ring) holds the GIL, so a thread spinning beside it stalls for about as long.

    .venv/bin/python benchmarks/flight_dump_gil.py [--entries 2000] [--reads 5]

One process, gloo, world size 1, TORCH_FR_BUFFER_SIZE = --entries, the ring filled with that many all-reduces. Per
read: the dump's wall time, the spinner's longest gap during it (the GIL held), `json.loads`' time, and per ring
entry; then the projection for issue 29's case (1,000 collectives per 0.5 s step, each entry read at least once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=2000)
    p.add_argument("--reads", type=int, default=5)
    args = p.parse_args()
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.entries)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(256)
    for _ in range(args.entries + 100):
        dist.all_reduce(t)
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    stop = False
    gaps: list[float] = []

    def spin() -> None:
        last = time.perf_counter()
        while not stop:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(0.2)
    rows = []
    for _ in range(args.reads):
        gaps.clear()
        t0 = time.perf_counter()
        raw = dump(True, False)
        t1 = time.perf_counter()
        held = max(gaps) if gaps else t1 - t0
        entries = len(json.loads(raw)["entries"])
        t2 = time.perf_counter()
        rows.append((t1 - t0, held, t2 - t1, entries))
        time.sleep(0.05)
    stop = True
    spinner.join()
    dist.destroy_process_group()
    print(f"{'read':>4} {'dump ms':>8} {'spinner longest gap ms':>23} {'json.loads ms':>14} {'entries':>8} "
          f"{'dump us/entry':>14}")
    for i, (d, g, lo, n) in enumerate(rows):
        print(f"{i:>4} {d * 1e3:>8.1f} {g * 1e3:>23.1f} {lo * 1e3:>14.1f} {n:>8} {d / n * 1e6:>14.1f}")
    per = statistics.median(d / n for d, _, _, n in rows[1:] or rows)  # the first read warms the allocator up
    print(f"\ndump, median over reads after the first: {per * 1e6:.1f} us of GIL per entry; read once each, 1,000 "
          f"collectives per 0.5 s step cost >= {per * 2000 * 100:.2f} % of the training thread (issue 29's target: "
          "0.3 %)")


if __name__ == "__main__":
    main()
