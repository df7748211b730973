"""Write the independent labeled runs of a split.

    python benchmarks/independent_suite.py --split tune|heldout --timing cpu|gpu --out DIR [--only SUBSTR]

Each scenario becomes DIR/<name>/ (telemetry/ and labels.json); an index of what was written goes to
DIR/index.json. Held-out runs are for the reported figure only: do not generate them while tuning.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from independent import generate, scenarios  # benchmarks/independent, beside this script


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tune", "heldout"), required=True)
    ap.add_argument("--timing", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--only", default=None, help="only scenarios whose name contains this")
    args = ap.parse_args(argv)
    chosen = [s for s in scenarios(args.split, args.timing) if args.only is None or args.only in s.name]
    args.out.mkdir(parents=True, exist_ok=True)
    index = []
    t_all = time.perf_counter()
    for sc in chosen:
        t = time.perf_counter()
        run = generate(sc, args.out, args.timing)
        dt = time.perf_counter() - t
        index.append({"name": sc.name, "kind": sc.kind, "ranks": sc.ranks, "steps": sc.steps, "seconds": round(dt, 2)})
        print(f"{sc.name:<56} {sc.ranks:>5} ranks {sc.steps:>4} steps {dt:6.1f} s", flush=True)
        del run
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"{len(chosen)} runs in {time.perf_counter() - t_all:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
