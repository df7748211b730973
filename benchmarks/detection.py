"""Detection quality over the labeled suite of simulated scenarios.

    .venv/bin/python benchmarks/detection.py [--only NAME_SUBSTRING] [--keep DIR] [--jobs N] [--seed-offset K]

For every scenario of `simulator.standard_suite()` it simulates the run, analyzes it exactly as
`rankwatch analyze` does, and matches the incidents against the scenario's ground-truth labels:

- an incident matches a label when the class is the same and the subject is the same or the ranks overlap;
- per class: precision = matched incidents / incidents, recall = matched labels / labels, F1;
- localization accuracy = matched labels whose incident names the exact subject (kind and id) / matched labels;
- detection latency = detection_step - labeled onset step, for matched stragglers;
- false incidents on clean controls = every incident raised in a scenario that expects none.

Targets (issue 3): F1 >= 0.95 per class, localization >= 0.95, no incident on any clean control, stragglers
detected within 10 steps of onset.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rankwatch.analytics.analyze import analyze
from rankwatch.simulator import Scenario, simulate, standard_suite

TARGET_F1 = 0.95
TARGET_LOCALIZATION = 0.95
TARGET_LATENCY_STEPS = 10


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    scenario: str
    ranks: int
    steps: int
    expected: tuple[dict[str, Any], ...]
    incidents: tuple[dict[str, Any], ...]
    seconds_simulate: float
    seconds_analyze: float


def _run_one(scenario: Scenario, root: Path) -> Outcome:
    out = root / scenario.name
    t0 = time.perf_counter()
    simulate(scenario.config, out)
    t1 = time.perf_counter()
    incidents = analyze(out).incidents
    t2 = time.perf_counter()
    labels = json.loads((out / "labels.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return Outcome(
        scenario=scenario.name, ranks=labels["ranks"], steps=labels["steps"], expected=tuple(labels["expected"]),
        incidents=tuple(i.to_dict() for i in incidents), seconds_simulate=t1 - t0, seconds_analyze=t2 - t1,
    )


def _matches(label: dict[str, Any], inc: dict[str, Any]) -> bool:
    if label["class"] != inc["class"]:
        return False
    same_subject = (label["subject_kind"], str(label["subject"])) == (inc["subject_kind"], str(inc["subject"]))
    return same_subject or bool(set(label["ranks"]) & set(inc["ranks"]))


@dataclass
class _Tally:
    labels: int = 0
    found: int = 0
    incidents: int = 0
    true_incidents: int = 0
    localized: int = 0

    def f1(self) -> tuple[float, float, float]:
        p = self.true_incidents / self.incidents if self.incidents else 1.0
        r = self.found / self.labels if self.labels else 1.0
        return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def score(outcomes: list[Outcome]) -> int:
    tallies: dict[str, _Tally] = {}
    latencies: list[int] = []
    clean_false: list[str] = []
    misses: list[str] = []
    for o in outcomes:
        if not o.expected:
            clean_false += [f"{o.scenario}: {i['class']} {i['subject_kind']}:{i['subject']} — {i['summary']}" for i in o.incidents]
        used: set[int] = set()
        for label in o.expected:
            t = tallies.setdefault(label["class"], _Tally())
            t.labels += 1
            hit = next((k for k, inc in enumerate(o.incidents) if k not in used and _matches(label, inc)), None)
            if hit is None:
                misses.append(f"{o.scenario}: missed {label['class']} {label['subject_kind']}:{label['subject']}")
                continue
            used.add(hit)
            inc = o.incidents[hit]
            t.found += 1
            if (label["subject_kind"], str(label["subject"])) == (inc["subject_kind"], str(inc["subject"])):
                t.localized += 1
            else:
                misses.append(f"{o.scenario}: {label['class']} localized to {inc['subject_kind']}:{inc['subject']}, "
                              f"expected {label['subject_kind']}:{label['subject']}")
            if label["class"] == "straggler" and inc["detection_step"] is not None and label["onset_step"] is not None:
                latencies.append(int(inc["detection_step"]) - int(label["onset_step"]))
        for k, inc in enumerate(o.incidents):
            t = tallies.setdefault(inc["class"], _Tally())
            t.incidents += 1
            if k in used:
                t.true_incidents += 1
            elif o.expected:
                misses.append(f"{o.scenario}: extra {inc['class']} {inc['subject_kind']}:{inc['subject']} — {inc['summary']}")

    print(f"\n{'class':<14} {'labels':>6} {'found':>6} {'incid.':>6} {'prec':>6} {'recall':>6} {'F1':>6} {'local.':>6}")
    failed = False
    all_found = all_localized = 0
    for klass in sorted(tallies):
        t = tallies[klass]
        p, r, f1 = t.f1()
        loc = t.localized / t.found if t.found else 1.0
        all_found += t.found
        all_localized += t.localized
        flag = "" if (f1 >= TARGET_F1 or not t.labels and not t.incidents) else "  <-- below target"
        failed |= bool(flag)
        print(f"{klass:<14} {t.labels:>6} {t.found:>6} {t.incidents:>6} {p:>6.3f} {r:>6.3f} {f1:>6.3f} {loc:>6.3f}{flag}")
    localization = all_localized / all_found if all_found else 1.0
    controls = sum(1 for o in outcomes if not o.expected)
    print(f"\nlocalization accuracy: {localization:.3f} (target >= {TARGET_LOCALIZATION})")
    print(f"false incidents on {controls} clean controls: {len(clean_false)} (target 0)")
    if latencies:
        print(f"straggler detection latency (steps after onset): median {statistics.median(latencies):.0f}, "
              f"max {max(latencies)} over {len(latencies)} (target <= {TARGET_LATENCY_STEPS})")
    failed |= localization < TARGET_LOCALIZATION or bool(clean_false)
    failed |= bool(latencies) and max(latencies) > TARGET_LATENCY_STEPS
    for line in clean_false + misses:
        print(f"  {line}")
    print("\nverdict:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run scenarios whose name contains this")
    ap.add_argument("--keep", type=Path, default=None, help="simulate into this folder (default: a temp folder)")
    ap.add_argument("--jobs", type=int, default=2, help="scenarios in parallel")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="add this to every scenario's seed: the same faults over fresh noise (a held-out draw)")
    args = ap.parse_args()
    suite = [Scenario(name=s.name, config=replace(s.config, seed=s.config.seed + args.seed_offset))
             for s in standard_suite() if args.only in s.name]
    root = args.keep or Path(tempfile.mkdtemp(prefix="rankwatch-detection-"))
    sizes = sorted({s.config.world_size for s in suite})
    print(f"{len(suite)} scenarios, {min(sizes)}..{max(sizes)} ranks, "
          f"{sum(1 for s in suite if s.name.startswith('clean'))} clean controls; simulating into {root}")
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for o in pool.map(_run_one, suite, [root] * len(suite)):
            status = "clean" if not o.expected else ",".join(sorted({e["class"] for e in o.expected}))
            got = ",".join(f"{i['class']}:{i['subject_kind']}:{i['subject']}" for i in o.incidents) or "-"
            print(f"  {o.scenario:<40} {o.ranks:>5} ranks {o.steps:>5} steps  expect {status:<24} got {got}"
                  f"  ({o.seconds_simulate:.1f}+{o.seconds_analyze:.1f}s)", flush=True)
            outcomes.append(o)
    print(f"suite took {time.perf_counter() - t0:.0f}s")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return score(outcomes)


if __name__ == "__main__":
    sys.exit(main())
